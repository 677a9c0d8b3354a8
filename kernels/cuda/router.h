// MoE router on router logits: softmax over the n_expert logits of each token, then the k most
// probable experts (ties to the lower id), their weights renormalised to sum to one when
// `renormalize` (qwen3moe's norm_topk_prob), else the plain probabilities. Scalar reference:
// moraine::reference::route_top_k (common/reference/moe_parts.cpp); the exponentials and the
// softmax sum differ from it only in the last bits (device expf, tree order), which can reorder
// experts whose probabilities tie to the last bit.
// (The shared expert's sigmoid gate is applied in moe_combine.h.)
//
// Memory contract (device): logits [n][n_expert] floats; chosen / weight [n][k], slot s of token t
// at t * k + s in descending probability order.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moraine::cuda {

// Throws std::invalid_argument for k outside 1..min(n_expert, 64) or n_expert above 4096.
void route_softmax_top_k(const float* logits, int64_t n, int64_t n_expert, int64_t k, bool renormalize,
                         int32_t* chosen, float* weight, cudaStream_t stream = nullptr);

// gpt-oss's router (RouterKind::TopKSoftmax): l = logits + bias (bias nullable, [n_expert]), the k
// largest l (ties to the lower id), softmax over those k: weight[s] = exp(l_s - l_0) / sum in
// slot order. Scalar reference: moraine::reference::route_top_k_softmax. Same limits as above.
void route_top_k_softmax(const float* logits, const float* bias, int64_t n, int64_t n_expert, int64_t k,
                         int32_t* chosen, float* weight, cudaStream_t stream = nullptr);

// The sigmoid router of glm4moe / deepseek v3 (RouterKind::SigmoidGroupTopK): s = sigmoid(logit);
// the choice ranks s + score_bias (nullable, [n_expert]); with n_group > 1 only the topk_group
// groups (contiguous blocks of n_expert / n_group) whose two best biased scores sum highest take
// part (ties to the lower group id); the k largest (ties to the lower id); weight = s of the
// chosen, divided by their sum in slot order (floored at 2^-14, as llama.cpp) when renormalize,
// then times routed_scale. Scalar reference: moraine::reference::route_layer's sigmoid path (the
// device expf differs from the host's in the last bits). Limits as above, plus n_group dividing
// n_expert, topk_group in 1..n_group and topk_group groups holding at least k experts.
void route_sigmoid_group_top_k(const float* logits, const float* score_bias, int64_t n, int64_t n_expert, int64_t k,
                               int64_t n_group, int64_t topk_group, bool renormalize, float routed_scale,
                               int32_t* chosen, float* weight, cudaStream_t stream = nullptr);

// weight[i] = weight[i] * scale, one rounded product each: RouterPart::routed_scale after the
// softmax routers, as route_layer applies it (the sigmoid router scales in its own launch).
void scale_router_weights(float* weight, int64_t count, float scale, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
