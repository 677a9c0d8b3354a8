// The experts a model's routers choose for every token of a sequence, computed by the reference
// arithmetic (common/reference: the executor's token mixer, route_top_k, the SwiGLU experts and
// moe_combine, the same pieces its forward() runs), layer by layer, for the tests of tests/synth
// that measure how the running model routes rather than a model of it.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "common/model/model.h"
#include "common/reference/executor.h"
#include "common/reference/moe_parts.h"

namespace moraine::test {

// chosen[layer][t * k + s]: the s-th expert of token t at layer `layer`. on_router_input, when
// given, sees each layer's normalised MoE input h[n][n_embd] (what the router reads).
using RouterInputHook = std::function<void(int64_t layer, const float* h, int64_t n)>;
inline std::vector<std::vector<int32_t>> routing_trace(const model::Model& m, std::span<const int32_t> tokens,
                                                       int threads, const RouterInputHook& on_router_input = {}) {
  const model::HParams& hp = m.hp;
  const int64_t n = static_cast<int64_t>(tokens.size()), d = hp.n_embd, k = hp.n_expert_used;
  reference::ReferenceExecutor ex(m, {threads});
  std::vector<float> x(static_cast<size_t>(n * d)), h(x.size()), slot_out(static_cast<size_t>(n * k * d));
  std::vector<float> weight(static_cast<size_t>(n * k)), shared, xg, yg;
  std::vector<std::vector<int32_t>> chosen(static_cast<size_t>(hp.n_layer), std::vector<int32_t>(static_cast<size_t>(n * k)));
  reference::RouterScratch router;
  router.reserve(hp, n);
  reference::ExpertScratch scratch;
  scratch.reserve(n, hp.n_ff_exp);
  ex.embed(tokens, x.data());
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    const model::MoeWeights& W = m.layers[static_cast<size_t>(il)].moe;
    ex.mixer_step(il, x.data(), n, h.data());
    if (on_router_input) on_router_input(il, h.data(), n);
    int32_t* c = chosen[static_cast<size_t>(il)].data();
    reference::route_top_k(hp, W, h.data(), n, c, weight.data(), router, ex.pool());
    for (int64_t e = 0; e < hp.n_expert; ++e) {
      std::vector<int64_t> rows;   // slots routed to e
      for (int64_t i = 0; i < n * k; ++i) {
        if (c[i] == e) rows.push_back(i);
      }
      if (rows.empty()) continue;
      const int64_t r = static_cast<int64_t>(rows.size());
      xg.resize(static_cast<size_t>(r * d));
      yg.resize(static_cast<size_t>(r * d));
      for (int64_t j = 0; j < r; ++j) std::copy_n(h.data() + (rows[j] / k) * d, d, xg.data() + j * d);
      reference::swiglu_expert(W.gate.expert(e), W.up.expert(e), W.down.expert(e), xg.data(), r, yg.data(), scratch,
                               ex.pool());
      for (int64_t j = 0; j < r; ++j) std::copy_n(yg.data() + j * d, d, slot_out.data() + rows[j] * d);
    }
    if (W.shared_up) {
      shared.resize(static_cast<size_t>(n * d));
      reference::ExpertScratch ss;
      ss.reserve(n, W.shared_gate.n_rows);
      reference::swiglu_expert(W.shared_gate, W.shared_up, W.shared_down, h.data(), n, shared.data(), ss, ex.pool());
    }
    std::vector<const float*> slot_rows(static_cast<size_t>(n * k));
    for (int64_t i = 0; i < n * k; ++i) slot_rows[static_cast<size_t>(i)] = slot_out.data() + i * d;
    reference::moe_combine(hp, W, h.data(), n, weight.data(), slot_rows.data(), W.shared_up ? shared.data() : nullptr,
                           x.data());
  }
  ex.advance(n);
  return chosen;
}

// Token-to-token locality of one layer's routing: the share of a token's k experts that the
// previous token also chose, averaged over tokens 1..n-1; and what independent tokens with the
// same per-expert frequencies would give (sum over experts of p_e^2 / k, p_e = picks per token),
// so that a skewed but memoryless router is not mistaken for a local one.
struct Locality {
  double shared_with_previous = 0;
  double independent = 0;
};
inline Locality routing_locality(const std::vector<int32_t>& chosen, int64_t k, int64_t n_expert) {
  const int64_t n = static_cast<int64_t>(chosen.size()) / k;
  Locality l;
  std::vector<double> picks(static_cast<size_t>(n_expert), 0.0);
  for (int32_t e : chosen) picks[static_cast<size_t>(e)] += 1.0;
  for (double p : picks) l.independent += (p / static_cast<double>(n)) * (p / static_cast<double>(n));
  l.independent /= static_cast<double>(k);
  double shared = 0;
  for (int64_t t = 1; t < n; ++t) {
    for (int64_t s = 0; s < k; ++s) {
      const int32_t e = chosen[static_cast<size_t>(t * k + s)];
      for (int64_t s2 = 0; s2 < k; ++s2) shared += chosen[static_cast<size_t>((t - 1) * k + s2)] == e ? 1.0 : 0.0;
    }
  }
  l.shared_with_previous = shared / static_cast<double>((n - 1) * k);
  return l;
}

}  // namespace moraine::test
