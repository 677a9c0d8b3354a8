// AVX-512 VNNI register-blocked tiles for matvec_tokens: 4 weight rows x T tokens per inner
// step (T = 4, 2 or 1). Each weight block is unpacked once into registers and reused by every
// token of the tile; each activation block is loaded once and reused by the four rows. The
// per-row kernels (vec_dot_avx512_*.cpp) redo both for every (row, token) pair, which made the
// multi-token path cost one full dot per token. Measured on one core of the AMD EPYC (Zen 4) dev
// box, matvec_tokens over a 128 x 2048 matrix in L2, GB/s of weights per CPU second (best of 3),
// before -> after at 1 / 4 / 16 tokens: Q4_K 18.3 -> 26.2 / 4.9 -> 8.7 / 1.2 -> 2.3;
// Q8_0 39.8 -> 52.2 / 10.7 -> 20.0 / 2.7 -> 5.3; MXFP4 16.9 -> 23.8 / 4.4 -> 9.8 / 1.1 -> 2.5.
//
// Q4_K: integer sums are exact (see q4_k_tile), and the float expression per block and its
// order are the scalar reference's, so each (row, token) result is bitwise
// vec_dot_reference's. The d and dmin products of four (row, token) pairs are evaluated side by
// side in one 4-lane vector: the same IEEE operations as the scalar code.
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

inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }
inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

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

// vpermw indices of the scale words for weight vector pairs (0,1) and (2,3) of row r, out of a
// register of the four rows' scales (row r = words 8r..8r+7). vpackssdw works per 128-bit lane
// L: words 0..3 come from vector 2k's dwords 4L..4L+3 (sub-block 4k + L/2), words 4..7 from
// vector 2k+1's (sub-block 4k + 2 + L/2).
struct ScaleIndex {
  alignas(64) int16_t w[kRows][2][32];
  constexpr ScaleIndex() : w() {
    for (int r = 0; r < kRows; ++r) {
      for (int k = 0; k < 2; ++k) {
        for (int wd = 0; wd < 32; ++wd) w[r][k][wd] = static_cast<int16_t>(8 * r + 4 * k + 2 * ((wd % 8) / 4) + wd / 16);
      }
    }
  }
};
constexpr ScaleIndex kScaleIndex;

template <int T>
void q4_k_tile(int64_t nb, const uint8_t* w, size_t row_stride, const BlockQ8_K* const* a, float* y, int64_t y_stride) {
  static_assert(kRows * T % 4 == 0);
  constexpr int kGroups = kRows * T / 4;  // (row, token) pairs i = r*T + t, reduced four at a time
  __m128 acc[kGroups];
  for (auto& v : acc) v = _mm_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  // Weight vector k covers elements 64k..64k+63: 32 packed bytes broadcast to both halves, the
  // upper half shifted down by 4 (high nibbles = elements 64k+32..), so dword lanes 0..7 of its
  // vpdpbusd sums are sub-block 2k and lanes 8..15 sub-block 2k+1. Each such dword is a sum of
  // four products |q a| <= 15 * 128, at most 7680: vpackssdw of two vectors (k, k+1) to int16
  // is exact, and one vpmaddwd then applies the 6-bit scales (word pairs share a sub-block):
  // 6 multiplies per 256 elements instead of vpmaddubsw + vpmaddwd's 8.
  const __m512i nibble_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  // Scale decode, per 128-bit lane (= row) on dwords u0 u1 u2 of the 12 packed bytes:
  // scales 0..3 = u0 & 0x3f.., scales 4..7 = (u2 & 0x0f..) | ((u0 >> 6) & 3..) << 4, and the
  // mins alike from u1 and u2 >> 4: dwords [sc lo, sc hi, min lo, min hi].
  const __m512i dec_shift = _mm512_setr4_epi32(0, 0, 0, 4);
  const __m512i dec_low = _mm512_setr4_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f);
  const __m512i dec_high = _mm512_setr4_epi32(0, 0x03030303, 0, 0x03030303);
  auto row_block = [&](int r, int64_t b) -> const BlockQ4_K& {
    return reinterpret_cast<const BlockQ4_K*>(w + static_cast<size_t>(r) * row_stride)[b];
  };
  for (int64_t b = 0; b < nb; ++b) {
    // The first 16 bytes of each row's block, one row per 128-bit lane: dword 0 = fp16 d and
    // dmin, dwords 1..3 = u0 u1 u2, the 12 packed scale bytes.
    __m512i head = _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(&row_block(0, b))));
    head = _mm512_inserti32x4(head, _mm_loadu_si128(reinterpret_cast<const __m128i*>(&row_block(1, b))), 1);
    head = _mm512_inserti32x4(head, _mm_loadu_si128(reinterpret_cast<const __m128i*>(&row_block(2, b))), 2);
    head = _mm512_inserti32x4(head, _mm_loadu_si128(reinterpret_cast<const __m128i*>(&row_block(3, b))), 3);
    const __m512i u0_u2_u1_u2 = _mm512_shuffle_epi32(head, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(3, 2, 3, 1)));
    const __m512i u0_u0_u1_u1 = _mm512_shuffle_epi32(head, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(2, 2, 1, 1)));
    const __m512i decoded =
        _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi32(u0_u2_u1_u2, dec_shift), dec_low),
                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0_u0_u1_u1, 6), dec_high), 4));
    const __m512i scales = _mm512_unpacklo_epi8(decoded, _mm512_setzero_si512());  // row r: words 8r.. = scales 0..7
    const __m512i mins = _mm512_unpackhi_epi8(decoded, _mm512_setzero_si512());    // row r: words 8r.. = mins 0..7
    // Min sums: lane r, dword t = sum_j min_j(row r) * (bsums[2j] + bsums[2j+1])(token t). Pair
    // sums are at most 2 * 16 * 128 = 4096: int16.
    __m512i mx[4];
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      if (t >= T) {
        mx[t] = _mm512_setzero_si512();
        continue;
      }
      const __m256i pairs = _mm256_madd_epi16(load256(a[t][b].bsums), _mm256_set1_epi16(1));
      const __m128i bs2 = _mm_packs_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
      mx[t] = _mm512_madd_epi16(mins, _mm512_broadcast_i32x4(bs2));
    }
    const __m512i msums = lane_sums4(mx[0], mx[1], mx[2], mx[3]);
    // The four rows' fp16 d and dmin, converted together: lanes d0 d1 d2 d3 | dmin0 .. dmin3.
    const __m256 dd = _mm256_permutevar8x32_ps(
        _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi32(_mm512_castsi128_si512(_mm_setr_epi32(0, 4, 8, 12)), head))),
        _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    const __m128 dw = _mm256_castps256_ps128(dd), dminw = _mm256_extractf128_ps(dd, 1);
    // Token scales of lanes l = 0..3 (token l % T; the same for every group).
    const __m128 da = _mm_setr_ps(a[0 % T][b].d, a[1 % T][b].d, a[2 % T][b].d, a[3 % T][b].d);
    __m512i isum[4];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const BlockQ4_K& blk = row_block(r, b);
      __m512i q[4];
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        q[k] = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(load256(blk.qs + 32 * k)), nibble_shift), low4);
      }
      const __m512i s01 = _mm512_permutexvar_epi16(_mm512_load_si512(kScaleIndex.w[r][0]), scales);
      const __m512i s23 = _mm512_permutexvar_epi16(_mm512_load_si512(kScaleIndex.w[r][1]), scales);
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const int8_t* q8 = a[t][b].qs;
        const __m512i zero = _mm512_setzero_si512();
        const __m512i p01 = _mm512_packs_epi32(_mm512_dpbusd_epi32(zero, q[0], load512(q8)), _mm512_dpbusd_epi32(zero, q[1], load512(q8 + 64)));
        const __m512i p23 = _mm512_packs_epi32(_mm512_dpbusd_epi32(zero, q[2], load512(q8 + 128)), _mm512_dpbusd_epi32(zero, q[3], load512(q8 + 192)));
        isum[(r * T + t) % 4] = _mm512_add_epi32(_mm512_madd_epi16(p01, s01), _mm512_madd_epi16(p23, s23));
      }
      if ((r + 1) * T % 4 != 0) continue;
      // Four (row, token) pairs complete: reduce them and apply the reference's float
      // expression acc += (dw * da) * total - (dmin * da) * msum, lane by lane.
      const int g = (r + 1) * T / 4 - 1;
      const __m128i tot = reduce4(isum[0], isum[1], isum[2], isum[3]);
      // Lane l is (row (4g + l) / T, token l % T); its min sum is dword 4 * row + token.
      const __m512i ms_idx = _mm512_castsi128_si512(_mm_setr_epi32(4 * ((4 * g) / T) + (4 * g) % T, 4 * ((4 * g + 1) / T) + (4 * g + 1) % T,
                                                                   4 * ((4 * g + 2) / T) + (4 * g + 2) % T, 4 * ((4 * g + 3) / T) + (4 * g + 3) % T));
      const __m128i ms = _mm512_castsi512_si128(_mm512_permutexvar_epi32(ms_idx, msums));
      const __m128i row_of_lane = _mm_setr_epi32((4 * g) / T, (4 * g + 1) / T, (4 * g + 2) / T, (4 * g + 3) / T);
      const __m128 d = _mm_mul_ps(_mm_permutevar_ps(dw, row_of_lane), da);
      const __m128 dmin = _mm_mul_ps(_mm_permutevar_ps(dminw, row_of_lane), da);
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

// Lanes 0..7 = lane 0 of two_floats, lanes 8..15 = its lane 1: the scale vector of a block pair.
inline __m512 spread_pair(__m128 two_floats) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), _mm512_zextps128_ps512(two_floats));
}

// fp16 scales of blocks b and b+1 (the second 0 when absent), converted together.
template <typename Block>
inline __m512 fp16_scale_pair(const Block* blk, bool second) {
  const uint32_t h = blk[0].d | (second ? static_cast<uint32_t>(blk[1].d) << 16 : 0u);
  return spread_pair(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(h))));
}

// Q8_0-activation formats: the weight pair of blocks b, b+1 as unsigned bytes, its bias, and
// the pair's scales.
struct Q8_0Weights {
  using Block = BlockQ8_0;
  static constexpr char kBias = static_cast<char>(0x80);
  static __m512i unpack(const Block* w, bool second) {
    const __m256i lo = load256(w[0].qs);
    const __m256i hi = second ? load256(w[1].qs) : _mm256_setzero_si256();
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), _mm512_set1_epi8(kBias));  // q + 128
  }
  static __m512 scales(const Block* w, bool second) { return fp16_scale_pair(w, second); }
  static __m512 apply(__m512 dw, __m512 da) { return _mm512_mul_ps(dw, da); }
};

struct Mxfp4Weights {
  using Block = BlockMXFP4;
  static constexpr char kBias = 12;
  static __m512i unpack(const Block* w, bool second) {
    // Doubled E2M1 value + 12 for each code: unsigned bytes 0..24.
    const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    // 128-bit lanes [x0, x0, x1, x1], shifted by [0, 4, 0, 4]: block b's low nibbles (elements
    // 0..15), its high nibbles (16..31), then block b+1's, the activation pair's order.
    const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[0].qs));
    __m512i x = _mm512_broadcast_i32x4(x0);
    if (second) {
      x = _mm512_mask_broadcast_i32x4(x, 0xff00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[1].qs)));
    } else {
      x = _mm512_maskz_mov_epi32(0x00ff, x);
    }
    constexpr int k4 = 0x00040004;  // two words shifted by 4
    const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, k4, k4, k4, k4, 0, 0, 0, 0, k4, k4, k4, k4);
    const __m512i codes = _mm512_and_si512(_mm512_srlv_epi16(x, shift), _mm512_set1_epi8(0x0f));
    return _mm512_shuffle_epi8(lut, codes);
  }
  // Block pair scales as exponents: lanes 0..7 = e(b) - 128, lanes 8..15 = e(b+1) - 128 (0 when
  // absent), as floats. The half-scale is exactly 2^(e - 128) (half::e8m0_to_fp32_half, also
  // for e < 2 where it is subnormal), so scalef(d_a, e - 128) is the reference's product
  // e8m0_half(e) * d_a rounded once: bitwise the same, without the scalar exponent decoding
  // (~16 scalar instructions per row and pair). Neutral on the Zen 4 dev box, whose scalar ALUs
  // are separate from its vector pipes; on Intel cores they share ports 0 and 5 with AVX-512.
  static __m512 scales(const Block* w, bool second) {
    int32_t e0, e1 = 0;
    std::memcpy(&e0, &w[0], 4);  // e, then 3 quant bytes (masked off below)
    if (second) std::memcpy(&e1, &w[1], 4);
    const __m512i e = _mm512_and_si512(_mm512_mask_set1_epi32(_mm512_set1_epi32(e0), 0xff00, e1), _mm512_set1_epi32(0xff));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(e, _mm512_set1_epi32(128)));
  }
  static __m512 apply(__m512 dw, __m512 da) { return _mm512_scalef_ps(da, dw); }
};

template <typename Fmt, int T>
void legacy_tile(int64_t nb, const uint8_t* w, size_t row_stride, const BlockQ8_0* const* a, float* y, int64_t y_stride) {
  using Block = typename Fmt::Block;
  __m512 acc[kRows][T];
  for (auto& row : acc) {
    for (auto& v : row) v = _mm512_setzero_ps();
  }
  const __m512i bias = _mm512_set1_epi8(Fmt::kBias);
  // One block pair (b, b+1); `second` is false only for the last block of an odd count.
  auto step = [&](int64_t b, bool second) __attribute__((always_inline)) {
    __m512i q[kRows];
    __m512 dw[kRows];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const Block* blk = reinterpret_cast<const Block*>(w + static_cast<size_t>(r) * row_stride) + b;
      q[r] = Fmt::unpack(blk, second);
      dw[r] = Fmt::scales(blk, second);
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      const BlockQ8_0* act = a[t] + b;
      const __m256i ylo = load256(act[0].qs);
      const __m256i yhi = second ? load256(act[1].qs) : _mm256_setzero_si256();
      const __m512i yv = _mm512_inserti64x4(_mm512_castsi256_si512(ylo), yhi, 1);
      // -bias * sum(a) per lane seeds every row's vpdpbusd: the sums stay exact int32.
      const __m512i neg_bias = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, yv));
      const __m512 da = fp16_scale_pair(act, second);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const __m512i sums = _mm512_dpbusd_epi32(neg_bias, q[r], yv);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), Fmt::apply(dw[r], da), acc[r][t]);
      }
    }
  };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) step(b, true);
  if (b < nb) step(b, false);
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
