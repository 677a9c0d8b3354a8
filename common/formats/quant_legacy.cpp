// Scalar reference for the 32-element block formats: Q4_0, Q8_0 and MXFP4. Quantization follows
// ggml's reference rules exactly (they are simple and define what files hold); each dot sums a
// block in integers and applies the two block scales in float, in block order.
#include <cmath>
#include <cstdlib>

#include "common/formats/half_float.h"
#include "common/formats/quant_formats.h"

namespace moraine::formats {
namespace {

// The element of largest magnitude, keeping its sign (first one on ties).
float signed_absmax(const float* x, int n) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < n; ++j) {
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  return max;
}

// 1/d, or 0 when d is 0 or so small that 1/d overflows (its fp16 form is 0 then anyway, so
// every level must be 0 too). For ordinary d this is exactly ggml's `d ? 1/d : 0`.
float safe_inverse(float d) {
  const float r = 1.0f / d;
  return d != 0.0f && std::isfinite(r) ? r : 0.0f;
}

float absmax(const float* x, int n) {
  float amax = 0.0f;
  for (int j = 0; j < n; ++j) amax = std::fmax(amax, std::fabs(x[j]));
  return amax;
}

// Nearest E2M1 code to x at scale `half_scale` (the first of equals, so +0 beats -0).
uint8_t nearest_e2m1(float x, float half_scale) {
  uint8_t best = 0;
  float best_err = std::fabs(kE2M1Doubled[0] * half_scale - x);
  for (uint8_t c = 1; c < 16; ++c) {
    const float err = std::fabs(kE2M1Doubled[c] * half_scale - x);
    if (err < best_err) {
      best_err = err;
      best = c;
    }
  }
  return best;
}

}  // namespace

void quantize_q4_0(const float* x, BlockQ4_0* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kQK) {
    // Mapping the signed extreme to level -8 uses the one extra negative level of the range.
    const float d = signed_absmax(x, kQK) / -8.0f;
    const float id = safe_inverse(d);
    y[b].d = half::fp32_to_fp16(d);
    for (int j = 0; j < kQK / 2; ++j) {
      int lo = static_cast<int>(x[j] * id + 8.5f);
      int hi = static_cast<int>(x[j + kQK / 2] * id + 8.5f);
      lo = lo < 0 ? 0 : (lo > 15 ? 15 : lo);
      hi = hi < 0 ? 0 : (hi > 15 ? 15 : hi);
      y[b].qs[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

void quantize_q8_0(const float* x, BlockQ8_0* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kQK) {
    const float d = absmax(x, kQK) / 127.0f;
    const float id = safe_inverse(d);
    y[b].d = half::fp32_to_fp16(d);
    for (int j = 0; j < kQK; ++j) y[b].qs[j] = static_cast<int8_t>(std::round(x[j] * id));
  }
}

void quantize_mxfp4(const float* x, BlockMXFP4* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kQK) {
    const float amax = absmax(x, kQK);
    // Shared exponent: the block max lands in [8, 16) units of the doubled E2M1 grid, so the
    // top code (12) sits at 1.5 * 2^floor(log2 amax) and larger elements clip to it (ggml's rule).
    int e = 0;
    if (amax > 0.0f) e = static_cast<int>(std::floor(std::log2(amax))) - 2 + 127;
    e = e < 0 ? 0 : (e > 254 ? 254 : e);
    y[b].e = static_cast<uint8_t>(e);
    const float half_scale = half::e8m0_to_fp32_half(y[b].e);
    for (int j = 0; j < kQK / 2; ++j) {
      const uint8_t lo = nearest_e2m1(x[j], half_scale);
      const uint8_t hi = nearest_e2m1(x[j + kQK / 2], half_scale);
      y[b].qs[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

void dequantize_q4_0(const BlockQ4_0* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = half::fp16_to_fp32(x[b].d);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = static_cast<float>((x[b].qs[j] & 0x0f) - 8) * d;
      y[j + kQK / 2] = static_cast<float>((x[b].qs[j] >> 4) - 8) * d;
    }
  }
}

void dequantize_q8_0(const BlockQ8_0* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = half::fp16_to_fp32(x[b].d);
    for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(x[b].qs[j]) * d;
  }
}

void dequantize_mxfp4(const BlockMXFP4* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = half::e8m0_to_fp32_half(x[b].e);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = static_cast<float>(kE2M1Doubled[x[b].qs[j] & 0x0f]) * d;
      y[j + kQK / 2] = static_cast<float>(kE2M1Doubled[x[b].qs[j] >> 4]) * d;
    }
  }
}

float dot_q4_0_q8_0(const BlockQ4_0* w, const BlockQ8_0* a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    int sum = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      sum += ((w[b].qs[j] & 0x0f) - 8) * a[b].qs[j];
      sum += ((w[b].qs[j] >> 4) - 8) * a[b].qs[j + kQK / 2];
    }
    acc += static_cast<float>(sum) * (half::fp16_to_fp32(w[b].d) * half::fp16_to_fp32(a[b].d));
  }
  return acc;
}

float dot_q8_0_q8_0(const BlockQ8_0* w, const BlockQ8_0* a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    int sum = 0;
    for (int j = 0; j < kQK; ++j) sum += w[b].qs[j] * a[b].qs[j];
    acc += static_cast<float>(sum) * (half::fp16_to_fp32(w[b].d) * half::fp16_to_fp32(a[b].d));
  }
  return acc;
}

float dot_mxfp4_q8_0(const BlockMXFP4* w, const BlockQ8_0* a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    int sum = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      sum += kE2M1Doubled[w[b].qs[j] & 0x0f] * a[b].qs[j];
      sum += kE2M1Doubled[w[b].qs[j] >> 4] * a[b].qs[j + kQK / 2];
    }
    acc += static_cast<float>(sum) * (half::e8m0_to_fp32_half(w[b].e) * half::fp16_to_fp32(a[b].d));
  }
  return acc;
}

}  // namespace moraine::formats
