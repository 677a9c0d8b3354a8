// Scalar building blocks of the reference forward pass, one token (or one head) at a time, in
// float with a fixed summation order (rms_norm's sum of squares in double, as llama.cpp).
// Written for clarity; tests check each against a direct formula (tests/reference/ops_test.cpp).
#pragma once
#include "common/model/arch/parts.h"
#include <cstdint>

namespace moraine::reference {

// out = x / sqrt(mean(x^2) + eps) * w   (w may be null: no weight). out may alias x.
void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out);

// x / sqrt(sum(x^2) + eps), in place: the L2 norm the Gated DeltaNet applies to q and k.
void l2_norm(float* x, int64_t n, float eps);

// NEOX-style rotary embedding on the first n_rot dims of one head, in place: dims i and
// i + n_rot/2 rotate by pos * base^(-2i/n_rot). Dims from n_rot on are left as they are.
void rope_neox(float* head, int64_t n_rot, int64_t pos, double freq_base);

// YaRN (NTK-by-parts) scaling of rope_neox's frequencies, as llama.cpp's ggml_rope_ext applies
// it: pair i's frequency mixes base^(-2i/n_rot) / factor (interpolated) and the unscaled one by
// a ramp between the correction dims of beta_fast and beta_slow (model::yarn_ramp: floored /
// ceiled unless the part keeps them fractional), and cos and sin are scaled by attn_factor
// (1 + 0.1 ln(factor)) (attn_factor is ggml_rope_ext's: deepseek2 cancels the YaRN factor with it).
void rope_neox_yarn(float* head, int64_t n_rot, int64_t pos, const model::RopePart& rope);

// The NORM pairing llama.cpp uses for deepseek2 (and llama): dims 2i and 2i + 1 rotate by
// pos * base^(-2i/n_rot); yarn null: unscaled frequencies and magnitude 1, else YaRN as
// rope_neox_yarn applies it (yarn's freq_base is used then).
void rope_norm(float* head, int64_t n_rot, int64_t pos, double freq_base, const model::RopePart* yarn);

inline float silu(float x) { return x / (1.0f + __builtin_expf(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + __builtin_expf(-x)); }
// log(1 + e^x), linear above 20 as torch.nn.functional.softplus does.
float softplus(float x);

// One bit drawn from (seed, layer, element index `at` of the layer's cache, K or V as w): splitmix64
// of them. The cache tests' draws (ExecutorOptions::dot_order's rounding edges, kv_perturb_seed).
inline uint64_t cache_draw(uint64_t seed, int64_t il, uint64_t at, int w) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + (((static_cast<uint64_t>(il) << 48) ^ at) * 2 + static_cast<uint64_t>(w));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return (z ^ (z >> 31)) & 1u;
}

// softmax(q . k_j * scale) over n_kv positions (kdim wide), then the weighted sum of v_j (vdim
// wide): attend_one_head's arithmetic with keys and values of their own widths and strides (MLA).
void attend_rows(const float* q, int64_t kdim, const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                 int64_t vdim, int64_t n_kv, float scale, float* scores, float* out);

// Causal attention of one query head over n_kv cached positions.
// k and v are strided: position j of this kv head starts at k + j * kv_stride.
// scores_tmp must hold n_kv floats. out gets head_dim floats.
void attend_one_head(const float* q, const float* k, const float* v, int64_t n_kv,
                     int64_t kv_stride, int64_t head_dim, float scale, float* scores_tmp,
                     float* out);

// attend_one_head with a learned sink: one more logit `sink` joins the softmax (gpt-oss) and
// takes its share of the probability mass without contributing a value.
void attend_one_head_sink(const float* q, const float* k, const float* v, int64_t n_kv, int64_t kv_stride,
                          int64_t head_dim, float scale, float sink, float* scores_tmp, float* out);

// Depthwise causal conv1d for one new input column, then SiLU:
//   out[c] = silu( sum_{j<K-1} w[c][j] * state[j][c] + w[c][K-1] * x[c] )
// state holds the previous K-1 inputs, oldest first ([K-1][C]); it is shifted to include x.
void conv1d_silu_step(const float* w, int64_t kernel, int64_t channels, float* state,
                      const float* x, float* out);

// One gated delta-rule step for one head with state S[dk][dv] (row i: key dim i):
//   S = exp(g) * S;  u = beta * (v - S^T k);  S += k u^T;  o = scale * S^T q
void delta_rule_step(float* S, const float* q, const float* k, const float* v, float g,
                     float beta, int64_t dk, int64_t dv, float scale, float* o);

}  // namespace moraine::reference
