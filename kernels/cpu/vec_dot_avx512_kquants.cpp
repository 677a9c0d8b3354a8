// AVX-512 VNNI dots of Q2_K..Q6_K rows with Q8_K activations. Quants are unpacked to unsigned
// bytes (Q3_K and Q6_K biased by 4 and 32, removed again through the activations' bsums), the
// per-16 or per-32 sums come from vpdpbusd, sub-block scales multiply dword lanes, and each
// super-block's integer sums are reduced exactly. The float part then runs per block in the
// same order as the scalar reference (compiled with -ffp-contract=off on both sides), so the
// results are bit-identical to vec_dot_reference.
#include <immintrin.h>

#include <cstring>

#include "common/formats/block_layouts.h"
#include "kernels/cpu/avx512_kernels.h"
#include "kernels/cpu/kquant_avx512_unpack.h"

namespace moraine::cpu::avx512 {
namespace {

inline float fp16(uint16_t h) { return _cvtsh_ss(h); }

inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }
inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m512i join256(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
inline __m512i dpbusd(__m512i u8, __m512i s8) { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u8, s8); }

// Per-dword scales for 16-element sub-blocks first..first+3 (4 dwords each) from 16 int8 scales.
inline __m512i scales_x4(__m128i scales16, int first) {
  const __m128i idx = _mm_add_epi8(_mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm_set1_epi8(static_cast<char>(first)));
  return _mm512_cvtepi8_epi32(_mm_shuffle_epi8(scales16, idx));
}

// Per-dword scales for two 32-element sub-blocks (8 dwords each).
inline __m512i scales_x8(int lo, int hi) { return _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(lo), _mm512_set1_epi32(hi)); }

// Sum of scale[j] * bsums[j] over the 16 groups (exact, int16 x int16 -> int32 pairs).
inline int scaled_bsums(__m128i scales16_i8, const int16_t* bsums) {
  const __m256i s = _mm256_cvtepi8_epi16(scales16_i8);
  const __m256i prod = _mm256_madd_epi16(s, load256(bsums));
  return _mm512_reduce_add_epi32(_mm512_zextsi256_si512(prod));
}

// Q4_K/Q5_K: the 8 scales and 8 mins, unpacked with 32-bit word arithmetic. Words u0, u1, u2 of
// the 12 bytes hold: scales 0..3 (low 6 bits of u0), mins 0..3 (low 6 bits of u1), low nibbles
// of scales 4..7 and mins 4..7 (u2), and their top 2 bits in bits 6..7 of u0 / u1.
// Returned as 8 bytes each in a uint64 (byte j = sub-block j), kept in registers.
inline void q45k_scales_mins(const uint8_t* packed, uint64_t& sc, uint64_t& mn) {
  uint32_t u[3];
  std::memcpy(u, packed, kScaleBytesK);
  const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, low2 = 0x03030303u;
  sc = (u[0] & low6) | static_cast<uint64_t>((u[2] & low4) | (((u[0] >> 6) & low2) << 4)) << 32;
  mn = (u[1] & low6) | static_cast<uint64_t>(((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4)) << 32;
}

}  // namespace

float dot_q2_k(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockQ2_K*>(vw);
  const auto* a = static_cast<const BlockQ8_K*>(va);
  float acc = 0.0f;
  for (int64_t b = 0; b < n / kQK_K; ++b) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[b].scales));
    const __m128i sc = _mm_and_si128(packed, _mm_set1_epi8(0x0f));
    const __m128i mn = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0f));
    __m512i isum = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const __m512i bytes = _mm512_broadcast_i64x4(load256(w[b].qs + 32 * h));
      const __m512i q_lo = two_bits(bytes, 0, 2), q_hi = two_bits(bytes, 4, 6);  // elements 128h + 0..63, 64..127
      const __m512i d_lo = dpbusd(q_lo, load512(a[b].qs + 128 * h));
      const __m512i d_hi = dpbusd(q_hi, load512(a[b].qs + 128 * h + 64));
      isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(d_lo, scales_x4(sc, 8 * h)));
      isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(d_hi, scales_x4(sc, 8 * h + 4)));
    }
    const int total = _mm512_reduce_add_epi32(isum);
    const int msum = scaled_bsums(mn, a[b].bsums);
    const float d = fp16(w[b].d) * a[b].d;
    const float dmin = fp16(w[b].dmin) * a[b].d;
    acc += d * static_cast<float>(total) - dmin * static_cast<float>(msum);
  }
  return acc;
}

float dot_q3_k(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockQ3_K*>(vw);
  const auto* a = static_cast<const BlockQ8_K*>(va);
  float acc = 0.0f;
  const __m512i four = _mm512_set1_epi8(4);
  for (int64_t b = 0; b < n / kQK_K; ++b) {
    const __m128i sc = q3k_scales(w[b].scales);
    const __m512i hmask = _mm512_broadcast_i64x4(load256(w[b].hmask));
    __m512i isum = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const __m512i bytes = _mm512_broadcast_i64x4(load256(w[b].qs + 32 * h));
      // u = low 2 bits + 4 * high bit, in 0..7; the value is u - 4.
      __m512i u_lo = two_bits(bytes, 0, 2), u_hi = two_bits(bytes, 4, 6);
      u_lo = _mm512_mask_add_epi8(u_lo, bit_set(hmask, 4 * h + 0, 4 * h + 1), u_lo, four);
      u_hi = _mm512_mask_add_epi8(u_hi, bit_set(hmask, 4 * h + 2, 4 * h + 3), u_hi, four);
      const __m512i d_lo = dpbusd(u_lo, load512(a[b].qs + 128 * h));
      const __m512i d_hi = dpbusd(u_hi, load512(a[b].qs + 128 * h + 64));
      isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(d_lo, scales_x4(sc, 8 * h)));
      isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(d_hi, scales_x4(sc, 8 * h + 4)));
    }
    const int total = _mm512_reduce_add_epi32(isum) - 4 * scaled_bsums(sc, a[b].bsums);
    const float d = fp16(w[b].d) * a[b].d;
    acc += d * static_cast<float>(total);
  }
  return acc;
}

// Q4_K and Q5_K share everything but the fifth bit.
template <typename Block, bool kHighBit>
static float dot_q45_k(int64_t n, const Block* w, const BlockQ8_K* a) {
  float acc = 0.0f;
  const __m512i low4 = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
  for (int64_t b = 0; b < n / kQK_K; ++b) {
    uint64_t sc64, mn64;
    q45k_scales_mins(w[b].scales, sc64, mn64);
    auto sc = [sc64](int j) { return static_cast<int>((sc64 >> (8 * j)) & 0xff); };
    __m512i qh = _mm512_setzero_si512();
    if constexpr (kHighBit) qh = _mm512_broadcast_i64x4(load256(w[b].qh));
    const int8_t* q8 = a[b].qs;
    __m512i isum = _mm512_setzero_si512();
    for (int half = 0; half < 2; ++half) {
      // 64 bytes of quants = pairs p = 2*half and 2*half+1; low nibbles are sub-blocks 2p,
      // high nibbles 2p+1 (32 elements each).
      const __m512i bytes = load512(w[b].qs + 64 * half);
      __m512i q_lo = _mm512_and_si512(bytes, low4);
      __m512i q_hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
      const int p0 = 2 * half, p1 = 2 * half + 1;
      if constexpr (kHighBit) {
        q_lo = _mm512_mask_add_epi8(q_lo, bit_set(qh, 2 * p0, 2 * p1), q_lo, sixteen);
        q_hi = _mm512_mask_add_epi8(q_hi, bit_set(qh, 2 * p0 + 1, 2 * p1 + 1), q_hi, sixteen);
      }
      const __m512i a_lo = join256(load256(q8 + 64 * p0), load256(q8 + 64 * p1));
      const __m512i a_hi = join256(load256(q8 + 64 * p0 + 32), load256(q8 + 64 * p1 + 32));
      isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(dpbusd(q_lo, a_lo), scales_x8(sc(2 * p0), sc(2 * p1))));
      isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(dpbusd(q_hi, a_hi), scales_x8(sc(2 * p0 + 1), sc(2 * p1 + 1))));
    }
    const int total = _mm512_reduce_add_epi32(isum);
    // Each min covers two 16-element bsums: duplicate the mins and reuse the 16-lane helper.
    const __m128i mins8 = _mm_cvtsi64_si128(static_cast<long long>(mn64));
    const __m128i mins16 = _mm_unpacklo_epi8(mins8, mins8);
    const int msum = scaled_bsums(mins16, a[b].bsums);
    const float d = fp16(w[b].d) * a[b].d;
    const float dmin = fp16(w[b].dmin) * a[b].d;
    acc += d * static_cast<float>(total) - dmin * static_cast<float>(msum);
  }
  return acc;
}

float dot_q4_k(int64_t n, const void* w, const void* a) {
  return dot_q45_k<BlockQ4_K, false>(n, static_cast<const BlockQ4_K*>(w), static_cast<const BlockQ8_K*>(a));
}

float dot_q5_k(int64_t n, const void* w, const void* a) {
  return dot_q45_k<BlockQ5_K, true>(n, static_cast<const BlockQ5_K*>(w), static_cast<const BlockQ8_K*>(a));
}

float dot_q6_k(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockQ6_K*>(vw);
  const auto* a = static_cast<const BlockQ8_K*>(va);
  float acc = 0.0f;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < n / kQK_K; ++b) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[b].scales));
    __m512i isum = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = load512(w[b].ql + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(load256(w[b].qh + 32 * h));
      // Unsigned 6-bit quants: elements 128h + 0..63 and 128h + 64..127.
      const __m512i q_lo = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16(two_bits(qh, 0, 2), 4));
      const __m512i q_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), _mm512_slli_epi16(two_bits(qh, 4, 6), 4));
      const __m512i d_lo = dpbusd(q_lo, load512(a[b].qs + 128 * h));
      const __m512i d_hi = dpbusd(q_hi, load512(a[b].qs + 128 * h + 64));
      isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(d_lo, scales_x4(sc, 8 * h)));
      isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(d_hi, scales_x4(sc, 8 * h + 4)));
    }
    const int total = _mm512_reduce_add_epi32(isum) - 32 * scaled_bsums(sc, a[b].bsums);
    const float d = fp16(w[b].d) * a[b].d;
    acc += d * static_cast<float>(total);
  }
  return acc;
}

}  // namespace moraine::cpu::avx512
