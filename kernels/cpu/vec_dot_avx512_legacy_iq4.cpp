// AVX-512 VNNI dots of Q4_1, Q5_0, Q5_1, IQ4_NL (32-element blocks) and IQ4_XS (32-element
// sub-blocks of 256), bitwise equal to the scalar reference: vpdpbusd forms each block's exact
// integer sum (two blocks per register; unsigned weights, signed activations; Q5_0 and IQ4_NL
// take back a bias * sum(a) with a second vpdpbusd), eight sums are reduced to one vector and
// the float terms are then added one by one in block order with the reference's own expression
// (ggml's generic one), so there is no summation-order difference to bound.
#include <immintrin.h>

#include <cstring>

#include "common/formats/block_layouts.h"
#include "kernels/cpu/avx512_kernels.h"

namespace moraine::cpu::avx512 {
namespace {

inline float fp16(uint16_t h) { return _cvtsh_ss(h); }

// 32 activation bytes of two blocks side by side (the second zero when absent).
inline __m512i load_pair(const int8_t* q0, const int8_t* q1) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0));
  const __m256i hi = q1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q1)) : _mm256_setzero_si256();
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// 16 nibble bytes of two blocks as [low nibbles, high nibbles] per block (element order).
inline __m512i nibble_pair(const uint8_t* q0, const uint8_t* q1) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q0));
  const __m128i b = q1 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(q1)) : _mm_setzero_si128();
  const __m256i lo = _mm256_set_m128i(_mm_srli_epi16(a, 4), a);
  const __m256i hi = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
  return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), _mm512_set1_epi8(0x0f));
}

// Adds 0x10 to the bytes whose bit is set in qh (block 0: bytes 0..31, block 1: 32..63).
inline __m512i add_fifth_bit(__m512i q, const uint8_t* qh0, const uint8_t* qh1) {
  uint32_t h0, h1 = 0;
  std::memcpy(&h0, qh0, 4);
  if (qh1) std::memcpy(&h1, qh1, 4);
  const __mmask64 m = static_cast<__mmask64>(h0) | (static_cast<__mmask64>(h1) << 32);
  return _mm512_or_si512(q, _mm512_maskz_mov_epi8(m, _mm512_set1_epi8(0x10)));
}

// v[k] holds blocks 2k (lanes 0..7) and 2k+1 (lanes 8..15); out[i] = the sum of block i's lanes.
inline void reduce8(const __m512i v[4], int32_t out[8]) {
  const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
  const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
  // Per 128-bit lane: [v0, v1, v2, v3] sums of that lane's four ints.
  const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
  // Lanes 0+1 are blocks 0, 2, 4, 6; lanes 2+3 blocks 1, 3, 5, 7.
  const __m512i w = _mm512_add_epi32(u, _mm512_shuffle_i32x4(u, u, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, w)));
}

// pair(b, second): exact per-lane integer sums of blocks b, b+1 (b+1 only if second);
// term(acc, b, isum): acc plus block b's float term, as the reference writes it.
template <typename Pair, typename Term>
float dot_exact(int64_t nb, Pair pair, Term term) {
  float acc = 0.0f;
  int32_t sums[8];
  __m512i v[4];
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    for (int k = 0; k < 4; ++k) v[k] = pair(b + 2 * k, true);
    reduce8(v, sums);
    for (int i = 0; i < 8; ++i) acc = term(acc, b + i, sums[i]);
  }
  if (b < nb) {
    for (int k = 0; k < 4; ++k) {
      const int64_t first = b + 2 * k;
      v[k] = first < nb ? pair(first, first + 1 < nb) : _mm512_setzero_si512();
    }
    reduce8(v, sums);
    for (int64_t i = 0; b + i < nb; ++i) acc = term(acc, b + i, sums[i]);
  }
  return acc;
}

inline __m512i dpbusd(__m512i u, __m512i s) { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s); }

// IQ4 grid + 128 (unsigned bytes 1..241), the bias taken back after the dot.
inline __m512i iq4_biased_lut() {
  alignas(16) static constexpr uint8_t kBiased[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kBiased)));
}

}  // namespace

float dot_q4_1(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockQ4_1*>(vw);
  const auto* a = static_cast<const BlockQ8_1*>(va);
  auto pair = [&](int64_t b, bool second) {
    return dpbusd(nibble_pair(w[b].qs, second ? w[b + 1].qs : nullptr), load_pair(a[b].qs, second ? a[b + 1].qs : nullptr));
  };
  auto term = [&](float acc, int64_t b, int32_t s) {
    return acc + ((fp16(w[b].d) * fp16(a[b].d)) * static_cast<float>(s) + fp16(w[b].m) * fp16(a[b].s));
  };
  return dot_exact(n / kQK, pair, term);
}

float dot_q5_1(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockQ5_1*>(vw);
  const auto* a = static_cast<const BlockQ8_1*>(va);
  auto pair = [&](int64_t b, bool second) {
    const __m512i q = add_fifth_bit(nibble_pair(w[b].qs, second ? w[b + 1].qs : nullptr), w[b].qh, second ? w[b + 1].qh : nullptr);
    return dpbusd(q, load_pair(a[b].qs, second ? a[b + 1].qs : nullptr));
  };
  auto term = [&](float acc, int64_t b, int32_t s) {
    return acc + ((fp16(w[b].d) * fp16(a[b].d)) * static_cast<float>(s) + fp16(w[b].m) * fp16(a[b].s));
  };
  return dot_exact(n / kQK, pair, term);
}

float dot_q5_0(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockQ5_0*>(vw);
  const auto* a = static_cast<const BlockQ8_0*>(va);
  const __m512i bias = _mm512_set1_epi8(16);
  auto pair = [&](int64_t b, bool second) {
    const __m512i q = add_fifth_bit(nibble_pair(w[b].qs, second ? w[b + 1].qs : nullptr), w[b].qh, second ? w[b + 1].qh : nullptr);
    const __m512i y = load_pair(a[b].qs, second ? a[b + 1].qs : nullptr);
    return _mm512_sub_epi32(dpbusd(q, y), dpbusd(bias, y));
  };
  auto term = [&](float acc, int64_t b, int32_t s) { return acc + (fp16(w[b].d) * fp16(a[b].d)) * static_cast<float>(s); };
  return dot_exact(n / kQK, pair, term);
}

float dot_iq4_nl(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockIQ4_NL*>(vw);
  const auto* a = static_cast<const BlockQ8_0*>(va);
  const __m512i lut = iq4_biased_lut(), bias = _mm512_set1_epi8(static_cast<char>(0x80));
  auto pair = [&](int64_t b, bool second) {
    const __m512i q = _mm512_shuffle_epi8(lut, nibble_pair(w[b].qs, second ? w[b + 1].qs : nullptr));
    const __m512i y = load_pair(a[b].qs, second ? a[b + 1].qs : nullptr);
    return _mm512_sub_epi32(dpbusd(q, y), dpbusd(bias, y));
  };
  auto term = [&](float acc, int64_t b, int32_t s) { return acc + (fp16(a[b].d) * fp16(w[b].d)) * static_cast<float>(s); };
  return dot_exact(n / kQK, pair, term);
}

float dot_iq4_xs(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockIQ4_XS*>(vw);
  const auto* a = static_cast<const BlockQ8_K*>(va);
  const __m512i lut = iq4_biased_lut(), bias = _mm512_set1_epi8(static_cast<char>(0x80));
  float acc = 0.0f;
  int32_t sums[8];
  __m512i v[4];
  for (int64_t b = 0; b < n / kQK_K; ++b) {
    for (int k = 0; k < 4; ++k) {
      const __m512i q = _mm512_shuffle_epi8(lut, nibble_pair(w[b].qs + 32 * k, w[b].qs + 32 * k + 16));
      const __m512i y = _mm512_loadu_si512(a[b].qs + 64 * k);
      v[k] = _mm512_sub_epi32(dpbusd(q, y), dpbusd(bias, y));
    }
    reduce8(v, sums);
    const float d4d8 = fp16(w[b].d) * a[b].d;
    for (int ib = 0; ib < 8; ++ib) {
      const int ls = ((w[b].scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0f) | (((w[b].scales_h >> (2 * ib)) & 3) << 4);
      acc += (d4d8 * static_cast<float>(ls - 32)) * static_cast<float>(sums[ib]);
    }
  }
  return acc;
}

}  // namespace moraine::cpu::avx512
