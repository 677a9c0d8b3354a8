// Scalar reference of the affine 32-element formats Q4_1 and Q5_1 (with their activation format
// Q8_1) and of Q5_0. Quantizers follow ggml's reference rules exactly; the dots use ggml's float
// expressions in its order (quant_formats_legacy_iq4_tq.h), so both are bit-identical to it.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "common/formats/half_float.h"
#include "common/formats/quant_formats.h"

namespace moraine::formats {
namespace {

// 1/d, or 0 when d is 0 or 1/d overflows (then fp16(d) is 0 and every level must be 0 too; for
// ordinary d this is exactly ggml's `d ? 1/d : 0`).
float safe_inverse(float d) {
  const float r = 1.0f / d;
  return d != 0.0f && std::isfinite(r) ? r : 0.0f;
}

void min_max(const float* x, float& lo, float& hi) {
  lo = FLT_MAX;
  hi = -FLT_MAX;
  for (int j = 0; j < kQK; ++j) {
    if (x[j] < lo) lo = x[j];
    if (x[j] > hi) hi = x[j];
  }
}

// (x - min) * id: ggml's level before rounding. Where x - min overflows (a block spanning more
// than FLT_MAX, whose scale is then inf and the row refused) inf * 0 would be NaN: 0 instead.
inline float level(float offset, float id) { return std::fmax(offset * id, 0.0f); }

uint32_t load_qh(const uint8_t* qh) {
  uint32_t v;
  std::memcpy(&v, qh, 4);
  return v;
}

// The five-bit quants q[0..31] of a block: low nibbles into qs, bit 4 into qh.
void pack_q5(const uint8_t* q, uint8_t* qs, uint8_t* qh_bytes) {
  uint32_t qh = 0;
  for (int j = 0; j < kQK / 2; ++j) {
    qs[j] = static_cast<uint8_t>((q[j] & 0x0f) | ((q[j + kQK / 2] & 0x0f) << 4));
    qh |= static_cast<uint32_t>((q[j] >> 4) & 1) << j;
    qh |= static_cast<uint32_t>((q[j + kQK / 2] >> 4) & 1) << (j + kQK / 2);
  }
  std::memcpy(qh_bytes, &qh, 4);
}

}  // namespace

void quantize_q4_1(const float* x, BlockQ4_1* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kQK) {
    float lo, hi;
    min_max(x, lo, hi);
    const float d = (hi - lo) / 15.0f;
    const float id = safe_inverse(d);
    y[b].d = half::fp32_to_fp16(d);
    y[b].m = half::fp32_to_fp16(lo);
    for (int j = 0; j < kQK / 2; ++j) {
      // (x - min) * id is in [0, 15] up to rounding; truncating x + 0.5 rounds half up.
      const int q0 = std::min(15, static_cast<int>(level(x[j] - lo, id) + 0.5f));
      const int q1 = std::min(15, static_cast<int>(level(x[j + kQK / 2] - lo, id) + 0.5f));
      y[b].qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
    }
  }
}

void quantize_q5_0(const float* x, BlockQ5_0* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kQK) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < kQK; ++j) {
      if (amax < std::fabs(x[j])) amax = std::fabs(x[j]), max = x[j];
    }
    // The signed extreme maps to level 0 (-16), the one extra negative level.
    const float d = max / -16.0f;
    const float id = safe_inverse(d);
    y[b].d = half::fp32_to_fp16(d);
    uint8_t q[kQK];
    for (int j = 0; j < kQK; ++j) q[j] = static_cast<uint8_t>(std::min(31, static_cast<int>(x[j] * id + 16.5f)));
    pack_q5(q, y[b].qs, y[b].qh);
  }
}

void quantize_q5_1(const float* x, BlockQ5_1* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kQK) {
    float lo, hi;
    min_max(x, lo, hi);
    const float d = (hi - lo) / 31.0f;
    const float id = safe_inverse(d);
    y[b].d = half::fp32_to_fp16(d);
    y[b].m = half::fp32_to_fp16(lo);
    uint8_t q[kQK];
    // ggml takes the low 5 bits of (uint8_t)(v + 0.5) with no clamp; v <= 31 up to rounding.
    for (int j = 0; j < kQK; ++j) q[j] = static_cast<uint8_t>(static_cast<int>(level(x[j] - lo, id) + 0.5f));
    pack_q5(q, y[b].qs, y[b].qh);
  }
}

void quantize_q8_1(const float* x, BlockQ8_1* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kQK) {
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = safe_inverse(d);
    y[b].d = half::fp32_to_fp16(d);
    int sum = 0;
    for (int j = 0; j < kQK; ++j) {
      y[b].qs[j] = static_cast<int8_t>(std::round(x[j] * id));
      sum += y[b].qs[j];
    }
    y[b].s = half::fp32_to_fp16(static_cast<float>(sum) * d);
  }
}

void dequantize_q4_1(const BlockQ4_1* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = half::fp16_to_fp32(x[b].d), m = half::fp16_to_fp32(x[b].m);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = static_cast<float>(x[b].qs[j] & 0x0f) * d + m;
      y[j + kQK / 2] = static_cast<float>(x[b].qs[j] >> 4) * d + m;
    }
  }
}

void dequantize_q5_0(const BlockQ5_0* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = half::fp16_to_fp32(x[b].d);
    const uint32_t qh = load_qh(x[b].qh);
    for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(q5_quant(x[b].qs, qh, j) - 16) * d;
  }
}

void dequantize_q5_1(const BlockQ5_1* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = half::fp16_to_fp32(x[b].d), m = half::fp16_to_fp32(x[b].m);
    const uint32_t qh = load_qh(x[b].qh);
    for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(q5_quant(x[b].qs, qh, j)) * d + m;
  }
}

void dequantize_q8_1(const BlockQ8_1* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = half::fp16_to_fp32(x[b].d);
    for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(x[b].qs[j]) * d;
  }
}

float dot_q4_1_q8_1(const BlockQ4_1* w, const BlockQ8_1* a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    int sum = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      sum += (w[b].qs[j] & 0x0f) * a[b].qs[j];
      sum += (w[b].qs[j] >> 4) * a[b].qs[j + kQK / 2];
    }
    acc += (half::fp16_to_fp32(w[b].d) * half::fp16_to_fp32(a[b].d)) * static_cast<float>(sum) +
           half::fp16_to_fp32(w[b].m) * half::fp16_to_fp32(a[b].s);
  }
  return acc;
}

float dot_q5_0_q8_0(const BlockQ5_0* w, const BlockQ8_0* a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint32_t qh = load_qh(w[b].qh);
    int sum = 0;
    for (int j = 0; j < kQK; ++j) sum += (q5_quant(w[b].qs, qh, j) - 16) * a[b].qs[j];
    acc += (half::fp16_to_fp32(w[b].d) * half::fp16_to_fp32(a[b].d)) * static_cast<float>(sum);
  }
  return acc;
}

float dot_q5_1_q8_1(const BlockQ5_1* w, const BlockQ8_1* a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint32_t qh = load_qh(w[b].qh);
    int sum = 0;
    for (int j = 0; j < kQK; ++j) sum += q5_quant(w[b].qs, qh, j) * a[b].qs[j];
    acc += (half::fp16_to_fp32(w[b].d) * half::fp16_to_fp32(a[b].d)) * static_cast<float>(sum) +
           half::fp16_to_fp32(w[b].m) * half::fp16_to_fp32(a[b].s);
  }
  return acc;
}

}  // namespace moraine::formats
