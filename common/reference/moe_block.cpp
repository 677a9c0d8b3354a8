// Mixture of experts: softmax router, top-k (ties to the lower expert id), weights renormalised
// when norm_topk_prob, SwiGLU experts; qwen3next adds a shared expert scaled by
// sigmoid(dot(h, shared_router)). Tokens routed to one expert are gathered so its weights are
// read once per batch; each token's outputs are summed in its own top-k order, so a token gets
// the same sum whatever else is in the batch.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/reference/executor.h"
#include "common/reference/matmul.h"
#include "common/reference/ops.h"

namespace moraine::reference {

namespace {

void swiglu_expert(const model::Matrix& gate, const model::Matrix& up, const model::Matrix& down,
                   const float* x, int64_t n, float* y, ThreadPool& pool) {
  const int64_t ff = gate.n_rows;
  std::vector<float> g(n * ff), u(n * ff);
  PackedActivations px = pack_activations(gate.type, x, n, gate.n_cols);
  matmul(gate, px, g.data(), pool);
  if (up.type == gate.type) {
    matmul(up, px, u.data(), pool);
  } else {
    matmul(up, x, n, u.data(), pool);
  }
  for (int64_t i = 0; i < n * ff; ++i) g[i] = silu(g[i]) * u[i];
  matmul(down, g.data(), n, y, pool);
}

}  // namespace

void ReferenceExecutor::moe_block(int64_t il, const float* h, int64_t n, float* x) {
  const model::HParams& hp = m_.hp;
  const model::MoeWeights& W = m_.layers[il].moe;
  const int64_t d = hp.n_embd;
  const int64_t ne = hp.n_expert;
  const int64_t k = hp.n_expert_used;

  std::vector<float> logits(n * ne);
  matmul(W.router, h, n, logits.data(), pool_);

  std::vector<int64_t> chosen(n * k);
  std::vector<float> weight(n * k);
  std::vector<int64_t> order(ne);
  std::vector<float> prob(ne);
  for (int64_t t = 0; t < n; ++t) {
    const float* lt = logits.data() + t * ne;
    const float mx = *std::max_element(lt, lt + ne);
    float sum = 0.0f;
    for (int64_t e = 0; e < ne; ++e) sum += (prob[e] = std::exp(lt[e] - mx));
    for (int64_t e = 0; e < ne; ++e) prob[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
      return prob[a] > prob[b] || (prob[a] == prob[b] && a < b);
    });
    float wsum = 0.0f;
    for (int64_t s = 0; s < k; ++s) wsum += prob[order[s]];
    for (int64_t s = 0; s < k; ++s) {
      chosen[t * k + s] = order[s];
      weight[t * k + s] = hp.norm_topk_prob ? prob[order[s]] / wsum : prob[order[s]];
    }
  }

  // Per expert: gather its tokens, run it once, scatter into [token][slot].
  std::vector<float> slot_out(n * k * d);
  std::vector<int64_t> rows;  // t * k + slot
  std::vector<float> xg, yg;
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
    swiglu_expert(W.gate.expert(e), W.up.expert(e), W.down.expert(e), xg.data(), m, yg.data(), pool_);
    for (int64_t j = 0; j < m; ++j) std::copy_n(yg.data() + j * d, d, slot_out.data() + rows[j] * d);
  }

  std::vector<float> shared;
  if (W.shared_up) {
    shared.resize(n * d);
    swiglu_expert(W.shared_gate, W.shared_up, W.shared_down, h, n, shared.data(), pool_);
  }

  // Sum the block's output first, then add it to the residual, as the HF modules do.
  std::vector<float> acc(d);
  for (int64_t t = 0; t < n; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t s = 0; s < k; ++s) {
      const float w = weight[t * k + s];
      const float* yo = slot_out.data() + (t * k + s) * d;
      for (int64_t i = 0; i < d; ++i) acc[i] += w * yo[i];
    }
    if (W.shared_up) {
      float g = 0.0f;
      for (int64_t i = 0; i < d; ++i) g += h[t * d + i] * W.shared_router[i];
      g = sigmoid(g);
      for (int64_t i = 0; i < d; ++i) acc[i] += g * shared[t * d + i];
    }
    float* xt = x + t * d;
    for (int64_t i = 0; i < d; ++i) xt[i] += acc[i];
  }
}

}  // namespace moraine::reference
