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

}  // namespace moraine::cuda
