// AVX-512 VNNI register-blocked tiles for matvec_tokens: 4 weight rows x T tokens per inner
// step (T = 4, 2 or 1). Each weight block is unpacked once into registers and reused by every
// token of the tile; each activation block is loaded once and reused by the four rows. The
// per-row kernels (vec_dot_avx512_*.cpp) redo both for every (row, token) pair, which made the
// multi-token path cost one full dot per token.
//
// Q4_K: integer sums are exact (vpmaddubsw of unsigned nibbles with signed q8 pairs stays
// within int16: 2 x 15 x 128 = 3840; vpmaddwd by the 6-bit scale then widens to int32), and the
// float expression per block and its order are the scalar reference's, so each (row, token)
// result is bitwise vec_dot_reference's. The d and dmin products of four (row, token) pairs are
// evaluated side by side in one 4-lane vector, the same IEEE operations as the scalar code.
//
// Q8_0 / MXFP4: as vec_dot_avx512_legacy.cpp (biased unsigned weights, exact int32 sums per
// lane; the bias times sum(a) is computed once per token and block pair and seeds the vpdpbusd
// accumulator of all four rows), block scales applied per lane, one float accumulator per
// (row, token): per lane at most nb/2 additions, then a 16-lane reduction, inside the
// (blocks + 16) summation bound the tests hold the per-row kernels to.
#include <immintrin.h>

#include <cstring>

#include "common/formats/block_layouts.h"
#include "common/formats/half_float.h"
#include "kernels/cpu/avx512_kernels.h"

namespace moraine::cpu::avx512 {
namespace {

constexpr int kRows = 4;

inline float fp16(uint16_t h) { return _cvtsh_ss(h); }
inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }
inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Lanes 0..3 = the sums of v0..v3's lanes (integer adds: exact).
inline __m128i reduce4_256(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
inline __m256i fold512(__m512i v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }

// Q4_K 6-bit scales and mins of one block (see vec_dot_avx512_kquants.cpp), byte j = sub-block j.
inline void q4k_scales_mins(const uint8_t* packed, uint64_t& sc, uint64_t& mn) {
  uint32_t u[3];
  std::memcpy(u, packed, kScaleBytesK);
  const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, low2 = 0x03030303u;
  sc = (u[0] & low6) | static_cast<uint64_t>((u[2] & low4) | (((u[0] >> 6) & low2) << 4)) << 32;
  mn = (u[1] & low6) | static_cast<uint64_t>(((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4)) << 32;
}

template <int T>
void q4_k_tile(int64_t nb, const uint8_t* w, size_t row_stride, const BlockQ8_K* const* a, float* y, int64_t y_stride) {
  static_assert(kRows * T % 4 == 0);
  constexpr int kGroups = kRows * T / 4;  // (row, token) pairs i = r*T + t, reduced four at a time
  __m128 acc[kGroups];
  for (auto& v : acc) v = _mm_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  // Weight vector k covers elements 64k..64k+63: 32 packed bytes broadcast to both halves, the
  // upper half shifted down by 4 (high nibbles = elements 64k+32..). Its scale vector holds
  // sub-block 2k's scale in words 0..15 and 2k+1's in words 16..31 (vpmaddwd pairs).
  const __m512i nibble_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  __m512i scale_idx[4];
  for (int k = 0; k < 4; ++k) {
    scale_idx[k] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(static_cast<short>(2 * k))),
                                      _mm256_set1_epi16(static_cast<short>(2 * k + 1)), 1);
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m512i isum[4];
    __m256i msum[4];
    float dw[kRows], dminw[kRows];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const BlockQ4_K& blk = reinterpret_cast<const BlockQ4_K*>(w + static_cast<size_t>(r) * row_stride)[b];
      uint64_t sc64, mn64;
      q4k_scales_mins(blk.scales, sc64, mn64);
      const __m512i sc16 = _mm512_zextsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc64))));
      const __m128i mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(mn64)));
      // Each min covers two 16-element bsums: words m0 m0 m1 m1 ... m7 m7.
      const __m256i mins = _mm256_set_m128i(_mm_unpackhi_epi16(mn16, mn16), _mm_unpacklo_epi16(mn16, mn16));
      __m512i q[4], s[4];
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        q[k] = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(load256(blk.qs + 32 * k)), nibble_shift), low4);
        s[k] = _mm512_permutexvar_epi16(scale_idx[k], sc16);
      }
      dw[r] = fp16(blk.d);
      dminw[r] = fp16(blk.dmin);
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const int8_t* q8 = a[t][b].qs;
        __m512i v = _mm512_madd_epi16(_mm512_maddubs_epi16(q[0], load512(q8)), s[0]);
        v = _mm512_add_epi32(v, _mm512_madd_epi16(_mm512_maddubs_epi16(q[1], load512(q8 + 64)), s[1]));
        v = _mm512_add_epi32(v, _mm512_madd_epi16(_mm512_maddubs_epi16(q[2], load512(q8 + 128)), s[2]));
        v = _mm512_add_epi32(v, _mm512_madd_epi16(_mm512_maddubs_epi16(q[3], load512(q8 + 192)), s[3]));
        const int i = (r * T + t) % 4;
        isum[i] = v;
        msum[i] = _mm256_madd_epi16(mins, load256(a[t][b].bsums));
      }
      if ((r + 1) * T % 4 != 0) continue;
      // Four (row, token) pairs complete: reduce them and apply the reference's float
      // expression acc += (dw * da) * total - (dmin * da) * msum, lane by lane.
      const int g = (r + 1) * T / 4 - 1;
      const __m128i tot = reduce4_256(fold512(isum[0]), fold512(isum[1]), fold512(isum[2]), fold512(isum[3]));
      const __m128i ms = reduce4_256(msum[0], msum[1], msum[2], msum[3]);
      float lane_dw[4], lane_dmin[4], lane_da[4];
      for (int l = 0; l < 4; ++l) {
        const int pi = 4 * g + l;
        lane_dw[l] = dw[pi / T];
        lane_dmin[l] = dminw[pi / T];
        lane_da[l] = a[pi % T][b].d;
      }
      const __m128 da = _mm_setr_ps(lane_da[0], lane_da[1], lane_da[2], lane_da[3]);
      const __m128 d = _mm_mul_ps(_mm_setr_ps(lane_dw[0], lane_dw[1], lane_dw[2], lane_dw[3]), da);
      const __m128 dmin = _mm_mul_ps(_mm_setr_ps(lane_dmin[0], lane_dmin[1], lane_dmin[2], lane_dmin[3]), da);
      acc[g] = _mm_add_ps(acc[g], _mm_sub_ps(_mm_mul_ps(d, _mm_cvtepi32_ps(tot)), _mm_mul_ps(dmin, _mm_cvtepi32_ps(ms))));
    }
  }
  for (int g = 0; g < kGroups; ++g) {
    alignas(16) float out[4];
    _mm_store_ps(out, acc[g]);
    for (int l = 0; l < 4; ++l) {
      const int pi = 4 * g + l;
      y[(pi % T) * y_stride + pi / T] = out[l];
    }
  }
}

// Q8_0-activation formats: the weight pair of blocks b, b+1 as unsigned bytes, and its bias.
struct Q8_0Weights {
  using Block = BlockQ8_0;
  static constexpr char kBias = static_cast<char>(0x80);
  static __m512i unpack(const Block* w, bool second) {
    const __m256i lo = load256(w[0].qs);
    const __m256i hi = second ? load256(w[1].qs) : _mm256_setzero_si256();
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), _mm512_set1_epi8(kBias));  // q + 128
  }
  static float scale(const Block& w) { return fp16(w.d); }
};

struct Mxfp4Weights {
  using Block = BlockMXFP4;
  static constexpr char kBias = 12;
  static __m512i unpack(const Block* w, bool second) {
    // Doubled E2M1 value + 12 for each code: unsigned bytes 0..24.
    const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[0].qs));
    const __m128i x1 = second ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[1].qs)) : _mm_setzero_si128();
    const __m256i lo = _mm256_set_m128i(_mm_srli_epi16(x0, 4), x0);
    const __m256i hi = _mm256_set_m128i(_mm_srli_epi16(x1, 4), x1);
    const __m512i codes = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), _mm512_set1_epi8(0x0f));
    return _mm512_shuffle_epi8(lut, codes);
  }
  static float scale(const Block& w) { return half::e8m0_to_fp32_half(w.e); }
};

inline __m512 scale_pair(float s0, float s1) { return _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(s0), _mm512_set1_ps(s1)); }

template <typename Fmt, int T>
void legacy_tile(int64_t nb, const uint8_t* w, size_t row_stride, const BlockQ8_0* const* a, float* y, int64_t y_stride) {
  using Block = typename Fmt::Block;
  __m512 acc[kRows][T];
  for (auto& row : acc) {
    for (auto& v : row) v = _mm512_setzero_ps();
  }
  const __m512i bias = _mm512_set1_epi8(Fmt::kBias);
  for (int64_t b = 0; b < nb; b += 2) {
    const bool second = b + 1 < nb;
    __m512i q[kRows];
    __m512 dw[kRows];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const Block* blk = reinterpret_cast<const Block*>(w + static_cast<size_t>(r) * row_stride) + b;
      q[r] = Fmt::unpack(blk, second);
      dw[r] = scale_pair(Fmt::scale(blk[0]), second ? Fmt::scale(blk[1]) : 0.0f);
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      const BlockQ8_0* act = a[t] + b;
      const __m256i ylo = load256(act[0].qs);
      const __m256i yhi = second ? load256(act[1].qs) : _mm256_setzero_si256();
      const __m512i yv = _mm512_inserti64x4(_mm512_castsi256_si512(ylo), yhi, 1);
      // -bias * sum(a) per lane seeds every row's vpdpbusd: the sums stay exact int32.
      const __m512i neg_bias = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, yv));
      const __m512 da = scale_pair(fp16(act[0].d), second ? fp16(act[1].d) : 0.0f);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const __m512i sums = _mm512_dpbusd_epi32(neg_bias, q[r], yv);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(dw[r], da), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < T; ++t) y[t * y_stride + r] = _mm512_reduce_add_ps(acc[r][t]);
  }
}

// Token groups of 4, then 2, then 1.
template <typename Act, typename Tile4, typename Tile2, typename Tile1>
void by_token_groups(const Act* const* a, int n_tok, float* y, int64_t y_stride, Tile4 t4, Tile2 t2, Tile1 t1) {
  int t = 0;
  for (; t + 4 <= n_tok; t += 4) t4(a + t, y + t * y_stride);
  if (t + 2 <= n_tok) {
    t2(a + t, y + t * y_stride);
    t += 2;
  }
  if (t < n_tok) t1(a + t, y + t * y_stride);
}

}  // namespace

void q4_k_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride) {
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* const* a = reinterpret_cast<const BlockQ8_K* const*>(acts);
  const int64_t nb = n / kQK_K;
  by_token_groups(a, n_tok, y, y_stride,
                  [&](const BlockQ8_K* const* at, float* yt) { q4_k_tile<4>(nb, wb, row_stride, at, yt, y_stride); },
                  [&](const BlockQ8_K* const* at, float* yt) { q4_k_tile<2>(nb, wb, row_stride, at, yt, y_stride); },
                  [&](const BlockQ8_K* const* at, float* yt) { q4_k_tile<1>(nb, wb, row_stride, at, yt, y_stride); });
}

template <typename Fmt>
static void legacy_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride) {
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* const* a = reinterpret_cast<const BlockQ8_0* const*>(acts);
  const int64_t nb = n / kQK;
  by_token_groups(a, n_tok, y, y_stride,
                  [&](const BlockQ8_0* const* at, float* yt) { legacy_tile<Fmt, 4>(nb, wb, row_stride, at, yt, y_stride); },
                  [&](const BlockQ8_0* const* at, float* yt) { legacy_tile<Fmt, 2>(nb, wb, row_stride, at, yt, y_stride); },
                  [&](const BlockQ8_0* const* at, float* yt) { legacy_tile<Fmt, 1>(nb, wb, row_stride, at, yt, y_stride); });
}

void q8_0_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride) {
  legacy_rows4<Q8_0Weights>(n, w, row_stride, acts, n_tok, y, y_stride);
}

void mxfp4_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride) {
  legacy_rows4<Mxfp4Weights>(n, w, row_stride, acts, n_tok, y, y_stride);
}

}  // namespace moraine::cpu::avx512
