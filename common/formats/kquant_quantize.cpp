// Scalar quantization to the k-quants and to Q8_K. The searches follow the ideas of ggml's
// reference quantizer (own code): per sub-block, try a small grid of candidate scales, refit the
// scale (and min) by weighted least squares for the levels each candidate picks, keep the best;
// then quantize the sub-block scales against one fp16 super-block scale and re-round every
// element against the scales actually stored.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/formats/half_float.h"
#include "common/formats/kquant_scales.h"
#include "common/formats/quant_formats.h"

namespace moraine::formats {
namespace {

// Round to nearest, ties to even (ggml's nearest_int does the same with the 1.5*2^23 trick).
inline int nearest_int(float v) { return static_cast<int>(std::lrint(v)); }
inline int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Below this a sub-block is treated as all zero (avoids dividing by denormal extremes).
constexpr float kZeroGroupEps = 1e-15f;

// num / den, or 0 when den is 0 or the quotient overflows (tiny super-block maxima).
inline float safe_ratio(float num, float den) {
  const float r = num / den;
  return den > 0.0f && std::isfinite(r) ? r : 0.0f;
}

// x ~= scale * L - min with L in 0..nmax, scale >= 0, min >= 0 (so zero stays reachable).
struct AffineFit {
  float scale;
  float min;
};

AffineFit fit_affine(const float* x, const float* w, int n, int nmax, float rmin, float rdelta, int nstep,
                     uint8_t* L) {
  float lo = x[0], hi = x[0], sum_w = 0.0f, sum_wx = 0.0f;
  for (int i = 0; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
    sum_w += w[i];
    sum_wx += w[i] * x[i];
  }
  lo = std::min(lo, 0.0f);
  if (hi - lo < kZeroGroupEps) {  // constant (or vanishing) group: the offset alone says it
    std::fill(L, L + n, uint8_t{0});
    return {0.0f, -lo};
  }
  auto error_of = [&](float scale, float offset, const uint8_t* levels) {
    float err = 0.0f;
    for (int i = 0; i < n; ++i) {
      const float diff = scale * levels[i] + offset - x[i];
      err += w[i] * diff * diff;
    }
    return err;
  };
  // Start from the plain min..max mapping.
  float best_scale = (hi - lo) / static_cast<float>(nmax), best_offset = lo;
  for (int i = 0; i < n; ++i) L[i] = static_cast<uint8_t>(clampi(nearest_int((x[i] - lo) / best_scale), 0, nmax));
  float best_err = error_of(best_scale, best_offset, L);

  uint8_t cand[32];
  for (int step = 0; step <= nstep; ++step) {
    const float iscale = (static_cast<float>(nmax) + rmin + rdelta * static_cast<float>(step)) / (hi - lo);
    float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
    for (int i = 0; i < n; ++i) {
      const int l = clampi(nearest_int(iscale * (x[i] - lo)), 0, nmax);
      cand[i] = static_cast<uint8_t>(l);
      sum_l += w[i] * l;
      sum_l2 += w[i] * l * l;
      sum_xl += w[i] * l * x[i];
    }
    // Weighted least squares for x ~= scale * l + offset given these levels.
    const float det = sum_w * sum_l2 - sum_l * sum_l;
    if (det <= 0.0f) continue;
    float scale = (sum_w * sum_xl - sum_wx * sum_l) / det;
    float offset = (sum_l2 * sum_wx - sum_l * sum_xl) / det;
    if (offset > 0.0f) {  // the format subtracts a non-negative min
      offset = 0.0f;
      scale = sum_xl / sum_l2;
    }
    const float err = error_of(scale, offset, cand);
    if (err < best_err) {
      best_err = err;
      best_scale = scale;
      best_offset = offset;
      std::memcpy(L, cand, static_cast<size_t>(n));
    }
  }
  return {best_scale, -best_offset};
}

// x ~= scale * l with l in -nneg..nneg-1; returns the scale (negative when the extreme element
// is positive, since the extreme maps to -nneg, the level with no positive twin).
float fit_symmetric(const float* x, const float* w, int n, int nneg) {
  float amax = 0.0f, max = 0.0f;
  for (int i = 0; i < n; ++i) {
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  }
  if (amax < kZeroGroupEps) return 0.0f;
  float best_score = -1.0f, best_scale = 0.0f;
  for (int k = -9; k <= 9; ++k) {
    const float iscale = -(static_cast<float>(nneg) + 0.1f * static_cast<float>(k)) / max;
    float sum_xl = 0.0f, sum_l2 = 0.0f;
    for (int i = 0; i < n; ++i) {
      const int l = clampi(nearest_int(iscale * x[i]), -nneg, nneg - 1);
      sum_xl += w[i] * x[i] * l;
      sum_l2 += w[i] * l * l;
    }
    // With the least-squares scale sum_xl/sum_l2 the weighted error drops by sum_xl^2/sum_l2.
    if (sum_l2 > 0.0f && sum_xl * sum_xl / sum_l2 > best_score) {
      best_score = sum_xl * sum_xl / sum_l2;
      best_scale = sum_xl / sum_l2;
    }
  }
  return best_scale;
}

// Pack 2-bit levels: element 128h + 32s + l goes to bits 2s of qs[32h + l].
void pack_2bit(const uint8_t* L, uint8_t* qs) {
  std::memset(qs, 0, kQK_K / 4);
  for (int e = 0; e < kQK_K; ++e) {
    const int h = e / 128, s = (e / 32) % 4, l = e % 32;
    qs[32 * h + l] = static_cast<uint8_t>(qs[32 * h + l] | ((L[e] & 3) << (2 * s)));
  }
}

// Sub-block fits and packed scales shared by Q4_K and Q5_K (8 sub-blocks of 32, 6-bit scales).
void fit_q45_k_scales(const float* x, int nmax, float rmin, int nstep, uint16_t& d_out, uint16_t& dmin_out,
                      uint8_t* packed, uint8_t* L) {
  float scales[8], mins[8], w[32];
  float max_scale = 0.0f, max_min = 0.0f;
  for (int j = 0; j < 8; ++j) {
    const float* xs = x + 32 * j;
    float sum_x2 = 0.0f;
    for (int i = 0; i < 32; ++i) sum_x2 += xs[i] * xs[i];
    // Weight large elements more, but keep a floor so small ones still count.
    const float rms = std::sqrt(sum_x2 / 32.0f);
    for (int i = 0; i < 32; ++i) w[i] = rms + std::fabs(xs[i]);
    const AffineFit fit = fit_affine(xs, w, 32, nmax, rmin, 0.1f, nstep, L + 32 * j);
    scales[j] = fit.scale;
    mins[j] = fit.min;
    max_scale = std::max(max_scale, fit.scale);
    max_min = std::max(max_min, fit.min);
  }
  const float inv_scale = safe_ratio(63.0f, max_scale);
  const float inv_min = safe_ratio(63.0f, max_min);
  std::memset(packed, 0, kScaleBytesK);
  for (int j = 0; j < 8; ++j) {
    const int sc = clampi(nearest_int(inv_scale * scales[j]), 0, 63);
    const int m = clampi(nearest_int(inv_min * mins[j]), 0, 63);
    kquant::pack_scale_min(packed, j, static_cast<uint8_t>(sc), static_cast<uint8_t>(m));
  }
  d_out = half::fp32_to_fp16(max_scale / 63.0f);
  dmin_out = half::fp32_to_fp16(max_min / 63.0f);
  // Re-round every element against the scales as stored.
  const float d = half::fp16_to_fp32(d_out), dmin = half::fp16_to_fp32(dmin_out);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    kquant::unpack_scale_min(packed, j, sc, m);
    const float ds = d * sc;
    if (ds == 0.0f) continue;
    const float dm = dmin * m;
    for (int i = 32 * j; i < 32 * j + 32; ++i) L[i] = static_cast<uint8_t>(clampi(nearest_int((x[i] + dm) / ds), 0, nmax));
  }
}

}  // namespace

void quantize_q2_k(const float* x, BlockQ2_K* y, int64_t nb) {
  uint8_t L[kQK_K];
  for (int64_t b = 0; b < nb; ++b, x += kQK_K) {
    float scales[16], mins[16], w[16];
    float max_scale = 0.0f, max_min = 0.0f;
    for (int j = 0; j < 16; ++j) {
      for (int i = 0; i < 16; ++i) w[i] = std::fabs(x[16 * j + i]);
      const AffineFit fit = fit_affine(x + 16 * j, w, 16, 3, -0.5f, 0.1f, 15, L + 16 * j);
      scales[j] = fit.scale;
      mins[j] = fit.min;
      max_scale = std::max(max_scale, fit.scale);
      max_min = std::max(max_min, fit.min);
    }
    const float inv_scale = safe_ratio(15.0f, max_scale);
    const float inv_min = safe_ratio(15.0f, max_min);
    for (int j = 0; j < 16; ++j) {
      const int sc = clampi(nearest_int(inv_scale * scales[j]), 0, 15);
      const int m = clampi(nearest_int(inv_min * mins[j]), 0, 15);
      y[b].scales[j] = static_cast<uint8_t>(sc | (m << 4));
    }
    y[b].d = half::fp32_to_fp16(max_scale / 15.0f);
    y[b].dmin = half::fp32_to_fp16(max_min / 15.0f);
    const float d = half::fp16_to_fp32(y[b].d), dmin = half::fp16_to_fp32(y[b].dmin);
    for (int j = 0; j < 16; ++j) {
      const float ds = d * (y[b].scales[j] & 0x0f);
      if (ds == 0.0f) continue;
      const float dm = dmin * (y[b].scales[j] >> 4);
      for (int i = 16 * j; i < 16 * j + 16; ++i) L[i] = static_cast<uint8_t>(clampi(nearest_int((x[i] + dm) / ds), 0, 3));
    }
    pack_2bit(L, y[b].qs);
  }
}

void quantize_q3_k(const float* x, BlockQ3_K* y, int64_t nb) {
  uint8_t L[kQK_K];
  for (int64_t b = 0; b < nb; ++b, x += kQK_K) {
    float scales[16], w[16];
    float max_scale = 0.0f;  // signed scale of largest magnitude
    for (int j = 0; j < 16; ++j) {
      for (int i = 0; i < 16; ++i) w[i] = x[16 * j + i] * x[16 * j + i];
      scales[j] = fit_symmetric(x + 16 * j, w, 16, 4);
      if (std::fabs(scales[j]) > std::fabs(max_scale)) max_scale = scales[j];
    }
    std::memset(y[b].scales, 0, kScaleBytesK);
    if (max_scale != 0.0f) {
      const float iscale = -32.0f / max_scale;
      for (int j = 0; j < 16; ++j) kquant::q3k_set_scale(y[b].scales, j, clampi(nearest_int(iscale * scales[j]), -32, 31) + 32);
      y[b].d = half::fp32_to_fp16(1.0f / iscale);
    } else {
      for (int j = 0; j < 16; ++j) kquant::q3k_set_scale(y[b].scales, j, 32);
      y[b].d = half::fp32_to_fp16(0.0f);
    }
    const float d = half::fp16_to_fp32(y[b].d);
    for (int j = 0; j < 16; ++j) {
      const float ds = d * static_cast<float>(kquant::q3k_scale(y[b].scales, j));
      for (int i = 16 * j; i < 16 * j + 16; ++i) {
        L[i] = ds == 0.0f ? 4 : static_cast<uint8_t>(clampi(nearest_int(x[i] / ds), -4, 3) + 4);
      }
    }
    std::memset(y[b].hmask, 0, sizeof(y[b].hmask));
    for (int e = 0; e < kQK_K; ++e) {
      if (L[e] > 3) {
        y[b].hmask[e % 32] = static_cast<uint8_t>(y[b].hmask[e % 32] | (1 << (e / 32)));
        L[e] = static_cast<uint8_t>(L[e] - 4);
      }
    }
    pack_2bit(L, y[b].qs);
  }
}

void quantize_q4_k(const float* x, BlockQ4_K* y, int64_t nb) {
  uint8_t L[kQK_K];
  for (int64_t b = 0; b < nb; ++b, x += kQK_K) {
    fit_q45_k_scales(x, 15, -1.0f, 20, y[b].d, y[b].dmin, y[b].scales, L);
    for (int p = 0; p < 4; ++p) {
      for (int l = 0; l < 32; ++l) y[b].qs[32 * p + l] = static_cast<uint8_t>(L[64 * p + l] | (L[64 * p + 32 + l] << 4));
    }
  }
}

void quantize_q5_k(const float* x, BlockQ5_K* y, int64_t nb) {
  uint8_t L[kQK_K];
  for (int64_t b = 0; b < nb; ++b, x += kQK_K) {
    fit_q45_k_scales(x, 31, -0.5f, 15, y[b].d, y[b].dmin, y[b].scales, L);
    std::memset(y[b].qh, 0, sizeof(y[b].qh));
    for (int p = 0; p < 4; ++p) {
      for (int l = 0; l < 32; ++l) {
        const int lo = L[64 * p + l], hi = L[64 * p + 32 + l];
        y[b].qs[32 * p + l] = static_cast<uint8_t>((lo & 0x0f) | ((hi & 0x0f) << 4));
        y[b].qh[l] = static_cast<uint8_t>(y[b].qh[l] | ((lo >> 4) << (2 * p)) | ((hi >> 4) << (2 * p + 1)));
      }
    }
  }
}

void quantize_q6_k(const float* x, BlockQ6_K* y, int64_t nb) {
  uint8_t L[kQK_K];
  for (int64_t b = 0; b < nb; ++b, x += kQK_K) {
    float scales[16], w[16];
    float max_scale = 0.0f;
    for (int j = 0; j < 16; ++j) {
      for (int i = 0; i < 16; ++i) w[i] = x[16 * j + i] * x[16 * j + i];
      scales[j] = fit_symmetric(x + 16 * j, w, 16, 32);
      if (std::fabs(scales[j]) > std::fabs(max_scale)) max_scale = scales[j];
    }
    std::memset(&y[b], 0, sizeof(BlockQ6_K));
    if (std::fabs(max_scale) < kZeroGroupEps) {
      // All-zero block: every level must decode to 0, i.e. q = 32 with any scale.
      std::fill(L, L + kQK_K, uint8_t{32});
    } else {
      const float iscale = -128.0f / max_scale;
      y[b].d = half::fp32_to_fp16(1.0f / iscale);
      for (int j = 0; j < 16; ++j) y[b].scales[j] = static_cast<int8_t>(clampi(nearest_int(iscale * scales[j]), -128, 127));
      const float d = half::fp16_to_fp32(y[b].d);
      for (int j = 0; j < 16; ++j) {
        const float ds = d * static_cast<float>(y[b].scales[j]);
        for (int i = 16 * j; i < 16 * j + 16; ++i) {
          L[i] = ds == 0.0f ? 32 : static_cast<uint8_t>(clampi(nearest_int(x[i] / ds), -32, 31) + 32);
        }
      }
    }
    for (int e = 0; e < kQK_K; ++e) {
      const int h = e / 128, s = (e / 32) % 4, l = e % 32;
      uint8_t& lo_byte = y[b].ql[64 * h + 32 * (s % 2) + l];
      lo_byte = static_cast<uint8_t>(lo_byte | ((L[e] & 0x0f) << (s < 2 ? 0 : 4)));
      y[b].qh[32 * h + l] = static_cast<uint8_t>(y[b].qh[32 * h + l] | ((L[e] >> 4) << (2 * s)));
    }
  }
}

void quantize_q8_k(const float* x, BlockQ8_K* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kQK_K) {
    float amax = 0.0f, max = 0.0f;
    for (int i = 0; i < kQK_K; ++i) {
      if (std::fabs(x[i]) > amax) {
        amax = std::fabs(x[i]);
        max = x[i];
      }
    }
    if (amax == 0.0f) {
      std::memset(&y[b], 0, sizeof(BlockQ8_K));
      continue;
    }
    // ggml maps the extreme to -127 (not -128) so every quant has a positive twin.
    const float iscale = -127.0f / max;
    if (!std::isfinite(iscale)) {  // |max| below ~4e-37 (ggml leaves this undefined): zero block
      std::memset(&y[b], 0, sizeof(BlockQ8_K));
      continue;
    }
    for (int i = 0; i < kQK_K; ++i) y[b].qs[i] = static_cast<int8_t>(std::min(127, nearest_int(iscale * x[i])));
    for (int g = 0; g < kQK_K / 16; ++g) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += y[b].qs[16 * g + i];
      y[b].bsums[g] = static_cast<int16_t>(sum);
    }
    y[b].d = 1.0f / iscale;
  }
}

}  // namespace moraine::formats
