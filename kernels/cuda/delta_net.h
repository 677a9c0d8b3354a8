// Gated DeltaNet token mixer of qwen3next and qwen35moe on the GPU: everything between the input
// projections (qkv, z, ba: matvecs / GEMMs the backend runs) and the output projection. Scalar reference:
// ReferenceExecutor::delta_net_block (common/reference/delta_net_block.cpp) with the ops of
// common/reference/ops.h; the kernels compute the same formulas in the same order per element,
// only the order of float additions inside dot products and norms differs.
//
// Per token t (one sequence), with r = n_v_heads / n_k_heads value heads per key head and value
// head hv reading key head hv / r (grouped, qwen3next) or hv % n_k_heads (tiled, qwen35moe:
// DeltaNetShape::v_heads_tiled), as the reference:
//   x      = silu(causal depthwise conv over the K last qkv columns)       delta_net_conv_silu
//   q, k   = x's q and k heads, each L2-normalised; q then times 1/sqrt(d_k) delta_net_l2_norm_qk
//   beta   = sigmoid(b),  gate = a * softplus(alpha + dt_bias)              delta_net_gates
//   S      = exp(gate) * S;  u = beta * (v - S^T k);  S += k u^T;  o = S^T q delta_net_recurrence
//                                                   (or delta_net_recurrence_chunked)
//   out    = rmsnorm(o) * norm_weight * silu(z)   (per value head)          delta_net_gated_rms_norm
// delta_net_mix runs the whole chain (fusing stages for short calls) and is what a backend calls.
//
// Layouts (all F32, row-major, device pointers, one sequence):
//   mixed   [n][conv_dim]  conv_dim = 2 * key_dim + value_dim: [q all heads | k all heads | v all heads]
//   z       [n][value_dim]
//   ba      [n][2 * n_v_heads], grouped per key head g: [b of its r value heads | alpha of them];
//           with split_ba (qwen35moe: ssm_beta and ssm_alpha stacked) [b of every value head | alpha of every one]
//   conv_w  [conv_dim][K]   channel c's taps, oldest input first (model::DeltaNetWeights::conv)
//   a, dt_bias [n_v_heads]  (a = -exp(A_log) as converters store it); norm_w [head_v_dim]
//   conv_state [K-1][conv_dim]      the previous K-1 inputs, oldest first (the reference's)
//   ssm_state  [n_v_heads][d_k][d_v] row i of a head = key dim i (the reference's)
//   out     [n][value_dim]
// States carry from one call to the next: prefill of n tokens then decode of 1 continues the
// same sequence; zero both states to start a new one. Calls are asynchronous on `stream`;
// arguments are checked on the host (std::invalid_argument naming the problem), before any launch.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/delta_net_shape.h"   // DeltaNetShape, delta_net_mix_workspace_floats

namespace moraine::cuda {

// Throws std::invalid_argument naming the field when a shape is outside DeltaNetShape's limits.
void check_delta_net_shape(const DeltaNetShape& s);

// ---- stages (each one launch or two; tests check each against the reference) ----

// conv_out[t][c] = silu(sum_j conv_w[c][j] * in(t - K + 1 + j)[c]) where in(t) is mixed row t
// for t >= 0 and conv_state row K-1+t before it; conv_state then holds the last K-1 inputs.
// n >= 1; conv_out must not overlap mixed or conv_state.
void delta_net_conv_silu(const DeltaNetShape& s, const float* conv_w, float* conv_state,
                         const float* mixed, float* conv_out, int64_t n, cudaStream_t stream = nullptr);

// In place on x = conv_out rows [n][conv_dim]: every q head and k head (d_k values) becomes
// v / sqrt(sum(v^2) + eps); q heads are then multiplied by 1/sqrt(d_k) (the reference does that
// inside delta_rule_step, as a separate float rounding, which this keeps). v is untouched.
void delta_net_l2_norm_qk(const DeltaNetShape& s, float* x, int64_t n, float eps,
                          cudaStream_t stream = nullptr);

// beta[t][hv] = sigmoid(b), gate[t][hv] = a[hv] * softplus(alpha + dt_bias[hv]) (the decay is
// exp(gate); softplus is linear above 20 as the reference's). beta and gate are [n][n_v_heads].
void delta_net_gates(const DeltaNetShape& s, const float* ba, const float* a, const float* dt_bias,
                     float* beta, float* gate, int64_t n, cudaStream_t stream = nullptr);

// The gated delta rule over n tokens in order, state carried in ssm_state. qkv is the
// normalised conv output [n][conv_dim] (q already scaled), gate/beta as delta_net_gates makes
// them; o[t] = S_t^T q_t into out [n][value_dim]. One CTA per value head and 32 state columns
// walks the tokens with its part of the state in registers (the same code for n = 1, so
// prefill of n tokens equals n decode steps bit for bit). out must not overlap the inputs.
void delta_net_recurrence(const DeltaNetShape& s, float* ssm_state, const float* qkv,
                          const float* gate, const float* beta, float* out, int64_t n,
                          cudaStream_t stream = nullptr);

// The same recurrence in chunked (WY) form for prefill: chunks of 64 tokens turn into small
// matrix products in parallel over (chunk, head), and only a short pass over the chunks is
// sequential (kernels/cuda/delta_net_chunked.cu has the formulas). Same inputs, results equal
// to rounding (not bit for bit). Needs head_k_dim and head_v_dim <= 128 (chunked_supported) and
// a workspace of delta_net_chunked_workspace_floats(s, n) floats (it covers at most 2048 tokens
// of intermediates: longer prompts go through in passes of 2048). Not yet faster than the
// token loop (H200, Qwen3-Next shape, 8192 tokens: 12.5 ms vs 8.6 ms), so delta_net_mix does
// not call it; the chunk pass is latency-bound (see the .cu).
bool delta_net_chunked_supported(const DeltaNetShape& s);
int64_t delta_net_chunked_workspace_floats(const DeltaNetShape& s, int64_t n);
void delta_net_recurrence_chunked(const DeltaNetShape& s, float* ssm_state, const float* qkv, const float* gate,
                                  const float* beta, float* out, int64_t n, float* workspace,
                                  cudaStream_t stream = nullptr);

// In place on o [n][value_dim]: per value head, o = rmsnorm(o) * norm_w * silu(z) with the
// reference's rms_norm (sum of squares in double).
void delta_net_gated_rms_norm(const DeltaNetShape& s, float* o, const float* z, const float* norm_w,
                              int64_t n, float eps, cudaStream_t stream = nullptr);

// ---- the whole mixer ----

struct DeltaNetWeightsDevice {
  const float* conv_w = nullptr;   // [conv_dim][K]
  const float* a = nullptr;        // [n_v_heads]
  const float* dt_bias = nullptr;  // [n_v_heads]
  const float* norm_w = nullptr;   // [head_v_dim]
};

struct DeltaNetStateDevice {
  float* conv_state = nullptr;  // [K-1][conv_dim] (may be null when K == 1)
  float* ssm_state = nullptr;   // [n_v_heads][d_k][d_v]
};

// Floats of scratch delta_net_mix needs for n tokens (conv output, beta and gate): n *
// (conv_dim + 2 * n_v_heads), delta_net_mix_workspace_floats after checking the shape and n >= 1
// (std::invalid_argument). Size it once for the largest n: a smaller call needs no more.
int64_t delta_net_workspace_floats(const DeltaNetShape& s, int64_t n);

// out[n][value_dim] = the mixer's output before the out projection (reference's `core`), for
// n tokens of one sequence (n = 1: decode). Calls of up to 4 tokens run two kernels (conv, then
// the token loop with the norms and gates fused in); longer ones run the stages one by one.
// Either way the results equal n single-token calls bit for bit. workspace:
// delta_net_workspace_floats(s, n) floats, not overlapping anything else. mixed, z and ba are
// read only.
void delta_net_mix(const DeltaNetShape& s, const DeltaNetWeightsDevice& w, const DeltaNetStateDevice& state,
                   const float* mixed, const float* z, const float* ba, int64_t n, float eps,
                   float* workspace, float* out, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
