#include "tools/synth/router_skew.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "tools/synth/random_stream.h"

namespace moraine::synth {

double RouterInputModel::rms() const {
  const double h = static_cast<double>(hidden);
  const double s = static_cast<double>(slow_count);
  return std::sqrt((massive_value * massive_value + (h - 1 - s) * offaxis_var + s * slow_var) / h);
}

RouterInputModel router_input_model(int64_t hidden, int64_t massive_dim, int64_t layer, int64_t n_layer) {
  RouterInputModel m;
  m.hidden = hidden;
  m.massive_dim = massive_dim;
  m.massive_value = std::sqrt(static_cast<double>(hidden));
  m.offaxis_var = 1.0 + kResidualGrowth * (static_cast<double>(layer) + 0.5) / static_cast<double>(std::max<int64_t>(n_layer, 1));
  return m;
}

std::vector<double> zipf_selection_targets(int64_t n_expert, int64_t k, double s) {
  if (n_expert <= 0 || k <= 0 || k > n_expert) throw std::invalid_argument("zipf targets: need 0 < k <= n_expert");
  std::vector<double> w(static_cast<size_t>(n_expert));
  for (int64_t r = 0; r < n_expert; ++r) w[static_cast<size_t>(r)] = std::pow(static_cast<double>(r + 1), -s);
  // Find c with sum(min(1, c * w_r)) = k; the sum grows with c, so bisect.
  auto total = [&](double c) {
    double t = 0;
    for (double x : w) t += std::min(1.0, c * x);
    return t;
  };
  double lo = 0, hi = 1;
  while (total(hi) < static_cast<double>(k)) hi *= 2;
  for (int it = 0; it < 200; ++it) {
    const double mid = 0.5 * (lo + hi);
    (total(mid) < static_cast<double>(k) ? lo : hi) = mid;
  }
  std::vector<double> p(w.size());
  for (size_t r = 0; r < w.size(); ++r) p[r] = std::min(1.0, hi * w[r]);
  return p;
}

std::vector<double> calibrate_rank_biases(int64_t n_expert, int64_t k, double s, uint64_t seed) {
  const size_t E = static_cast<size_t>(n_expert);
  std::vector<double> bias(E, 0.0);
  if (s == 0.0 || k == n_expert) return bias;  // uniform: no bias
  const std::vector<double> target = zipf_selection_targets(n_expert, k, s);

  // A fixed sample of token noise, reused every iteration so the fit is deterministic. 8192
  // tokens keep the rarest expert of 512 (top-10, S = 1: ~0.3% of tokens) at ~20 hits.
  constexpr size_t kSamples = 8192;
  std::vector<float> noise(kSamples * E);
  uint64_t st = seed ^ 0x5A17C0DEull;
  for (size_t i = 0; i < noise.size(); i += 2) {
    // Box-Muller: two normals from two uniforms.
    const double u1 = (static_cast<double>(splitmix64(st) >> 11) + 0.5) * 0x1.0p-53;
    const double u2 = static_cast<double>(splitmix64(st) >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    noise[i] = static_cast<float>(r * std::cos(2 * M_PI * u2));
    if (i + 1 < noise.size()) noise[i + 1] = static_cast<float>(r * std::sin(2 * M_PI * u2));
  }
  // Start from the gap a Gaussian tail implies, then correct by the measured log-ratio.
  for (size_t r = 0; r < E; ++r) bias[r] = std::log(target[r] * static_cast<double>(E) / static_cast<double>(k));
  const double cap = 1.0 - 0.5 / static_cast<double>(kSamples);
  std::vector<float> logit(E);
  std::vector<uint32_t> order(E);
  std::vector<double> count(E);
  constexpr int kIterations = 60;
  for (int it = 0; it < kIterations; ++it) {
    std::fill(count.begin(), count.end(), 0.0);
    for (size_t t = 0; t < kSamples; ++t) {
      const float* z = noise.data() + t * E;
      for (size_t e = 0; e < E; ++e) logit[e] = static_cast<float>(bias[e]) + z[e];
      std::iota(order.begin(), order.end(), 0u);
      std::nth_element(order.begin(), order.begin() + (k - 1), order.end(),
                       [&](uint32_t a, uint32_t b) { return logit[a] > logit[b]; });
      for (int64_t i = 0; i < k; ++i) count[order[static_cast<size_t>(i)]] += 1.0;
    }
    const double step = it < kIterations / 2 ? 0.8 : 0.4;
    for (size_t r = 0; r < E; ++r) {
      const double got = std::max(count[r], 0.5) / static_cast<double>(kSamples);
      bias[r] += step * (std::log(std::min(target[r], cap)) - std::log(std::min(got, cap)));
    }
  }
  const double mean = std::accumulate(bias.begin(), bias.end(), 0.0) / static_cast<double>(E);
  for (double& b : bias) b -= mean;  // top-k and softmax ignore a common shift
  return bias;
}

std::vector<int64_t> popularity_ranks(int64_t n_expert, uint64_t seed, int64_t layer) {
  std::vector<int64_t> expert_of_rank(static_cast<size_t>(n_expert));
  std::iota(expert_of_rank.begin(), expert_of_rank.end(), 0);
  RowRandom rng(hash_name("router-popularity", seed), static_cast<uint64_t>(layer));
  for (size_t i = expert_of_rank.size(); i > 1; --i) {  // Fisher-Yates
    const size_t j = static_cast<size_t>(rng.next_u64() % i);
    std::swap(expert_of_rank[i - 1], expert_of_rank[j]);
  }
  std::vector<int64_t> rank(expert_of_rank.size());
  for (size_t r = 0; r < rank.size(); ++r) rank[static_cast<size_t>(expert_of_rank[r])] = static_cast<int64_t>(r);
  return rank;
}

}  // namespace moraine::synth
