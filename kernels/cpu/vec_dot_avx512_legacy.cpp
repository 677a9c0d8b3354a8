// AVX-512 VNNI dots of Q4_0, Q8_0 and MXFP4 rows with Q8_0 activations, two 32-element blocks
// per 512-bit register. vpdpbusd multiplies unsigned by signed bytes, so each weight is made
// unsigned by a bias (q4_0: the stored nibble, bias 8; q8_0: q ^ 0x80, bias 128; mxfp4: doubled
// E2M1 + 12, bias 12) and bias * sum(a) is subtracted with a second vpdpbusd: integer sums stay
// exact. Block scales are applied in float lanes and accumulated per lane, so the result
// differs from the scalar reference (one float add per block, in order) only by float
// summation order; the tests bound that by (blocks + 16) * 2^-24 * sum|block terms|.
#include <immintrin.h>

#include "common/formats/block_layouts.h"
#include "common/formats/half_float.h"
#include "kernels/cpu/avx512_kernels.h"

namespace moraine::cpu::avx512 {
namespace {

inline float fp16(uint16_t h) { return _cvtsh_ss(h); }

// Activations of blocks b and b+1 side by side (the second one zero when absent).
inline __m512i load_act_pair(const BlockQ8_0* a, bool second) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[0].qs));
  const __m256i hi = second ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[1].qs)) : _mm256_setzero_si256();
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// Unpack 16 packed nibble bytes of two blocks into [lo nibbles, hi nibbles] per block (the
// element order of the 32-element blocks).
inline __m512i unpack_nibble_pair(const uint8_t* q0, const uint8_t* q1) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q0));
  const __m128i b = q1 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(q1)) : _mm_setzero_si128();
  const __m256i lo = _mm256_set_m128i(_mm_srli_epi16(a, 4), a);
  const __m256i hi = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
  return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), _mm512_set1_epi8(0x0f));
}

inline __m512 scale_pair(float s0, float s1) {
  return _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(s0), _mm512_set1_ps(s1));
}

// Shared loop: `pair(b, second)` returns the exact per-lane integer sums of blocks b, b+1 and
// `scale(b)` the float scale of block b.
template <typename Pair, typename Scale>
float dot_blocks(int64_t nb, Pair pair, Scale scale) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair(b, true)), scale_pair(scale(b), scale(b + 1)), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair(b + 2, true)), scale_pair(scale(b + 2), scale(b + 3)), acc1);
  }
  for (; b < nb; b += 2) {
    const bool second = b + 1 < nb;
    acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair(b, second)), scale_pair(scale(b), second ? scale(b + 1) : 0.0f), acc0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

}  // namespace

float dot_q4_0(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockQ4_0*>(vw);
  const auto* a = static_cast<const BlockQ8_0*>(va);
  const __m512i bias = _mm512_set1_epi8(8);
  auto pair = [&](int64_t b, bool second) {
    const __m512i q = unpack_nibble_pair(w[b].qs, second ? w[b + 1].qs : nullptr);
    const __m512i y = load_act_pair(a + b, second);
    return _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q, y),
                            _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, y));
  };
  auto scale = [&](int64_t b) { return fp16(w[b].d) * fp16(a[b].d); };
  return dot_blocks(n / kQK, pair, scale);
}

float dot_q8_0(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockQ8_0*>(vw);
  const auto* a = static_cast<const BlockQ8_0*>(va);
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  auto pair = [&](int64_t b, bool second) {
    const __m512i q = _mm512_xor_si512(load_act_pair(w + b, second), bias);  // q + 128 as unsigned
    const __m512i y = load_act_pair(a + b, second);
    return _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q, y),
                            _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, y));
  };
  auto scale = [&](int64_t b) { return fp16(w[b].d) * fp16(a[b].d); };
  return dot_blocks(n / kQK, pair, scale);
}

float dot_mxfp4(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockMXFP4*>(vw);
  const auto* a = static_cast<const BlockQ8_0*>(va);
  // Doubled E2M1 value + 12 for each code, so the lookup yields unsigned bytes 0..24.
  alignas(16) static constexpr uint8_t kBiased[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kBiased)));
  const __m512i bias = _mm512_set1_epi8(12);
  auto pair = [&](int64_t b, bool second) {
    const __m512i q = _mm512_shuffle_epi8(lut, unpack_nibble_pair(w[b].qs, second ? w[b + 1].qs : nullptr));
    const __m512i y = load_act_pair(a + b, second);
    return _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q, y),
                            _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, y));
  };
  auto scale = [&](int64_t b) { return half::e8m0_to_fp32_half(w[b].e) * fp16(a[b].d); };
  return dot_blocks(n / kQK, pair, scale);
}

}  // namespace moraine::cpu::avx512
