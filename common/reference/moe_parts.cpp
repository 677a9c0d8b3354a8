#include "common/reference/moe_parts.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

#include "common/reference/matmul.h"
#include "common/reference/ops.h"

namespace moraine::reference {

void RouterScratch::reserve(const model::HParams& hp, int64_t max_tokens) {
  logits.resize(static_cast<size_t>(max_tokens * hp.n_expert));
  prob.resize(static_cast<size_t>(hp.n_expert));
  order.resize(static_cast<size_t>(hp.n_expert));
  select.resize(static_cast<size_t>(hp.n_expert));
  group_score.resize(static_cast<size_t>(hp.n_expert));
  group_order.resize(static_cast<size_t>(hp.n_expert));
}

void route_top_k(const model::HParams& hp, const model::MoeWeights& W, const float* h, int64_t n,
                 int32_t* chosen, float* weight, RouterScratch& scratch, ThreadPool& pool,
                 DotOrderSeed dot_order) {
  const int64_t ne = hp.n_expert;
  const int64_t k = hp.n_expert_used;
  matmul(W.router, h, n, scratch.logits.data(), pool, dot_order);
  std::vector<float>& prob = scratch.prob;
  std::vector<int64_t>& order = scratch.order;
  for (int64_t t = 0; t < n; ++t) {
    const float* lt = scratch.logits.data() + t * ne;
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
      chosen[t * k + s] = static_cast<int32_t>(order[s]);
      weight[t * k + s] = hp.norm_topk_prob ? prob[order[s]] / wsum : prob[order[s]];
    }
  }
}

void route_top_k_softmax(const model::HParams& hp, const model::MoeWeights& W, const float* h, int64_t n,
                         int32_t* chosen, float* weight, RouterScratch& scratch, ThreadPool& pool,
                         DotOrderSeed dot_order) {
  const int64_t ne = hp.n_expert;
  const int64_t k = hp.n_expert_used;
  matmul(W.router, h, n, scratch.logits.data(), pool, dot_order);
  std::vector<int64_t>& order = scratch.order;
  for (int64_t t = 0; t < n; ++t) {
    float* lt = scratch.logits.data() + t * ne;
    if (!W.router_bias.empty())
      for (int64_t e = 0; e < ne; ++e) lt[e] += W.router_bias[e];
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
      return lt[a] > lt[b] || (lt[a] == lt[b] && a < b);
    });
    const float mx = lt[order[0]];
    float sum = 0.0f;
    for (int64_t s = 0; s < k; ++s) sum += (weight[t * k + s] = std::exp(lt[order[s]] - mx));
    for (int64_t s = 0; s < k; ++s) {
      chosen[t * k + s] = static_cast<int32_t>(order[s]);
      weight[t * k + s] /= sum;
    }
  }
}

void route_sigmoid_group_top_k(const model::HParams& hp, const model::RouterPart& part, const model::MoeWeights& W,
                               const float* h, int64_t n, int32_t* chosen, float* weight, RouterScratch& scratch,
                               ThreadPool& pool, DotOrderSeed dot_order) {
  const int64_t ne = hp.n_expert;
  const int64_t k = hp.n_expert_used;
  const int64_t n_group = part.n_group > 1 ? part.n_group : 1;
  const int64_t per_group = ne / n_group;
  if (per_group * n_group != ne || part.topk_group < 1 || part.topk_group > n_group || part.topk_group * per_group < k)
    throw std::logic_error("reference: group-limited routing of " + std::to_string(ne) + " experts in " +
                           std::to_string(n_group) + " groups, " + std::to_string(part.topk_group) +
                           " used, cannot choose " + std::to_string(k) + " (the description should have refused it)");
  matmul(W.router, h, n, scratch.logits.data(), pool, dot_order);
  std::vector<float>& prob = scratch.prob;
  std::vector<float>& sel = scratch.select;
  std::vector<int64_t>& order = scratch.order;
  const auto by_score = [](const std::vector<float>& v) {
    return [&v](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
  };
  for (int64_t t = 0; t < n; ++t) {
    const float* lt = scratch.logits.data() + t * ne;
    for (int64_t e = 0; e < ne; ++e) {
      prob[e] = sigmoid(lt[e]);
      sel[e] = W.score_bias.empty() ? prob[e] : prob[e] + W.score_bias[e];
    }
    if (n_group > 1) {
      // A group's score: the sum of its two best biased scores (its only one when it has one).
      std::vector<float>& gs = scratch.group_score;
      for (int64_t g = 0; g < n_group; ++g) {
        const float* s = sel.data() + g * per_group;
        float best = -INFINITY, second = -INFINITY;
        for (int64_t j = 0; j < per_group; ++j) {
          if (s[j] > best) second = best, best = s[j];
          else if (s[j] > second) second = s[j];
        }
        gs[g] = per_group > 1 ? best + second : best;
      }
      std::vector<int64_t>& go = scratch.group_order;
      std::iota(go.begin(), go.begin() + n_group, 0);
      std::partial_sort(go.begin(), go.begin() + part.topk_group, go.begin() + n_group, by_score(gs));
      for (int64_t r = part.topk_group; r < n_group; ++r)
        std::fill_n(sel.data() + go[r] * per_group, per_group, -INFINITY);
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), by_score(sel));
    float wsum = 0.0f;
    for (int64_t s = 0; s < k; ++s) wsum += prob[order[s]];
    // llama.cpp clamps the sum at the smallest normal half before dividing.
    wsum = std::max(wsum, 6.103515625e-5f);
    for (int64_t s = 0; s < k; ++s) {
      chosen[t * k + s] = static_cast<int32_t>(order[s]);
      weight[t * k + s] = part.renormalize ? prob[order[s]] / wsum : prob[order[s]];
    }
  }
}

void route_layer(const model::HParams& hp, const model::FfnPart& part, const model::MoeWeights& W, const float* h,
                 int64_t n, int32_t* chosen, float* weight, RouterScratch& scratch, ThreadPool& pool,
                 DotOrderSeed order) {
  switch (part.router.kind) {
    case model::RouterKind::SoftmaxTopK:
      route_top_k(hp, W, h, n, chosen, weight, scratch, pool, order);
      break;
    case model::RouterKind::TopKSoftmax:
      route_top_k_softmax(hp, W, h, n, chosen, weight, scratch, pool, order);
      break;
    case model::RouterKind::SigmoidGroupTopK:
      route_sigmoid_group_top_k(hp, part.router, W, h, n, chosen, weight, scratch, pool, order);
      break;
    default:
      throw std::logic_error("reference: router kind " + std::to_string(static_cast<int>(part.router.kind)) +
                             " has no implementation (check_supported should have refused the model)");
  }
  if (part.router.routed_scale != 1.0) {
    const float scale = static_cast<float>(part.router.routed_scale);
    for (int64_t i = 0; i < n * hp.n_expert_used; ++i) weight[i] *= scale;
  }
}

void ExpertScratch::reserve(int64_t max_rows, int64_t ff) {
  g.resize(static_cast<size_t>(max_rows * ff));
  u.resize(static_cast<size_t>(max_rows * ff));
}

void swiglu_expert(const model::Matrix& gate, const model::Matrix& up, const model::Matrix& down,
                   const float* x, int64_t m, float* y, ExpertScratch& scratch, ThreadPool& pool,
                   DotOrderSeed order) {
  const int64_t ff = gate.n_rows;
  float* g = scratch.g.data();
  float* u = scratch.u.data();
  PackedActivations px = pack_activations(gate.type, x, m, gate.n_cols, order);
  matmul(gate, px, g, pool, order);
  if (up.type == gate.type) {
    matmul(up, px, u, pool, order);
  } else {
    matmul(up, x, m, u, pool, order);
  }
  for (int64_t i = 0; i < m * ff; ++i) g[i] = silu(g[i]) * u[i];
  matmul(down, g, m, y, pool, order);
}

void biased_expert(const model::MoeWeights& W, int64_t e, const model::ExpertsPart& part, const float* x, int64_t m,
                   float* y, ExpertScratch& scratch, ThreadPool& pool, DotOrderSeed order) {
  biased_expert({W.gate.expert(e), W.up.expert(e), W.down.expert(e)}, W, e, part, x, m, y, scratch, pool, order);
}

void biased_expert(const std::array<model::Matrix, 3>& gate_up_down, const model::MoeWeights& W, int64_t e,
                   const model::ExpertsPart& part, const float* x, int64_t m, float* y, ExpertScratch& scratch,
                   ThreadPool& pool, DotOrderSeed order) {
  const model::Matrix &gate = gate_up_down[0], &up = gate_up_down[1], &down = gate_up_down[2];
  const int64_t ff = gate.n_rows, d = down.n_rows;
  float* g = scratch.g.data();
  float* u = scratch.u.data();
  matmul(gate, x, m, g, pool, order);
  matmul(up, x, m, u, pool, order);
  const bool biased = part.biases && !W.gate_bias.empty();
  const float* bg = biased ? W.gate_bias.data() + e * ff : nullptr;
  const float* bu = biased ? W.up_bias.data() + e * ff : nullptr;
  const float alpha = static_cast<float>(part.swiglu_alpha), limit = static_cast<float>(part.swiglu_limit);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < ff; ++i) {
      float gi = g[r * ff + i] + (bg ? bg[i] : 0.0f);
      float ui = u[r * ff + i] + (bu ? bu[i] : 0.0f);
      if (part.act == model::Activation::SwiGluClamped) {
        gi = std::fmin(gi, limit);
        ui = std::fmax(-limit, std::fmin(ui, limit));
        g[r * ff + i] = gi * sigmoid(alpha * gi) * (ui + 1.0f);
      } else {
        g[r * ff + i] = silu(gi) * ui;
      }
    }
  }
  matmul(down, g, m, y, pool, order);
  if (biased) {
    const float* bd = W.down_bias.data() + e * d;
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = 0; i < d; ++i) y[r * d + i] += bd[i];
  }
}

void routed_expert(const model::MoeWeights& W, int64_t e, const model::ExpertsPart& part, const float* x, int64_t m,
                   float* y, ExpertScratch& scratch, ThreadPool& pool, DotOrderSeed order) {
  routed_expert({W.gate.expert(e), W.up.expert(e), W.down.expert(e)}, W, e, part, x, m, y, scratch, pool, order);
}

void routed_expert(const std::array<model::Matrix, 3>& gate_up_down, const model::MoeWeights& W, int64_t e,
                   const model::ExpertsPart& part, const float* x, int64_t m, float* y, ExpertScratch& scratch,
                   ThreadPool& pool, DotOrderSeed order) {
  if (part.act == model::Activation::SwiGlu && !part.biases) {
    swiglu_expert(gate_up_down[0], gate_up_down[1], gate_up_down[2], x, m, y, scratch, pool, order);
    return;
  }
  biased_expert(gate_up_down, W, e, part, x, m, y, scratch, pool, order);
}

void dense_ffn(const model::DenseFfnWeights& W, const float* h, int64_t n, float* x, float* y, ExpertScratch& scratch,
               ThreadPool& pool, DotOrderSeed order) {
  swiglu_expert(W.gate, W.up, W.down, h, n, y, scratch, pool, order);
  const int64_t count = n * W.down.n_rows;
  for (int64_t i = 0; i < count; ++i) x[i] += y[i];
}

void moe_combine(const model::HParams& hp, const model::MoeWeights& W, const float* h, int64_t n,
                 const float* weight, const float* const* slot_rows, const float* shared, float* x) {
  const int64_t d = hp.n_embd;
  const int64_t k = hp.n_expert_used;
  // Per element: the slots in top-k order, then the shared expert, then into the residual;
  // the same order of float additions as moe_block's acc, so the sums are bit-identical.
  for (int64_t t = 0; t < n; ++t) {
    float* xt = x + t * d;
    float g = 1.0f;
    if (shared != nullptr && !W.shared_router.empty()) {
      g = 0.0f;
      for (int64_t i = 0; i < d; ++i) g += h[t * d + i] * W.shared_router[i];
      g = sigmoid(g);
    }
    for (int64_t i = 0; i < d; ++i) {
      float acc = 0.0f;
      for (int64_t s = 0; s < k; ++s) acc += weight[t * k + s] * slot_rows[t * k + s][i];
      if (shared != nullptr) acc += g * shared[t * d + i];
      xt[i] += acc;
    }
  }
}

}  // namespace moraine::reference
