// Scalar reference dequantization and dot products for the k-quants (Q2_K..Q6_K) against Q8_K.
// Each block is first unpacked to one small integer per element plus per-sub-block scales, so
// the bit layouts (block_layouts.h) are decoded in exactly one place per format.
#include <cstring>

#include "common/formats/half_float.h"
#include "common/formats/kquant_scales.h"
#include "common/formats/quant_formats.h"

namespace moraine::formats {
namespace {

// q in 0..3, element e = 128h + 32s + l at bits 2s of qs[32h + l].
void unpack_q2_k(const BlockQ2_K& b, int q[kQK_K]) {
  for (int e = 0; e < kQK_K; ++e) {
    const int h = e / 128, s = (e / 32) % 4, l = e % 32;
    q[e] = (b.qs[32 * h + l] >> (2 * s)) & 3;
  }
}

// v in -4..3: low 2 bits as Q2_K, minus 4 unless the element's hmask bit is set.
void unpack_q3_k(const BlockQ3_K& b, int v[kQK_K]) {
  for (int e = 0; e < kQK_K; ++e) {
    const int h = e / 128, s = (e / 32) % 4, l = e % 32;
    const int low = (b.qs[32 * h + l] >> (2 * s)) & 3;
    const int high = (b.hmask[l] >> (e / 32)) & 1;
    v[e] = low - (high ? 0 : 4);
  }
}

// q in 0..15 (Q4_K) or 0..31 (Q5_K, with_high_bit): e = 64p + 32t + l.
template <typename Block>
void unpack_q45_k(const Block& b, int q[kQK_K], bool with_high_bit) {
  for (int e = 0; e < kQK_K; ++e) {
    const int p = e / 64, t = (e / 32) % 2, l = e % 32;
    const uint8_t byte = b.qs[32 * p + l];
    q[e] = t ? (byte >> 4) : (byte & 0x0f);
    if constexpr (requires { b.qh; }) {
      if (with_high_bit) q[e] += ((b.qh[l] >> (2 * p + t)) & 1) << 4;
    }
  }
}

// v in -32..31: e = 128h + 32s + l; low nibble from ql, top two bits from qh.
void unpack_q6_k(const BlockQ6_K& b, int v[kQK_K]) {
  for (int e = 0; e < kQK_K; ++e) {
    const int h = e / 128, s = (e / 32) % 4, l = e % 32;
    const uint8_t lo_byte = b.ql[64 * h + 32 * (s % 2) + l];
    const int lo = s < 2 ? (lo_byte & 0x0f) : (lo_byte >> 4);
    const int hi = (b.qh[32 * h + l] >> (2 * s)) & 3;
    v[e] = (lo | (hi << 4)) - 32;
  }
}

// Exact integer sum of q * a over elements [begin, begin + len).
int sub_dot(const int* q, const int8_t* a, int begin, int len) {
  int s = 0;
  for (int i = begin; i < begin + len; ++i) s += q[i] * a[i];
  return s;
}

}  // namespace

void dequantize_q2_k(const BlockQ2_K* x, float* y, int64_t nb) {
  int q[kQK_K];
  for (int64_t b = 0; b < nb; ++b, y += kQK_K) {
    unpack_q2_k(x[b], q);
    const float d = half::fp16_to_fp32(x[b].d), dmin = half::fp16_to_fp32(x[b].dmin);
    for (int j = 0; j < 16; ++j) {
      const float dl = d * static_cast<float>(x[b].scales[j] & 0x0f);
      const float ml = dmin * static_cast<float>(x[b].scales[j] >> 4);
      for (int i = 16 * j; i < 16 * j + 16; ++i) y[i] = dl * static_cast<float>(q[i]) - ml;
    }
  }
}

void dequantize_q3_k(const BlockQ3_K* x, float* y, int64_t nb) {
  int v[kQK_K];
  for (int64_t b = 0; b < nb; ++b, y += kQK_K) {
    unpack_q3_k(x[b], v);
    const float d = half::fp16_to_fp32(x[b].d);
    for (int j = 0; j < 16; ++j) {
      const float dl = d * static_cast<float>(kquant::q3k_scale(x[b].scales, j));
      for (int i = 16 * j; i < 16 * j + 16; ++i) y[i] = dl * static_cast<float>(v[i]);
    }
  }
}

template <typename Block>
static void dequantize_q45_k(const Block* x, float* y, int64_t nb, bool high_bit) {
  int q[kQK_K];
  for (int64_t b = 0; b < nb; ++b, y += kQK_K) {
    unpack_q45_k(x[b], q, high_bit);
    const float d = half::fp16_to_fp32(x[b].d), dmin = half::fp16_to_fp32(x[b].dmin);
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      kquant::unpack_scale_min(x[b].scales, j, sc, m);
      const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
      for (int i = 32 * j; i < 32 * j + 32; ++i) y[i] = dl * static_cast<float>(q[i]) - ml;
    }
  }
}

void dequantize_q4_k(const BlockQ4_K* x, float* y, int64_t nb) { dequantize_q45_k(x, y, nb, false); }
void dequantize_q5_k(const BlockQ5_K* x, float* y, int64_t nb) { dequantize_q45_k(x, y, nb, true); }

void dequantize_q6_k(const BlockQ6_K* x, float* y, int64_t nb) {
  int v[kQK_K];
  for (int64_t b = 0; b < nb; ++b, y += kQK_K) {
    unpack_q6_k(x[b], v);
    const float d = half::fp16_to_fp32(x[b].d);
    for (int j = 0; j < 16; ++j) {
      const float dl = d * static_cast<float>(x[b].scales[j]);
      for (int i = 16 * j; i < 16 * j + 16; ++i) y[i] = dl * static_cast<float>(v[i]);
    }
  }
}

void dequantize_q8_k(const BlockQ8_K* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK_K) {
    for (int i = 0; i < kQK_K; ++i) y[i] = x[b].d * static_cast<float>(x[b].qs[i]);
  }
}

float dot_q2_k_q8_k(const BlockQ2_K* w, const BlockQ8_K* a, int64_t nb) {
  int q[kQK_K];
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    unpack_q2_k(w[b], q);
    int isum = 0, msum = 0;
    for (int j = 0; j < 16; ++j) {
      isum += (w[b].scales[j] & 0x0f) * sub_dot(q, a[b].qs, 16 * j, 16);
      msum += (w[b].scales[j] >> 4) * a[b].bsums[j];
    }
    const float d = half::fp16_to_fp32(w[b].d) * a[b].d;
    const float dmin = half::fp16_to_fp32(w[b].dmin) * a[b].d;
    acc += d * static_cast<float>(isum) - dmin * static_cast<float>(msum);
  }
  return acc;
}

float dot_q3_k_q8_k(const BlockQ3_K* w, const BlockQ8_K* a, int64_t nb) {
  int v[kQK_K];
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    unpack_q3_k(w[b], v);
    int isum = 0;
    for (int j = 0; j < 16; ++j) isum += kquant::q3k_scale(w[b].scales, j) * sub_dot(v, a[b].qs, 16 * j, 16);
    const float d = half::fp16_to_fp32(w[b].d) * a[b].d;
    acc += d * static_cast<float>(isum);
  }
  return acc;
}

template <typename Block>
static float dot_q45_k(const Block* w, const BlockQ8_K* a, int64_t nb, bool high_bit) {
  int q[kQK_K];
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    unpack_q45_k(w[b], q, high_bit);
    int isum = 0, msum = 0;
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      kquant::unpack_scale_min(w[b].scales, j, sc, m);
      isum += sc * sub_dot(q, a[b].qs, 32 * j, 32);
      msum += m * (a[b].bsums[2 * j] + a[b].bsums[2 * j + 1]);
    }
    const float d = half::fp16_to_fp32(w[b].d) * a[b].d;
    const float dmin = half::fp16_to_fp32(w[b].dmin) * a[b].d;
    acc += d * static_cast<float>(isum) - dmin * static_cast<float>(msum);
  }
  return acc;
}

float dot_q4_k_q8_k(const BlockQ4_K* w, const BlockQ8_K* a, int64_t nb) { return dot_q45_k(w, a, nb, false); }
float dot_q5_k_q8_k(const BlockQ5_K* w, const BlockQ8_K* a, int64_t nb) { return dot_q45_k(w, a, nb, true); }

float dot_q6_k_q8_k(const BlockQ6_K* w, const BlockQ8_K* a, int64_t nb) {
  int v[kQK_K];
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    unpack_q6_k(w[b], v);
    int isum = 0;
    for (int j = 0; j < 16; ++j) isum += w[b].scales[j] * sub_dot(v, a[b].qs, 16 * j, 16);
    const float d = half::fp16_to_fp32(w[b].d) * a[b].d;
    acc += d * static_cast<float>(isum);
  }
  return acc;
}

}  // namespace moraine::formats
