#include "tools/synth/fast_quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/formats/block_layouts.h"
#include "common/formats/half_float.h"
#include "common/formats/kquant_scales.h"
#include "common/formats/quant.h"

namespace moraine::synth {

namespace {

// Round to nearest (ties to even) without a libm call, so the loops vectorize: adding 1.5 * 2^23
// leaves no fraction bits for |v| < 2^22. (std::lround made the q4_k path half as fast.)
inline int round_clamp(float v, int lo, int hi) {
  const float r = (v + 12582912.0f) - 12582912.0f;
  return std::clamp(static_cast<int>(r), lo, hi);
}

void quantize_q8_0_maxabs(const float* x, BlockQ8_0* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 32) {
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    y[b].d = half::fp32_to_fp16(amax / 127.0f);
    const float d = half::fp16_to_fp32(y[b].d);
    const float inv = d > 0 ? 1.0f / d : 0.0f;
    for (int i = 0; i < 32; ++i) y[b].qs[i] = static_cast<int8_t>(round_clamp(x[i] * inv, -127, 127));
  }
}

void quantize_q4_k_minmax(const float* x, BlockQ4_K* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kQK_K) {
    float scale[8], min[8], max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; ++j) {
      float lo = 0, hi = 0;  // the range includes 0 so that mins stay non-negative
      for (int i = 0; i < 32; ++i) {
        lo = std::min(lo, x[32 * j + i]);
        hi = std::max(hi, x[32 * j + i]);
      }
      scale[j] = (hi - lo) / 15.0f;
      min[j] = -lo;
      max_scale = std::max(max_scale, scale[j]);
      max_min = std::max(max_min, min[j]);
    }
    y[b].d = half::fp32_to_fp16(max_scale / 63.0f);
    y[b].dmin = half::fp32_to_fp16(max_min / 63.0f);
    const float d = half::fp16_to_fp32(y[b].d), dmin = half::fp16_to_fp32(y[b].dmin);
    std::memset(y[b].scales, 0, sizeof(y[b].scales));
    uint8_t L[kQK_K];
    for (int j = 0; j < 8; ++j) {
      // Round the scale up so the sub-block's largest element still fits in 15 steps.
      const int sc = d > 0 ? std::clamp(static_cast<int>(std::ceil(scale[j] / d)), 0, 63) : 0;
      const int m = dmin > 0 ? round_clamp(min[j] / dmin, 0, 63) : 0;
      kquant::pack_scale_min(y[b].scales, j, static_cast<uint8_t>(sc), static_cast<uint8_t>(m));
      const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(m);
      const float inv = ds > 0 ? 1.0f / ds : 0.0f;
      for (int i = 32 * j; i < 32 * j + 32; ++i) L[i] = static_cast<uint8_t>(round_clamp((x[i] + dm) * inv, 0, 15));
    }
    for (int p = 0; p < 4; ++p) {
      for (int l = 0; l < 32; ++l) y[b].qs[32 * p + l] = static_cast<uint8_t>(L[64 * p + l] | (L[64 * p + 32 + l] << 4));
    }
  }
}

void quantize_q6_k_maxabs(const float* x, BlockQ6_K* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kQK_K) {
    float scale[16], max_scale = 0;
    for (int j = 0; j < 16; ++j) {
      float amax = 0;
      for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(x[16 * j + i]));
      scale[j] = amax / 31.0f;
      max_scale = std::max(max_scale, scale[j]);
    }
    std::memset(&y[b], 0, sizeof(BlockQ6_K));
    y[b].d = half::fp32_to_fp16(max_scale / 127.0f);
    const float d = half::fp16_to_fp32(y[b].d);
    uint8_t L[kQK_K];
    for (int j = 0; j < 16; ++j) {
      const int sc = d > 0 ? std::clamp(static_cast<int>(std::ceil(scale[j] / d)), 0, 127) : 0;
      y[b].scales[j] = static_cast<int8_t>(sc);
      const float ds = d * static_cast<float>(sc);
      const float inv = ds > 0 ? 1.0f / ds : 0.0f;
      for (int i = 16 * j; i < 16 * j + 16; ++i) L[i] = static_cast<uint8_t>(round_clamp(x[i] * inv, -32, 31) + 32);
    }
    for (int e = 0; e < kQK_K; ++e) {
      const int h = e / 128, s = (e / 32) % 4, l = e % 32;
      uint8_t& lo_byte = y[b].ql[64 * h + 32 * (s % 2) + l];
      lo_byte = static_cast<uint8_t>(lo_byte | ((L[e] & 0x0f) << (s < 2 ? 0 : 4)));
      y[b].qh[32 * h + l] = static_cast<uint8_t>(y[b].qh[32 * h + l] | ((L[e] >> 4) << (2 * s)));
    }
  }
}

}  // namespace

void fast_quantize_row(TensorType t, const float* src, void* dst, int64_t n) {
  if (t == TensorType::Q8_0 && n % 32 == 0) {
    quantize_q8_0_maxabs(src, static_cast<BlockQ8_0*>(dst), n / 32);
  } else if (t == TensorType::Q4_K && n % kQK_K == 0) {
    quantize_q4_k_minmax(src, static_cast<BlockQ4_K*>(dst), n / kQK_K);
  } else if (t == TensorType::Q6_K && n % kQK_K == 0) {
    quantize_q6_k_maxabs(src, static_cast<BlockQ6_K*>(dst), n / kQK_K);
  } else {
    quantize_row(t, src, dst, n);
  }
}

}  // namespace moraine::synth
