// AVX2 dots for the formats the issue asks a non-AVX-512 fallback for (Q4_K, Q8_0, MXFP4).
// Without vpdpbusd, unsigned x signed byte products go through vpmaddubsw (pairs summed into
// saturating int16) and vpmaddwd. No pair can saturate here: Q4_K nibbles are <= 15 and MXFP4
// lookups (doubled E2M1 + 12) <= 24, so |pair| <= 2 * 24 * 128; Q8_0 uses |w| * sign(a, w) with
// |w| <= 128 and activations in -127..127 (what quantize_activation_row writes), so
// |pair| <= 2 * 128 * 127 < 32767. Integer sums are therefore exact. Q4_K then runs the
// reference's float expression per super-block (bitwise equal); Q8_0/MXFP4 accumulate per lane
// like the AVX-512 legacy kernels (same error bound as those).
#include <immintrin.h>

#include <cstring>

#include "common/formats/block_layouts.h"
#include "common/formats/half_float.h"
#include "kernels/cpu/avx2_kernels.h"

namespace moraine::cpu::avx2 {
namespace {

inline float fp16(uint16_t h) { return _cvtsh_ss(h); }
inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Eight int32 lanes of sum(u8 * s8) over groups of four bytes.
inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }

inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 nibbles of a 16-byte block in element order (low nibbles, then high nibbles).
inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0f));
}

// Shared legacy-block loop: `block(b)` gives the exact int32 lane sums of block b.
template <typename Block, typename Scale>
float dot_blocks(int64_t nb, Block block, Scale scale) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block(b)), _mm256_set1_ps(scale(b)), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block(b + 1)), _mm256_set1_ps(scale(b + 1)), acc1);
  }
  if (b < nb) acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block(b)), _mm256_set1_ps(scale(b)), acc0);
  return hsum_ps(_mm256_add_ps(acc0, acc1));
}

}  // namespace

float dot_q8_0(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockQ8_0*>(vw);
  const auto* a = static_cast<const BlockQ8_0*>(va);
  auto block = [&](int64_t b) {
    const __m256i q = load256(w[b].qs), y = load256(a[b].qs);
    return dot_u8s8(_mm256_abs_epi8(q), _mm256_sign_epi8(y, q));
  };
  auto scale = [&](int64_t b) { return fp16(w[b].d) * fp16(a[b].d); };
  return dot_blocks(n / kQK, block, scale);
}

float dot_mxfp4(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockMXFP4*>(vw);
  const auto* a = static_cast<const BlockQ8_0*>(va);
  // Doubled E2M1 value + 12 per code: unsigned 0..24; the bias comes off through 12 * sum(a).
  alignas(16) static constexpr uint8_t kBiased[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kBiased)));
  const __m256i bias = _mm256_set1_epi8(12);
  auto block = [&](int64_t b) {
    const __m256i q = _mm256_shuffle_epi8(lut, unpack_nibbles(w[b].qs));
    const __m256i y = load256(a[b].qs);
    return _mm256_sub_epi32(dot_u8s8(q, y), dot_u8s8(bias, y));
  };
  auto scale = [&](int64_t b) { return half::e8m0_to_fp32_half(w[b].e) * fp16(a[b].d); };
  return dot_blocks(n / kQK, block, scale);
}

float dot_q4_k(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockQ4_K*>(vw);
  const auto* a = static_cast<const BlockQ8_K*>(va);
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  float acc = 0.0f;
  for (int64_t b = 0; b < n / kQK_K; ++b) {
    // 6-bit scales and mins of the 8 sub-blocks (layout in kquant_scales.h), as bytes.
    uint32_t u[3];
    std::memcpy(u, w[b].scales, kScaleBytesK);
    const uint32_t low6 = 0x3f3f3f3fu, nib = 0x0f0f0f0fu, low2 = 0x03030303u;
    const uint64_t sc = (u[0] & low6) | static_cast<uint64_t>((u[2] & nib) | (((u[0] >> 6) & low2) << 4)) << 32;
    const uint64_t mn = (u[1] & low6) | static_cast<uint64_t>(((u[2] >> 4) & nib) | (((u[1] >> 6) & low2) << 4)) << 32;
    __m256i isum = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      const __m256i bytes = load256(w[b].qs + 32 * p);
      const __m256i q_lo = _mm256_and_si256(bytes, low4);                          // sub-block 2p
      const __m256i q_hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);    // sub-block 2p+1
      const __m256i p_lo = _mm256_maddubs_epi16(q_lo, load256(a[b].qs + 64 * p));
      const __m256i p_hi = _mm256_maddubs_epi16(q_hi, load256(a[b].qs + 64 * p + 32));
      // int16 pair sums times the sub-block scale (<= 63), summed into int32 by vpmaddwd: exact.
      const auto s_lo = static_cast<short>((sc >> (16 * p)) & 0xff), s_hi = static_cast<short>((sc >> (16 * p + 8)) & 0xff);
      isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p_lo, _mm256_set1_epi16(s_lo)));
      isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p_hi, _mm256_set1_epi16(s_hi)));
    }
    int msum = 0;
    for (int j = 0; j < 8; ++j) msum += static_cast<int>((mn >> (8 * j)) & 0xff) * (a[b].bsums[2 * j] + a[b].bsums[2 * j + 1]);
    const float d = fp16(w[b].d) * a[b].d;
    const float dmin = fp16(w[b].dmin) * a[b].d;
    acc += d * static_cast<float>(hsum_epi32(isum)) - dmin * static_cast<float>(msum);
  }
  return acc;
}

}  // namespace moraine::cpu::avx2
