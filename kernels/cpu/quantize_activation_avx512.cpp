// AVX-512 activation quantizers, bit-identical to the scalar reference (same float ops in the
// same order; the reductions are max and integer sums, which are exact in any order).
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "common/formats/block_layouts.h"
#include "common/formats/half_float.h"
#include "kernels/cpu/avx512_kernels.h"

namespace moraine::cpu::avx512 {
namespace {

inline __m512 abs_ps(__m512 v) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff))); }

// roundf(): nearest, halfway cases away from zero. trunc(v) and v - trunc(v) are exact.
inline __m512i round_half_away(__m512 v) {
  const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __mmask16 bump = _mm512_cmp_ps_mask(abs_ps(_mm512_sub_ps(v, t)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
  const __m512 one = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(_mm512_set1_ps(1.0f)),
                                                         _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0x80000000u)))));
  return _mm512_cvttps_epi32(_mm512_mask_add_ps(t, bump, t, one));
}

}  // namespace

void quantize_q8_0(const float* x, void* dst, int64_t n) {
  auto* y = static_cast<BlockQ8_0*>(dst);
  for (int64_t b = 0; b < n / kQK; ++b, x += kQK) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(abs_ps(v0), abs_ps(v1)));
    const float d = amax / 127.0f;
    const float inv = 1.0f / d;
    const float id = d != 0.0f && std::isfinite(inv) ? inv : 0.0f;  // as the scalar reference
    y[b].d = half::fp32_to_fp16(d);
    const __m512 vid = _mm512_set1_ps(id);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y[b].qs), _mm512_cvtepi32_epi8(round_half_away(_mm512_mul_ps(v0, vid))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y[b].qs + 16), _mm512_cvtepi32_epi8(round_half_away(_mm512_mul_ps(v1, vid))));
  }
}

// llama.cpp's x86 rule (quantize_activation_llama_x86.cpp): scale 127/amax, round half to even
// (cvtps_epi32 in the default rounding mode), saturate to int8 as its two packs do.
void quantize_q8_0_llama_x86(const float* x, void* dst, int64_t n) {
  auto* y = static_cast<BlockQ8_0*>(dst);
  for (int64_t b = 0; b < n / kQK; ++b, x += kQK) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(abs_ps(v0), abs_ps(v1)));
    y[b].d = half::fp32_to_fp16(amax / 127.0f);
    const __m512 vid = _mm512_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
    const __m128i q0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)));
    const __m128i q1 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vid)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y[b].qs), q0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y[b].qs + 16), q1);
  }
}

void quantize_q8_k(const float* x, void* dst, int64_t n) {
  auto* y = static_cast<BlockQ8_K*>(dst);
  for (int64_t b = 0; b < n / kQK_K; ++b, x += kQK_K) {
    __m512 vmax = _mm512_setzero_ps();
    for (int i = 0; i < kQK_K; i += 16) vmax = _mm512_max_ps(vmax, abs_ps(_mm512_loadu_ps(x + i)));
    const float amax = _mm512_reduce_max_ps(vmax);
    if (amax == 0.0f) {
      std::memset(&y[b], 0, sizeof(BlockQ8_K));
      continue;
    }
    // The scalar reference keeps the sign of the first element reaching amax.
    float max = 0.0f;
    for (int i = 0; i < kQK_K; i += 16) {
      const __mmask16 hit = _mm512_cmp_ps_mask(abs_ps(_mm512_loadu_ps(x + i)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
      if (hit) {
        max = x[i + __builtin_ctz(hit)];
        break;
      }
    }
    const float iscale = -127.0f / max;
    if (!std::isfinite(iscale)) {  // |max| below ~4e-37: as the scalar reference, a zero block
      std::memset(&y[b], 0, sizeof(BlockQ8_K));
      continue;
    }
    const __m512 vscale = _mm512_set1_ps(iscale);
    for (int g = 0; g < kQK_K / 16; ++g) {
      const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * g), vscale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i q = _mm512_min_epi32(_mm512_cvtps_epi32(r), _mm512_set1_epi32(127));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y[b].qs + 16 * g), _mm512_cvtepi32_epi8(q));
      y[b].bsums[g] = static_cast<int16_t>(_mm512_reduce_add_epi32(q));
    }
    y[b].d = 1.0f / iscale;
  }
}

}  // namespace moraine::cpu::avx512
