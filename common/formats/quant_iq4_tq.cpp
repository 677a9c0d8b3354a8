// Scalar reference of the non-linear 4-bit formats IQ4_NL / IQ4_XS and the ternary TQ1_0 / TQ2_0.
// The quantizers follow ggml's reference searches step for step (same float expressions, same
// order), so they write ggml's bytes; the dots are ggml's generic expressions
// (quant_formats_legacy_iq4_tq.h).
#include <cmath>
#include <cstring>

#include "common/formats/half_float.h"
#include "common/formats/quant_formats.h"

namespace moraine::formats {
namespace {

constexpr float kGroupMaxEps = 1e-15f;  // ggml's GROUP_MAX_EPS: below it a sub-block is zero

// Index of the grid value nearest to x (the lower one on ties; ggml's best_index_int8).
int nearest_iq4_index(float x) {
  const int8_t* v = kIQ4NLValues;
  if (x <= v[0]) return 0;
  if (x >= v[15]) return 15;
  int lo = 0, hi = 15;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (x < v[mid]) hi = mid; else lo = mid;
  }
  return x - v[hi - 1] < v[hi] - x ? hi - 1 : hi;
}

// Weighted least-squares fit of one 32-element sub-block to the grid: the scale of the best of
// 2 * ntry + 2 candidate grids (ntry < 0: the first only), codes of the first into L. Returns 0
// for an all-but-zero sub-block (L then untouched, as ggml leaves it).
float fit_iq4_subblock(const float* x, uint8_t* L, int ntry) {
  float weight[32];
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < 32; ++j) {
    weight[j] = x[j] * x[j];
    if (std::fabs(x[j]) > amax) amax = std::fabs(x[j]), max = x[j];
  }
  if (amax < kGroupMaxEps) return 0.0f;
  float d = ntry > 0 ? -max / kIQ4NLValues[0] : max / kIQ4NLValues[0];
  float id = 1.0f / d;
  float sumqx = 0.0f, sumq2 = 0.0f;
  for (int j = 0; j < 32; ++j) {
    const int l = nearest_iq4_index(id * x[j]);
    L[j] = static_cast<uint8_t>(l);
    const float q = kIQ4NLValues[l];
    sumqx += weight[j] * q * x[j];
    sumq2 += weight[j] * q * q;
  }
  d = sumq2 > 0.0f ? sumqx / sumq2 : 0.0f;
  float best = d * sumqx;
  for (int itry = -ntry; itry <= ntry; ++itry) {
    id = static_cast<float>(itry + kIQ4NLValues[0]) / max;
    sumqx = sumq2 = 0.0f;
    for (int j = 0; j < 32; ++j) {
      const float q = kIQ4NLValues[nearest_iq4_index(id * x[j])];
      sumqx += weight[j] * q * x[j];
      sumq2 += weight[j] * q * q;
    }
    if (sumq2 > 0.0f && sumqx * sumqx > best * sumq2) {
      d = sumqx / sumq2;
      best = d * sumqx;
    }
  }
  return d;
}

void pack_nibbles(const uint8_t* L, uint8_t* qs) {
  for (int j = 0; j < 16; ++j) qs[j] = static_cast<uint8_t>(L[j] | (L[j + 16] << 4));
}

// Trit of a TQ1_0 byte at position n (0 = most significant): ggml's fixed-point extraction.
inline int tq1_trit(uint8_t byte, int n) {
  static constexpr uint8_t kPow3[5] = {1, 3, 9, 27, 81};
  const auto q = static_cast<uint8_t>(byte * kPow3[n]);
  return (static_cast<uint16_t>(q) * 3) >> 8;
}

// Calls f(element index, trit) for the 256 elements of a TQ1_0 block in storage order.
template <typename F>
void for_each_tq1_trit(const BlockTQ1_0& blk, F f) {
  for (int n = 0; n < 5; ++n) {
    for (int m = 0; m < 32; ++m) f(32 * n + m, tq1_trit(blk.qs[m], n));
  }
  for (int n = 0; n < 5; ++n) {
    for (int m = 0; m < 16; ++m) f(160 + 16 * n + m, tq1_trit(blk.qs[32 + m], n));
  }
  for (int n = 0; n < 4; ++n) {
    for (int j = 0; j < 4; ++j) f(240 + 4 * n + j, tq1_trit(blk.qh[j], n));
  }
}

float ternary_inverse(float amax) {
  const float r = 1.0f / amax;
  return amax != 0.0f && std::isfinite(r) ? r : 0.0f;
}

// lroundf(x * id) + 1: the trit 0..2 of x at scale 1/id (|x * id| <= 1).
inline int to_trit(float x, float id) { return static_cast<int>(std::lround(x * id)) + 1; }

// ceil(v * 256 / 243): the stored form of a byte of five trits.
inline uint8_t trit_byte(unsigned v) { return static_cast<uint8_t>((v * 256 + 242) / 243); }

}  // namespace

void quantize_iq4_nl(const float* x, BlockIQ4_NL* y, int64_t nb) {
  uint8_t L[32] = {};  // persists across blocks: ggml's zero blocks reuse the previous codes
  for (int64_t b = 0; b < nb; ++b, x += 32) {
    const float d = fit_iq4_subblock(x, L, -1);
    y[b].d = half::fp32_to_fp16(d);
    pack_nibbles(L, y[b].qs);
  }
}

void quantize_iq4_xs(const float* x, BlockIQ4_XS* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kQK_K) {
    uint8_t L[kQK_K] = {};
    float scales[8];
    float max_scale = 0.0f, amax_scale = 0.0f;
    for (int ib = 0; ib < 8; ++ib) {
      scales[ib] = fit_iq4_subblock(x + 32 * ib, L + 32 * ib, 7);
      if (std::fabs(scales[ib]) > amax_scale) amax_scale = std::fabs(scales[ib]), max_scale = scales[ib];
    }
    // Sub-block scales as 6-bit multiples of one fp16 scale; the largest one lands on -32.
    const float d = -max_scale / 32.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = half::fp32_to_fp16(d);
    y[b].scales_h = 0;
    std::memset(y[b].scales_l, 0, sizeof(y[b].scales_l));
    for (int ib = 0; ib < 8; ++ib) {
      int l = static_cast<int>(std::lrint(id * scales[ib]));
      l = l < -32 ? -32 : (l > 31 ? 31 : l);
      const float dl = d * static_cast<float>(l);
      const float idl = dl != 0.0f ? 1.0f / dl : 0.0f;
      for (int j = 0; j < 32; ++j) L[32 * ib + j] = static_cast<uint8_t>(nearest_iq4_index(idl * x[32 * ib + j]));
      l += 32;
      y[b].scales_l[ib / 2] |= static_cast<uint8_t>((l & 0x0f) << (4 * (ib % 2)));
      y[b].scales_h |= static_cast<uint16_t>((l >> 4) << (2 * ib));
      pack_nibbles(L + 32 * ib, y[b].qs + 16 * ib);
    }
  }
}

void quantize_tq1_0(const float* x, BlockTQ1_0* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kQK_K) {
    float amax = 0.0f;
    for (int j = 0; j < kQK_K; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const float id = ternary_inverse(amax);
    y[b].d = half::fp32_to_fp16(amax);
    for (int m = 0; m < 32; ++m) {
      unsigned q = 0;
      for (int n = 0; n < 5; ++n) q = q * 3 + static_cast<unsigned>(to_trit(x[32 * n + m], id));
      y[b].qs[m] = trit_byte(q);
    }
    for (int m = 0; m < 16; ++m) {
      unsigned q = 0;
      for (int n = 0; n < 5; ++n) q = q * 3 + static_cast<unsigned>(to_trit(x[160 + 16 * n + m], id));
      y[b].qs[32 + m] = trit_byte(q);
    }
    for (int j = 0; j < 4; ++j) {
      unsigned q = 0;
      for (int n = 0; n < 4; ++n) q = q * 3 + static_cast<unsigned>(to_trit(x[240 + 4 * n + j], id));
      y[b].qh[j] = trit_byte(q * 3);  // four trits, shifted up to the top positions
    }
  }
}

void quantize_tq2_0(const float* x, BlockTQ2_0* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kQK_K) {
    float amax = 0.0f;
    for (int j = 0; j < kQK_K; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const float id = ternary_inverse(amax);
    y[b].d = half::fp32_to_fp16(amax);
    for (int h = 0; h < 2; ++h) {
      for (int m = 0; m < 32; ++m) {
        unsigned q = 0;
        for (int l = 0; l < 4; ++l) q |= static_cast<unsigned>(to_trit(x[128 * h + 32 * l + m], id) & 3) << (2 * l);
        y[b].qs[32 * h + m] = static_cast<uint8_t>(q);
      }
    }
  }
}

void dequantize_iq4_nl(const BlockIQ4_NL* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += 32) {
    const float d = half::fp16_to_fp32(x[b].d);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>(kIQ4NLValues[x[b].qs[j] & 0x0f]);
      y[j + 16] = d * static_cast<float>(kIQ4NLValues[x[b].qs[j] >> 4]);
    }
  }
}

inline int iq4_xs_scale(const BlockIQ4_XS& blk, int ib) {
  return ((blk.scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0f) | (((blk.scales_h >> (2 * ib)) & 3) << 4);
}

void dequantize_iq4_xs(const BlockIQ4_XS* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float d = half::fp16_to_fp32(x[b].d);
    for (int ib = 0; ib < 8; ++ib, y += 32) {
      const float dl = d * static_cast<float>(iq4_xs_scale(x[b], ib) - 32);
      const uint8_t* qs = x[b].qs + 16 * ib;
      for (int j = 0; j < 16; ++j) {
        y[j] = dl * static_cast<float>(kIQ4NLValues[qs[j] & 0x0f]);
        y[j + 16] = dl * static_cast<float>(kIQ4NLValues[qs[j] >> 4]);
      }
    }
  }
}

void dequantize_tq1_0(const BlockTQ1_0* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK_K) {
    const float d = half::fp16_to_fp32(x[b].d);
    for_each_tq1_trit(x[b], [&](int i, int t) { y[i] = static_cast<float>(t - 1) * d; });
  }
}

void dequantize_tq2_0(const BlockTQ2_0* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK_K) {
    const float d = half::fp16_to_fp32(x[b].d);
    for (int h = 0; h < 2; ++h) {
      for (int l = 0; l < 4; ++l) {
        for (int m = 0; m < 32; ++m) y[128 * h + 32 * l + m] = static_cast<float>(((x[b].qs[32 * h + m] >> (2 * l)) & 3) - 1) * d;
      }
    }
  }
}

float dot_iq4_nl_q8_0(const BlockIQ4_NL* w, const BlockQ8_0* a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const float d = half::fp16_to_fp32(a[b].d) * half::fp16_to_fp32(w[b].d);
    int sum = 0;
    for (int j = 0; j < 16; ++j) {
      sum += a[b].qs[j] * kIQ4NLValues[w[b].qs[j] & 0x0f];
      sum += a[b].qs[j + 16] * kIQ4NLValues[w[b].qs[j] >> 4];
    }
    acc += d * static_cast<float>(sum);
  }
  return acc;
}

float dot_iq4_xs_q8_k(const BlockIQ4_XS* w, const BlockQ8_K* a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const float d4d8 = half::fp16_to_fp32(w[b].d) * a[b].d;
    for (int ib = 0; ib < 8; ++ib) {
      const uint8_t* qs = w[b].qs + 16 * ib;
      const int8_t* q8 = a[b].qs + 32 * ib;
      int sum = 0;
      for (int j = 0; j < 16; ++j) sum += q8[j] * kIQ4NLValues[qs[j] & 0x0f] + q8[j + 16] * kIQ4NLValues[qs[j] >> 4];
      acc += (d4d8 * static_cast<float>(iq4_xs_scale(w[b], ib) - 32)) * static_cast<float>(sum);
    }
  }
  return acc;
}

float dot_tq1_0_q8_k(const BlockTQ1_0* w, const BlockQ8_K* a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    int sum = 0;
    for_each_tq1_trit(w[b], [&](int i, int t) { sum += (t - 1) * a[b].qs[i]; });
    acc += static_cast<float>(sum) * (half::fp16_to_fp32(w[b].d) * a[b].d);
  }
  return acc;
}

float dot_tq2_0_q8_k(const BlockTQ2_0* w, const BlockQ8_K* a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    int sum = 0;
    for (int h = 0; h < 2; ++h) {
      for (int l = 0; l < 4; ++l) {
        for (int m = 0; m < 32; ++m) sum += a[b].qs[128 * h + 32 * l + m] * (((w[b].qs[32 * h + m] >> (2 * l)) & 3) - 1);
      }
    }
    acc += static_cast<float>(sum) * (a[b].d * half::fp16_to_fp32(w[b].d));
  }
  return acc;
}

}  // namespace moraine::formats
