// AVX-512 helpers shared by the k-quant dot kernels and the register tiles (internal; include
// only from files compiled with the AVX-512 flags).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace moraine::cpu::avx512 {

// The sixteen Q3_K scales (minus their bias of 32) as int8 lanes: low nibbles from bytes 0..7
// (scales 0..7) and their high nibbles (scales 8..15); the top two bits of scale j sit in
// byte 8 + j%4 at bit 2*(j/4), i.e. one shift amount per group of four lanes = per dword.
inline __m128i q3k_scales(const uint8_t* packed) {
  // 8 + 4 byte loads straight into the register: a stack copy read back as 16 bytes stalls
  // store forwarding (measured: q3_k 5.6 -> 17 GB/s).
  uint32_t tail;
  std::memcpy(&tail, packed + 8, 4);
  const __m128i bytes = _mm_insert_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed)), static_cast<int>(tail), 2);
  const __m128i nib = _mm_set1_epi8(0x0f);
  const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(bytes, nib), _mm_and_si128(_mm_srli_epi16(bytes, 4), nib));
  const __m128i top_src = _mm_shuffle_epi8(bytes, _mm_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11));
  const __m128i top = _mm_and_si128(_mm_srlv_epi32(top_src, _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
  return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(top, 4)), _mm_set1_epi8(32));
}

// 2-bit fields of 32 bytes at shifts (s_lo for the lower 32 lanes, s_hi for the upper).
inline __m512i two_bits(__m512i bytes, int s_lo, int s_hi) {
  const __m512i shifts = _mm512_mask_blend_epi16(0xffff0000u, _mm512_set1_epi16(static_cast<short>(s_lo)), _mm512_set1_epi16(static_cast<short>(s_hi)));
  return _mm512_and_si512(_mm512_srlv_epi16(bytes, shifts), _mm512_set1_epi8(3));
}

// Mask of bytes whose bit b_lo (lower 32 lanes) or b_hi (upper 32 lanes) is set.
inline __mmask64 bit_set(__m512i bytes, int b_lo, int b_hi) {
  const __m512i sel = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << b_lo)), _mm256_set1_epi8(static_cast<char>(1 << b_hi)), 1);
  return _mm512_test_epi8_mask(bytes, sel);
}

// Per 128-bit lane: dword k = the sum of v_k's four dwords in that lane (integer adds: exact).
inline __m512i lane_sums4(__m512i v0, __m512i v1, __m512i v2, __m512i v3) {
  const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(v0, v1), _mm512_unpackhi_epi32(v0, v1));
  const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(v2, v3), _mm512_unpackhi_epi32(v2, v3));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
}

// Lanes 0..3 = the sums of all sixteen dwords of v0..v3.
inline __m128i reduce4(__m512i v0, __m512i v1, __m512i v2, __m512i v3) {
  __m512i s = lane_sums4(v0, v1, v2, v3);
  s = _mm512_add_epi32(s, _mm512_shuffle_i32x4(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm512_add_epi32(s, _mm512_shuffle_i32x4(s, s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castsi512_si128(s);
}

// Q4_K / Q5_K block headers of four rows, one row per 128-bit lane: each block's first 16 bytes
// (dword 0 = fp16 d and dmin, dwords 1..3 = u0 u1 u2, the 12 packed scale bytes) decoded to the
// 6-bit scales and mins as words: row r's scales 0..7 in words 8r.. of `scales`, its mins in
// words 8r.. of `mins`. Per lane: scales 0..3 = u0 & 0x3f.., scales 4..7 = (u2 & 0x0f..) |
// ((u0 >> 6) & 3..) << 4, and the mins alike from u1 and u2 >> 4 (dwords [sc lo, sc hi, min lo,
// min hi] before widening). Shared by the block-pair tile and the GFNI tile.
struct KQuantHeaders {
  __m512i head, scales, mins;
};
inline KQuantHeaders k_quant_headers4(const void* b0, const void* b1, const void* b2, const void* b3) {
  const __m512i dec_shift = _mm512_setr4_epi32(0, 0, 0, 4);
  const __m512i dec_low = _mm512_setr4_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f);
  const __m512i dec_high = _mm512_setr4_epi32(0, 0x03030303, 0, 0x03030303);
  __m512i head = _mm512_zextsi128_si512(_mm_loadu_si128(static_cast<const __m128i*>(b0)));
  head = _mm512_inserti32x4(head, _mm_loadu_si128(static_cast<const __m128i*>(b1)), 1);
  head = _mm512_inserti32x4(head, _mm_loadu_si128(static_cast<const __m128i*>(b2)), 2);
  head = _mm512_inserti32x4(head, _mm_loadu_si128(static_cast<const __m128i*>(b3)), 3);
  const __m512i u0_u2_u1_u2 = _mm512_shuffle_epi32(head, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(3, 2, 3, 1)));
  const __m512i u0_u0_u1_u1 = _mm512_shuffle_epi32(head, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(2, 2, 1, 1)));
  const __m512i decoded =
      _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi32(u0_u2_u1_u2, dec_shift), dec_low),
                      _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0_u0_u1_u1, 6), dec_high), 4));
  return {head, _mm512_unpacklo_epi8(decoded, _mm512_setzero_si512()), _mm512_unpackhi_epi8(decoded, _mm512_setzero_si512())};
}

// The register tiles' outputs: lane l of acc[g] holds (row, token) pair 4g + l, pairs ordered
// token-fastest over T tokens; y[token * y_stride + row].
template <int T, int kGroups>
inline void store_tile_pairs(const __m128 (&acc)[kGroups], float* y, int64_t y_stride) {
  for (int g = 0; g < kGroups; ++g) {
    alignas(16) float out[4];
    _mm_store_ps(out, acc[g]);
    for (int l = 0; l < 4; ++l) {
      const int pi = 4 * g + l;
      y[(pi % T) * y_stride + pi / T] = out[l];
    }
  }
}

}  // namespace moraine::cpu::avx512
