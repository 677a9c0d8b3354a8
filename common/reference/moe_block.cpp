// Mixture of experts: softmax router, top-k (ties to the lower expert id), weights renormalised
// when norm_topk_prob, SwiGLU experts (gpt-oss: top-k then softmax, biased clamped-SwiGLU
// experts, as the layer's FfnPart says); qwen3next adds a shared expert scaled by
// sigmoid(dot(h, shared_router)) (glm4moe's ungated; its router: sigmoid scores, a choice bias,
// group-limited top-k, routed scaling). Dense layers (glm4moe's leading ones) run one SwiGLU
// FFN instead. Tokens routed to one expert are gathered so its weights are
// read once per batch; each token's outputs are summed in its own top-k order, so a token gets
// the same sum whatever else is in the batch. The pieces live in moe_parts.cpp, where the process
// group (gpu_worker, cpu_expert_worker) runs them in different processes.
#include <algorithm>
#include <vector>

#include "common/reference/executor.h"
#include "common/reference/moe_parts.h"

namespace moraine::reference {

void ReferenceExecutor::moe_block(int64_t il, const float* h, int64_t n, float* x) {
  const model::HParams& hp = m_.hp;
  const model::MoeWeights& W = block(il).moe;
  const int64_t d = hp.n_embd;
  const int64_t ne = hp.n_expert;
  const int64_t k = hp.n_expert_used;

  RouterScratch router;
  router.reserve(hp, n);
  std::vector<int32_t> chosen(n * k);
  std::vector<float> weight(n * k);
  const model::FfnPart& part = block(il).recipe.ffn;
  route_layer(hp, part, W, h, n, chosen.data(), weight.data(), router, pool_, order_);

  // Per expert: gather its tokens, run it once, scatter into [token][slot].
  std::vector<float> slot_out(n * k * d);
  std::vector<int64_t> rows;  // t * k + slot
  std::vector<float> xg, yg;
  ExpertScratch scratch;
  scratch.reserve(n, hp.n_ff_exp);
  for (int64_t e = 0; e < ne; ++e) {
    rows.clear();
    for (int64_t i = 0; i < n * k; ++i) {
      if (chosen[i] == e) rows.push_back(i);
    }
    if (rows.empty()) continue;
    const int64_t m = static_cast<int64_t>(rows.size());
    xg.resize(m * d);
    yg.resize(m * d);
    for (int64_t j = 0; j < m; ++j) std::copy_n(h + (rows[j] / k) * d, d, xg.data() + j * d);
    routed_expert(W, e, part.experts, xg.data(), m, yg.data(), scratch, pool_, order_);
    for (int64_t j = 0; j < m; ++j) std::copy_n(yg.data() + j * d, d, slot_out.data() + rows[j] * d);
  }

  std::vector<float> shared;
  if (W.shared_up) {
    shared.resize(n * d);
    ExpertScratch shared_scratch;
    shared_scratch.reserve(n, W.shared_gate.n_rows);
    swiglu_expert(W.shared_gate, W.shared_up, W.shared_down, h, n, shared.data(), shared_scratch, pool_,
                  order_);
  }

  std::vector<const float*> slot_rows(n * k);
  for (int64_t i = 0; i < n * k; ++i) slot_rows[i] = slot_out.data() + i * d;
  moe_combine(hp, W, h, n, weight.data(), slot_rows.data(), W.shared_up ? shared.data() : nullptr, x);
}

void ReferenceExecutor::dense_ffn_block(int64_t il, const float* h, int64_t n, float* x) {
  const model::DenseFfnWeights& W = block(il).dense;
  std::vector<float> y(n * m_.hp.n_embd);
  ExpertScratch scratch;
  scratch.reserve(n, W.gate.n_rows);
  dense_ffn(W, h, n, x, y.data(), scratch, pool_, order_);
}

void ReferenceExecutor::ffn_block(int64_t il, const float* h, int64_t n, float* x) {
  if (block(il).recipe.ffn.kind == model::FfnKind::Dense) {
    dense_ffn_block(il, h, n, x);
  } else {
    moe_block(il, h, n, x);
  }
}

}  // namespace moraine::reference
