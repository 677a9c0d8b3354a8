#include "common/sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace moraine::sampling {

int32_t argmax(std::span<const float> logits) {
  if (logits.empty()) throw std::invalid_argument("argmax: empty logits");
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = static_cast<int32_t>(i);
  }
  return best;
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
