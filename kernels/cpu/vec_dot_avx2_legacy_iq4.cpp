// AVX2 dots of Q4_1, Q5_0, Q5_1, IQ4_NL and IQ4_XS, the fallback tier for x86 CPUs without
// AVX-512 VNNI, bitwise equal to the scalar reference like their AVX-512 versions
// (vec_dot_avx512_legacy_iq4.cpp): one 32-element block per register, exact integer sums by
// vpmaddubsw (unsigned x signed byte pairs; every pair sum stays below 2^15: |w| <= 127 after
// the sign trick for the IQ4 grid, <= 31 otherwise) and vpmaddwd, eight blocks reduced to one
// vector, then the float terms added in block order with the reference's expression.
#include <immintrin.h>

#include <cstring>

#include "common/formats/block_layouts.h"
#include "kernels/cpu/avx2_kernels.h"

namespace moraine::cpu::avx2 {
namespace {

inline float fp16(uint16_t h) { return _cvtsh_ss(h); }

inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 16 nibble bytes as [low nibbles, high nibbles]: the block's 32 quants in element order.
inline __m256i nibbles(const uint8_t* q) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(a, 4), a), _mm256_set1_epi8(0x0f));
}

// 0x10 in byte j where bit j of the little-endian qh is set.
inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(h)),
                                             _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                                              3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// Eight int32 lanes: sum of u[i] * s[i] over byte pairs and quads (exact while pair sums fit int16).
inline __m256i dot_us(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }

// Signed weights w (|w| <= 127) times signed activations a.
inline __m256i dot_ss(__m256i w, __m256i a) { return dot_us(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w)); }

// out[i] = the sum of v[i]'s eight lanes.
inline void reduce8(const __m256i v[8], int32_t out[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  const __m256i s = _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), s);
}

// block(b): block b's exact integer lanes; term(acc, b, isum): acc plus its float term.
template <typename Block, typename Term>
float dot_exact(int64_t nb, Block block, Term term) {
  float acc = 0.0f;
  int32_t sums[8];
  __m256i v[8];
  for (int64_t b = 0; b < nb; b += 8) {
    const int64_t n = nb - b < 8 ? nb - b : 8;
    for (int k = 0; k < 8; ++k) v[k] = k < n ? block(b + k) : _mm256_setzero_si256();
    reduce8(v, sums);
    for (int64_t i = 0; i < n; ++i) acc = term(acc, b + i, sums[i]);
  }
  return acc;
}

inline __m256i iq4_lut() {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4NLValues)));
}

}  // namespace

float dot_q4_1(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockQ4_1*>(vw);
  const auto* a = static_cast<const BlockQ8_1*>(va);
  auto block = [&](int64_t b) { return dot_us(nibbles(w[b].qs), load32(a[b].qs)); };
  auto term = [&](float acc, int64_t b, int32_t s) {
    return acc + ((fp16(w[b].d) * fp16(a[b].d)) * static_cast<float>(s) + fp16(w[b].m) * fp16(a[b].s));
  };
  return dot_exact(n / kQK, block, term);
}

float dot_q5_1(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockQ5_1*>(vw);
  const auto* a = static_cast<const BlockQ8_1*>(va);
  auto block = [&](int64_t b) { return dot_us(_mm256_or_si256(nibbles(w[b].qs), fifth_bits(w[b].qh)), load32(a[b].qs)); };
  auto term = [&](float acc, int64_t b, int32_t s) {
    return acc + ((fp16(w[b].d) * fp16(a[b].d)) * static_cast<float>(s) + fp16(w[b].m) * fp16(a[b].s));
  };
  return dot_exact(n / kQK, block, term);
}

float dot_q5_0(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockQ5_0*>(vw);
  const auto* a = static_cast<const BlockQ8_0*>(va);
  const __m256i bias = _mm256_set1_epi8(16);
  auto block = [&](int64_t b) {
    const __m256i y = load32(a[b].qs);
    return _mm256_sub_epi32(dot_us(_mm256_or_si256(nibbles(w[b].qs), fifth_bits(w[b].qh)), y), dot_us(bias, y));
  };
  auto term = [&](float acc, int64_t b, int32_t s) { return acc + (fp16(w[b].d) * fp16(a[b].d)) * static_cast<float>(s); };
  return dot_exact(n / kQK, block, term);
}

float dot_iq4_nl(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockIQ4_NL*>(vw);
  const auto* a = static_cast<const BlockQ8_0*>(va);
  const __m256i lut = iq4_lut();
  auto block = [&](int64_t b) { return dot_ss(_mm256_shuffle_epi8(lut, nibbles(w[b].qs)), load32(a[b].qs)); };
  auto term = [&](float acc, int64_t b, int32_t s) { return acc + (fp16(a[b].d) * fp16(w[b].d)) * static_cast<float>(s); };
  return dot_exact(n / kQK, block, term);
}

float dot_iq4_xs(int64_t n, const void* vw, const void* va) {
  const auto* w = static_cast<const BlockIQ4_XS*>(vw);
  const auto* a = static_cast<const BlockQ8_K*>(va);
  const __m256i lut = iq4_lut();
  float acc = 0.0f;
  int32_t sums[8];
  __m256i v[8];
  for (int64_t b = 0; b < n / kQK_K; ++b) {
    for (int ib = 0; ib < 8; ++ib) v[ib] = dot_ss(_mm256_shuffle_epi8(lut, nibbles(w[b].qs + 16 * ib)), load32(a[b].qs + 32 * ib));
    reduce8(v, sums);
    const float d4d8 = fp16(w[b].d) * a[b].d;
    for (int ib = 0; ib < 8; ++ib) {
      const int ls = ((w[b].scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0f) | (((w[b].scales_h >> (2 * ib)) & 3) << 4);
      acc += (d4d8 * static_cast<float>(ls - 32)) * static_cast<float>(sums[ib]);
    }
  }
  return acc;
}

}  // namespace moraine::cpu::avx2
