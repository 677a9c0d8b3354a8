// How close an engine's logits on a quantized file must be to the reference executor's, derived
// from the reference itself. An engine that computes the same quantized arithmetic in another
// float order (a GPU kernel's lanes and tree reductions) moves each dot by an ulp or so; where an
// activation is re-quantized (Q8_0 / Q8_K, round(x / d)) or a top-k router choice is nearly tied,
// such an ulp sometimes lands on the other side of the edge, and that one discrete change is
// carried to the logits. The reference in other valid orders of its dots (ExecutorOptions::
// dot_order) shows how large that gets on the same file and tokens. moraine-float-order-gap on
// the golden models, 64 orders each (2026-11-30): gaps max |a - b| / max |a| are either ~1e-7 (no
// edge crossed) or one of a few discrete values; 80-row prefill, q8_0:
//   qwen3moe_odd {1e-7, 0.0016, 0.0076, 0.0097}   qwen3moe_k256 {1e-7, 0.0017 .. 0.0082}
//   qwen3next_odd {1e-7, 0.0078}                  qwen3next_k256 {1e-7, 0.0002 .. 0.0073}
// and the H200's values there (0.0016, 0.0082, 0.0073) are among them. In the qwen3moe_k256 case
// one Q8_0 code of layer 1's input (of 20480, its float 2.8e-7 apart) is the whole difference.
// So the bound for quantized weights is max(kQuantizedFloor, kOrderFactor * G), G the largest gap
// of the reference to itself over kOrderSeeds orders on the same rows:
//  - kOrderSeeds = 32: in those 64-order runs no order of one half exceeded the largest gap of
//    the other half (with 16 orders, 0.6% did, by up to 17x: rarer edges get missed);
//  - kOrderFactor = 2: the engine is one more order, and it also differs outside the dots
//    (norms, softmax, exp), which the seeds do not vary. The H200's gaps were all within G
//    (0.0016 / 0.0097, 0.0082 / 0.0082, 0.0073 / 0.0073; split experts 0.0031 / 0.045; the group's
//    decode 0.029 / 0.045);
//  - kQuantizedFloor = 1e-3: the bound used before (the reference against llama.cpp); a case
//    whose orders never cross an edge keeps it.
// A real error is systematic and stays above it: float_order_bound_test.cpp scales one block
// per row of one matrix by 1.05 and every golden case fails the bound (by 1.6x at the least).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/reference/executor.h"
#include "common/reference/matmul.h"

namespace moraine::test_support {

inline constexpr int kOrderSeeds = 32;
inline constexpr double kOrderFactor = 2.0;
inline constexpr double kQuantizedFloor = 1e-3;
inline constexpr double kFloatBound = 1e-4;   // F32 weights: no re-quantization, unchanged

// max |got - want| / max |want|, and where.
struct LogitGap {
  double max_ref = 0, max_diff = 0;
  size_t worst = 0;
  double rel() const { return max_ref > 0 ? max_diff / max_ref : 0; }
};

inline LogitGap logit_gap(const std::vector<float>& got, const std::vector<float>& want) {
  LogitGap g;
  for (size_t i = 0; i < want.size(); ++i) {
    g.max_ref = std::max(g.max_ref, std::fabs(double(want[i])));
    const double d = i < got.size() && std::isfinite(got[i]) ? std::fabs(double(got[i]) - want[i]) : INFINITY;
    if (d > g.max_diff) g.max_diff = d, g.worst = i;
  }
  return g;
}

// The bound on max |engine - reference| / max |reference logit|.
struct OrderBound {
  double self_gap = 0;  // largest gap of the reference to itself over the other orders
  double bound = 0;     // relative to max |logit|
  int orders = 0;
  double floor = kQuantizedFloor;   // the bound's least value
  std::string describe() const {
    char s[160];
    if (orders == 0) {
      std::snprintf(s, sizeof s, "bound %.0e (F32 weights)", bound);
      return s;
    }
    std::snprintf(s, sizeof s, "bound %.3g = max(%.0e, %.0f x %.3g, the reference's own gap over %d float orders)",
                  bound, floor, kOrderFactor, self_gap, orders);
    return s;
  }
};

// `gap(seed)`: the reference's gap to itself, relative as LogitGap::rel(), with ExecutorOptions::
// dot_order = seed against its own order (how a caller measures it: the whole array, or the
// largest over positions).
inline OrderBound quantized_bound(const std::function<double(reference::DotOrderSeed)>& gap,
                                  int orders = kOrderSeeds) {
  OrderBound b;
  b.orders = orders;
  for (int s = 1; s <= orders; ++s) b.self_gap = std::max(b.self_gap, gap(s));
  b.bound = std::max(kQuantizedFloor, kOrderFactor * b.self_gap);
  return b;
}

// `want`: the reference's logits in its own order; `run(seed)`: the same logits (same tokens,
// same rows) with ExecutorOptions::dot_order = seed.
inline OrderBound quantized_bound(const std::vector<float>& want,
                                  const std::function<std::vector<float>(reference::DotOrderSeed)>& run,
                                  int orders = kOrderSeeds) {
  return quantized_bound([&](reference::DotOrderSeed s) { return logit_gap(run(s), want).rel(); }, orders);
}

// F32 files keep kFloatBound; quantized ones get quantized_bound (computed only for them). An
// F16 KV cache (f16_kv; `run` then runs the reference with it) rounds every stored K and V element
// to half, a discrete step like a re-quantized activation even with F32 weights: those get
// max(kFloatBound, kOrderFactor * G). On the golden F32 files the F16 reference's own gap over 32
// orders was 7e-6 .. 2.05e-4 (qwen3moe_odd: a rounding edge crossed), the F32 one 6e-7 .. 1.9e-6.
inline OrderBound bound_for(bool quantized, const std::vector<float>& want,
                            const std::function<std::vector<float>(reference::DotOrderSeed)>& run,
                            bool f16_kv = false) {
  if (quantized) return quantized_bound(want, run);
  if (f16_kv) {
    OrderBound b = quantized_bound(want, run);
    b.floor = kFloatBound;
    b.bound = std::max(kFloatBound, kOrderFactor * b.self_gap);
    return b;
  }
  OrderBound b;
  b.bound = kFloatBound;
  return b;
}

inline reference::ExecutorOptions in_order(reference::DotOrderSeed order, model::KvType kv = model::KvType::F32) {
  reference::ExecutorOptions o;
  o.dot_order = order;
  o.kv_type = kv;
  return o;
}

// The rows a greedy generation of ids samples from, computed in `order` with the tokens given
// (not re-chosen): the prompt's last logits, then one row per token of ids but the last.
inline std::vector<float> generation_logits(const model::Model& m, reference::DotOrderSeed order,
                                            std::span<const int32_t> prompt, std::span<const int32_t> ids,
                                            model::KvType kv = model::KvType::F32) {
  reference::ReferenceExecutor ex(m, in_order(order, kv));
  std::vector<float> all, l = ex.forward(prompt, false);
  for (size_t i = 0; i < ids.size(); ++i) {
    all.insert(all.end(), l.begin(), l.end());
    if (i + 1 < ids.size()) l = ex.forward(ids.subspan(i, 1), false);
  }
  return all;
}

}  // namespace moraine::test_support
