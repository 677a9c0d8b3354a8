// Zipf-skewed expert popularity, built into the router weights so that it holds when the model
// runs, not only on paper.
//
// Model of the router's input (the hidden state after the pre-FFN RMSNorm), which moraine-synth
// also builds into the file so that the running model produces it:
//  * One coordinate of the residual stream, the "massive" dimension j, holds the same value
//    m = sqrt(hidden) for every token. Real LLMs show such massive activations; here the token
//    embedding sets it, no layer writes it (row j of every output projection is zero) and no
//    projection but the router reads it (element j of their rows is zero).
//  * The other coordinates are token dependent with variance v_l at layer l: 1 from the
//    embedding, growing by kResidualGrowth over the depth as the blocks add their outputs
//    (output projections are scaled by 1/sqrt(2 * n_layer) so the growth stays small):
//    v_l = 1 + kResidualGrowth * (l + 0.5) / n_layer.
// After RMSNorm the router thus sees a constant x_j = m / rms_l plus isotropic noise, so router
// row e gets logit b_e + (noise of std kLogitNoise) where b_e comes from its element j. The
// biases b_e are calibrated (by simulation) so that top-k selection frequencies follow
// p(rank r) ~ r^-S, capped at 1 (with top-8 of 128 and S = 1 the hottest expert would need to be
// picked more than once per token). Which expert has which rank is a per-layer permutation, so
// the hot experts differ between layers. Token-to-token locality: router_locality.h (recency
// heads write a slowly varying subspace that the routers read; without them the running model
// showed none, measured there).
#pragma once
#include <cstdint>
#include <vector>

namespace moraine::synth {

// Growth of the token-dependent residual variance from the first to the last layer. Measured
// from llama.cpp's final logits (synth_llama_test): 0.0 to 0.33, mean ~0.12, over tiny and
// full-width files of both architectures; 0.2 sits inside that spread.
inline constexpr double kResidualGrowth = 0.2;
// Standard deviation of the token-dependent part of a router logit.
inline constexpr double kLogitNoise = 1.0;

// The hidden-state model above, for one layer.
struct RouterInputModel {
  int64_t hidden = 0;
  int64_t massive_dim = 0;
  double massive_value = 0;  // m: the residual's constant value at massive_dim
  double offaxis_var = 1;    // v_l: variance of every other residual coordinate
  // The slow subspace (router_locality.h): slow_count coordinates of variance slow_var instead
  // of offaxis_var (0 and 0 for a file without recency heads).
  int64_t slow_count = 0;
  double slow_var = 0;
  double rms() const;        // expected RMS of the residual: what RMSNorm divides by
};

RouterInputModel router_input_model(int64_t hidden, int64_t massive_dim, int64_t layer, int64_t n_layer);

// Expected selections per token of the expert of each popularity rank (0 = hottest): Zipf of
// exponent s capped at 1, summing to k.
std::vector<double> zipf_selection_targets(int64_t n_expert, int64_t k, double s);

// Logit bias per popularity rank, in units of kLogitNoise, such that top-k over bias + N(0, 1)
// noise picks rank r with the frequencies zipf_selection_targets gives. Deterministic.
std::vector<double> calibrate_rank_biases(int64_t n_expert, int64_t k, double s, uint64_t seed);

// rank[e] of every expert in one layer: a permutation drawn from (seed, layer).
std::vector<int64_t> popularity_ranks(int64_t n_expert, uint64_t seed, int64_t layer);

}  // namespace moraine::synth
