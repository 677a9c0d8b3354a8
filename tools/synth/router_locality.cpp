#include "tools/synth/router_locality.h"

#include <algorithm>
#include <cmath>

#include "tools/synth/router_skew.h"

namespace moraine::synth {

namespace {
constexpr int64_t kSizingPositions = 512;   // positions the slow subspace's variance is sized for
}  // namespace

std::vector<double> recency_weights(const ShapeSpec& s, double amp, int64_t t) {
  const int64_t pairs = s.n_rot / 2;
  std::vector<double> score(static_cast<size_t>(t + 1));
  for (int64_t d = 0; d <= t; ++d) {
    double c = 0;
    for (int64_t i = 0; i < pairs; ++i) {
      const double theta = std::pow(s.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(s.n_rot));
      c += std::cos(theta * static_cast<double>(d));
    }
    score[static_cast<size_t>(d)] = amp * std::sqrt(static_cast<double>(s.head_dim)) * c / static_cast<double>(pairs);
  }
  const double top = *std::max_element(score.begin(), score.end());
  double z = 0;
  for (double& x : score) z += (x = std::exp(x - top));
  for (double& x : score) x /= z;
  return score;
}

RecencyDesign design_recency(const ShapeSpec& s, int64_t massive_dim) {
  RecencyDesign d;
  if (s.mla()) {
    // MLA has no per-head keys of its own to build recency heads from: no slow subspace.
    d.heads = 0;
    d.out_gain.assign(static_cast<size_t>(s.n_layer), 0.0);
    d.slow_var.assign(static_cast<size_t>(s.n_layer), 0.0);
    return d;
  }
  // S has as many coordinates as there are experts (up to a quarter of the residual): the slow
  // logits of all experts are W_S x_S, and with far fewer coordinates than experts they are
  // strongly correlated across experts, which skews uniform routing (measured with the router
  // model of synth_zipf_test, qwen3moe-tiny with 64 experts, --zipf 0, most / least routed:
  // 1.42 with 16 coordinates, 1.32 with 32, 1.23 with 64; 1.28 before S existed). A recency
  // head gives head_dim coordinates, so R heads, each the first q head of its own kv group (heads
  // of one group share keys and values and would give the same output).
  const int64_t want = std::min(s.n_expert, s.hidden / 4);
  d.heads = std::min(s.n_head_kv, (want + s.head_dim - 1) / s.head_dim);
  d.dims_per_head = std::min(s.head_dim, (want + d.heads - 1) / d.heads);
  d.group = s.n_head / s.n_head_kv;
  d.slow_count = d.heads * d.dims_per_head;
  d.slow_first = massive_dim < d.slow_count ? d.slow_count : 0;   // S must not hold the massive coordinate
  // score(0) - score(Delta) ~ amp * sqrt(head_dim) * ln(Delta) / ln(base): the exponent.
  d.amp = kRecencyExponent * std::log(s.rope_theta) / std::sqrt(static_cast<double>(s.head_dim));
  // Sum of squared weights, averaged over positions 0 .. 511 (prefix sums over the scores): with
  // few rotation pairs (the tiny shapes) the kernel settles late, and sized at position 511 alone
  // S came out at twice its design (measured: qwen3next-tiny, mean square 0.47 for 0.25).
  const std::vector<double> w = recency_weights(s, d.amp, kSizingPositions - 1);   // normalised at t = 511
  double z = 0, z2 = 0, a2 = 0;
  for (int64_t t = 0; t < kSizingPositions; ++t) {
    z += w[static_cast<size_t>(t)];
    z2 += w[static_cast<size_t>(t)] * w[static_cast<size_t>(t)];
    a2 += z2 / (z * z);
  }
  a2 /= static_cast<double>(kSizingPositions);

  int64_t n_attn = 0;
  for (int64_t il = 0; il < s.n_layer; ++il) n_attn += s.recurrent(il) ? 0 : 1;
  d.out_gain.assign(static_cast<size_t>(s.n_layer), 0.0);
  d.slow_var.assign(static_cast<size_t>(s.n_layer), 0.0);
  // Each attention layer adds kSlowVariance / n_attn to an S coordinate's variance. A value of a
  // recency head is a random projection of the normalised input: variance 1 - m^2 / (H rms^2),
  // the share of the input that is not the massive coordinate.
  double v_slow = 0;
  for (int64_t il = 0; il < s.n_layer; ++il) {
    if (!s.recurrent(il)) {
      RouterInputModel in = router_input_model(s.hidden, massive_dim, il, s.n_layer);
      in.slow_count = d.slow_count;
      in.slow_var = v_slow;
      const double r2 = in.rms() * in.rms();
      const double value_var = 1.0 - in.massive_value * in.massive_value / (static_cast<double>(s.hidden) * r2);
      d.out_gain[static_cast<size_t>(il)] = std::sqrt(kSlowVariance / static_cast<double>(n_attn) / (a2 * value_var));
      v_slow += kSlowVariance / static_cast<double>(n_attn);
    }
    d.slow_var[static_cast<size_t>(il)] = v_slow;
  }
  return d;
}

}  // namespace moraine::synth
