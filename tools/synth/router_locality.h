// Token-to-token locality of the routing, built into the weights so that the running model shows
// it on any token sequence (real routers choose similar experts for neighbouring tokens; a
// synthetic file whose routers see only the current token does not: measured 0.033 shared with
// the previous token against 0.033 for memoryless routing, qwen3moe-tiny with 64 experts).
//
// The mechanism, "recency heads" in every full-attention layer: the first q head of each of the
// first R kv groups (R = heads), with that group's kv head:
//  * Queries and keys are constant: their rows read only the massive coordinate (the residual's
//    constant, router_skew.h) and only on the rotated dimensions. After the q/k RMSNorm and RoPE
//    the score of a key Delta tokens back is amp * sqrt(head_dim) * the mean over rotation pairs
//    of cos(theta_i * Delta): it falls like ln(Delta) / ln(rope base), so the softmax weights
//    fall as a power law, Delta^-kRecencyExponent. amp comes from the q/k norm weights on the
//    rotated dimensions (sqrt(amp) each; those weights are shared by every head of the layer).
//  * Values are ordinary random projections, so the output is a recency-weighted mean of the
//    earlier tokens' values: it changes slowly from token to token (correlation ~0.5 between
//    neighbours for an exponent of 1.6, whatever the position, as the kernel is scale-free).
//  * The output projection writes the first dims_per_head value dimensions of each recency head,
//    and nothing else, into the slow subspace S of the residual; the embedding and every other
//    output projection leave S at zero. Each attention layer adds its own smoothed part, sized so
//    that S ends with variance kSlowVariance (small: at position 0 a recency head sees one token
//    and S is a few times its average variance there).
//  * The routers read S with a share kSlowShare of their token-dependent logit variance (the
//    rest from the other coordinates, as before), so that share of a router logit is slow.
// The Zipf calibration is unchanged: marginally every logit is still bias + N(0, kLogitNoise^2).
// Layers before the first attention layer (qwen3next's first DeltaNet layers) have nothing in S
// and route without locality.
#pragma once
#include <cstdint>
#include <vector>

#include "tools/synth/shapes.h"

namespace moraine::synth {

// Power-law exponent of the recency head's attention over past tokens. Above 1 the weights are
// summable, so the smoothed part keeps the same variance at any position (measured for the
// qwen3moe-30b shape: sum of squared weights 0.36 at position 16, 0.32 at 4096).
inline constexpr double kRecencyExponent = 1.6;
// Share of a router logit's token-dependent variance that comes from the slow subspace.
inline constexpr double kSlowShare = 0.5;
// Variance of an S coordinate after the last attention layer (the others' is ~1.2). The routers
// scale their S weights by it, so it sets how much S disturbs the rest of the model, not the
// locality. At token 0 a recency head sees one token and S is ~3x (real shapes) to ~5x (tiny)
// its average; with 0.25 llama.cpp's token-0 logits imply a final off-axis variance of 0.95 to
// 1.28 over synth_llama_test's five files (with 1.0 and S of 64 of 256 coordinates: 2.2).
inline constexpr double kSlowVariance = 0.25;

struct RecencyDesign {
  int64_t slow_first = 0, slow_count = 0;   // S = [slow_first, slow_first + slow_count)
  int64_t heads = 1;                        // recency heads per attention layer (R)
  int64_t dims_per_head = 0;                // value dims of each written into S
  int64_t group = 1;                        // q heads per kv head: recency head g is q head g * group
  double amp = 1;                           // score scale: q/k norm weights sqrt(amp) on rotated dims
  std::vector<double> out_gain;             // [layer] gain of head 0 into S (0: no recency head)
  std::vector<double> slow_var;             // [layer] variance of an S coordinate at the router's input
  bool attention(int64_t layer) const { return out_gain[static_cast<size_t>(layer)] > 0; }
  bool slow(int64_t i) const { return i >= slow_first && i < slow_first + slow_count; }
  // The recency head number of q head h, or -1.
  int64_t recency_head(int64_t q_head) const {
    return q_head % group == 0 && q_head / group < heads ? q_head / group : -1;
  }
};

RecencyDesign design_recency(const ShapeSpec& shape, int64_t massive_dim);

// Softmax weights of the recency head at position t over the keys t - Delta, Delta = 0..t.
std::vector<double> recency_weights(const ShapeSpec& shape, double amp, int64_t t);

}  // namespace moraine::synth
