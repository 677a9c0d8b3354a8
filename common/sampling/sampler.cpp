#include "common/sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace moraine::sampling {

// Two passes instead of one loop: the loop `if (logits[i] > logits[best]) best = i` carries a load
// whose address depends on the previous iteration's result, ~12 cycles per logit: on the H200
// machine the coordinator's sample stage took 598 us per token over a 151,936-word vocabulary,
// 17% of an all-in-VRAM decode step. Here the maximum comes from 16 independent lanes (one
// vector max instruction per 16 logits: `v > m ? v : m` is exactly x86's maxps), then the first
// index holding it. Same answer as the one loop: a NaN never wins (nor does anything against
// a NaN at index 0, which then stays the answer), ties go to the lowest index.
int32_t argmax(std::span<const float> logits) {
  if (logits.empty()) throw std::invalid_argument("argmax: empty logits");
  constexpr size_t kLanes = 16;
  const float* x = logits.data();
  const size_t n = logits.size();
  float lane[kLanes];
  for (float& m : lane) m = x[0];
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t j = 0; j < kLanes; ++j) lane[j] = x[i + j] > lane[j] ? x[i + j] : lane[j];
  }
  float best = x[0];
  for (float m : lane) best = m > best ? m : best;
  for (; i < n; ++i) best = x[i] > best ? x[i] : best;
  if (best != best) return 0;   // x[0] is NaN: nothing compares greater
  for (size_t k = 0; k < n; ++k) {
    if (x[k] == best) return static_cast<int32_t>(k);
  }
  return 0;   // not reached: best is one of the values
}

Sampler::Sampler(SamplerParams p) : p_(p), rng_(p.seed) {
  if (!std::isfinite(p_.temperature)) throw std::invalid_argument("sampler: temperature must be finite");
  if (!(p_.top_p > 0.0f)) throw std::invalid_argument("sampler: top_p must be > 0");
}

std::vector<std::pair<int32_t, float>> Sampler::distribution(std::span<const float> logits) const {
  if (logits.empty()) throw std::invalid_argument("sampler: empty logits");
  if (p_.temperature <= 0.0f) return {{argmax(logits), 1.0f}};

  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  size_t keep = ids.size();
  if (p_.top_k > 0 && static_cast<size_t>(p_.top_k) < keep) keep = static_cast<size_t>(p_.top_k);
  std::partial_sort(ids.begin(), ids.begin() + keep, ids.end(), by_logit);
  ids.resize(keep);

  // Softmax over the survivors in double: the sums below decide cut points.
  const double mx = logits[ids[0]];
  std::vector<double> w(keep);
  double sum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    w[i] = std::exp((static_cast<double>(logits[ids[i]]) - mx) / p_.temperature);
    sum += w[i];
  }
  size_t n = keep;
  if (p_.top_p < 1.0f) {
    double cum = 0.0;
    for (size_t i = 0; i < keep; ++i) {
      cum += w[i] / sum;
      if (cum >= p_.top_p) {
        n = i + 1;
        break;
      }
    }
  }
  double kept = 0.0;
  for (size_t i = 0; i < n; ++i) kept += w[i];
  std::vector<std::pair<int32_t, float>> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = {ids[i], static_cast<float>(w[i] / kept)};
  return out;
}

double Sampler::uniform01() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

int32_t Sampler::sample(std::span<const float> logits) {
  if (p_.temperature <= 0.0f) return argmax(logits);
  const std::vector<std::pair<int32_t, float>> d = distribution(logits);
  const double u = uniform01();
  double cum = 0.0;
  for (const auto& [id, p] : d) {
    cum += p;
    if (u < cum) return id;
  }
  return d.back().first;  // u landed in the rounding gap above the last cumulative sum
}

}  // namespace moraine::sampling
