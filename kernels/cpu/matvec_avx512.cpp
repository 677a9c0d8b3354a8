// AVX-512 VNNI register-blocked tiles for matvec_tokens: 4 weight rows x T tokens per inner
// step (T = 4, 2 or 1). Each weight block is unpacked once into registers and reused by every
// token of the tile; each activation block is loaded once and reused by the four rows. The
// per-row kernels (vec_dot_avx512_*.cpp) redo both for every (row, token) pair, which made the
// multi-token path cost one full dot per token. Measured on one core of the AMD EPYC (Zen 4) dev
// box, matvec_tokens over a 128 x 2048 matrix in L2, GB/s of weights per CPU second (best of 3),
// before -> after at 1 / 4 / 16 tokens: Q4_K 18.3 -> 26.2 / 4.9 -> 8.7 / 1.2 -> 2.3;
// Q8_0 39.8 -> 52.2 / 10.7 -> 20.0 / 2.7 -> 5.3; MXFP4 16.9 -> 23.8 / 4.4 -> 9.8 / 1.1 -> 2.5.
// Q5_K, Q6_K, Q2_K and Q3_K got tiles later (q45_k_tile, k16_tile). On one Zen 5 core (256 x
// 2048 in L2, per-row kernels -> tiles, 1 / 4 / 16 tokens): Q5_K 23.8 -> 35.9 / 6.6 -> 17.5 /
// 1.7 -> 4.8; Q6_K 40.3 -> 47.1 / 10.6 -> 23.7 / 2.7 -> 6.5; Q2_K 16.9 -> 24.3 / 4.4 -> 9.9 /
// 1.1 -> 2.6; Q3_K 16.8 -> 21.8 / 4.3 -> 10.4 / 1.1 -> 2.8. Whole expert FFN on the 16-core
// Xeon (moraine-kernel-bench cpu, GB/s, 1 / 4 / 16 tokens): Q5_K 33 -> 54 / 18 -> 44 / 5 -> 16;
// Q6_K 37 -> 63 / 22 -> 51 / 6 -> 19; Q2_K 13 -> 40 / 9 -> 24 / 3 -> 8; Q3_K 27 -> 45 / 15 ->
// 30 / 4 -> 10.
//
// Tried and not kept for Q8_0 / MXFP4: block scales decoded per 16-block chunk (one vector per
// row and token, each pair's two factors picked with vpermps) instead of per block pair: slower
// on the Zen 5 core (Q8_0 1 token 56 -> 51, MXFP4 26 -> 24 GB/s; with vpgatherdd 45 / 22).
//
// Q4_K / Q5_K: integer sums are exact (see q4_k_tile), and the float expression per block and its
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
#include <type_traits>

#include "common/formats/block_layouts.h"
#include "common/formats/half_float.h"
#include "kernels/cpu/avx512_kernels.h"
#include "kernels/cpu/kquant_avx512_unpack.h"

namespace moraine::cpu::avx512 {
namespace {

constexpr int kRows = 4;

inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }
inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

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

// Q5_K (Block = BlockQ5_K): the same tile with each nibble's fifth bit added as 16 where qh
// has it (one vptestmb and one masked add per vector); dwords are then at most
// 31 * 128 * 4 = 15872, still exact in int16, and the float step is dot_q5_k's (the same
// expression as Q4_K's), so results are bitwise dot_q5_k's.
template <typename Block, int T>
void q45_k_tile(int64_t nb, const uint8_t* w, size_t row_stride, const BlockQ8_K* const* a, float* y, int64_t y_stride) {
  constexpr bool kFifthBit = std::is_same_v<Block, BlockQ5_K>;
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
  auto row_block = [&](int r, int64_t b) -> const Block& {
    return reinterpret_cast<const Block*>(w + static_cast<size_t>(r) * row_stride)[b];
  };
  // Fifth bits of vector k: bit 2k of qh[l] for its lane l < 32, bit 2k + 1 for lane 32 + l.
  __m512i bit_sel[4];
  for (int k = 0; k < 4; ++k) bit_sel[k] = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (2 * k))), _mm256_set1_epi8(static_cast<char>(1 << (2 * k + 1))), 1);
  const __m512i sixteen = _mm512_set1_epi8(16);
  for (int64_t b = 0; b < nb; ++b) {
    // The four rows' block headers, one row per 128-bit lane, and their scales and mins as words.
    const auto [head, scales, mins] = k_quant_headers4(&row_block(0, b), &row_block(1, b), &row_block(2, b), &row_block(3, b));
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
      const Block& blk = row_block(r, b);
      __m512i q[4];
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        q[k] = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(load256(blk.qs + 32 * k)), nibble_shift), low4);
      }
      if constexpr (kFifthBit) {
        const __m512i qh = _mm512_broadcast_i64x4(load256(blk.qh));
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) q[k] = _mm512_mask_add_epi8(q[k], _mm512_test_epi8_mask(qh, bit_sel[k]), q[k], sixteen);
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
  store_tile_pairs<T>(acc, y, y_stride);
}

// vpermw indices spreading sixteen words (the scales s0..s15 of 16-element sub-blocks) over
// the packed word layout of vector pairs (0,1) and (2,3): vpackssdw of dpbusd vectors k, k+1
// puts, in 128-bit lane L, words 0..3 = vector k's dwords 4L..4L+3 (sub-block 4k + L) and
// words 4..7 = vector k+1's (sub-block 4k + 4 + L).
struct K16ScaleIndex {
  alignas(64) int16_t w[2][32];
  constexpr K16ScaleIndex() : w() {
    for (int k = 0; k < 2; ++k) {
      for (int wd = 0; wd < 32; ++wd) w[k][wd] = static_cast<int16_t>(8 * k + (wd % 8 < 4 ? 0 : 4) + wd / 8);
    }
  }
};
constexpr K16ScaleIndex kK16ScaleIndex;

// Formats of 16 sub-blocks of 16 elements (Q2_K, Q3_K, Q6_K) for k16_tile: unpack() gives the
// block as four vectors of unsigned quants (vector k = elements 64k..64k+63, as the per-row
// kernels in vec_dot_avx512_kquants.cpp lay them out), scales() the sixteen sub-block scales as
// int16, kBias what unpack() added to every quant (taken back as -kBias * sum_j s_j bsums_j),
// kMin whether the block has a min term (Q2_K: acc += d * total - dmin * msum).
struct Q6KFormat {
  using Block = BlockQ6_K;
  static constexpr int kBias = 32;
  static constexpr bool kMin = false;
  static void unpack(const Block& blk, __m512i q[4]) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = load512(blk.ql + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(load256(blk.qh + 32 * h));
      q[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16(two_bits(qh, 0, 2), 4));
      q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), _mm512_slli_epi16(two_bits(qh, 4, 6), 4));
    }
  }
  static __m256i scales(const Block& blk) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.scales))); }
  static __m256i mins(const Block&) { return _mm256_setzero_si256(); }
  static uint16_t dmin(const Block&) { return 0; }
};

struct Q3KFormat {
  using Block = BlockQ3_K;
  static constexpr int kBias = 4;
  static constexpr bool kMin = false;
  static void unpack(const Block& blk, __m512i q[4]) {
    const __m512i four = _mm512_set1_epi8(4);
    const __m512i hmask = _mm512_broadcast_i64x4(load256(blk.hmask));
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i bytes = _mm512_broadcast_i64x4(load256(blk.qs + 32 * h));
      // u = low 2 bits + 4 * high bit, in 0..7; the value is u - 4.
      const __m512i u_lo = two_bits(bytes, 0, 2), u_hi = two_bits(bytes, 4, 6);
      q[2 * h] = _mm512_mask_add_epi8(u_lo, bit_set(hmask, 4 * h + 0, 4 * h + 1), u_lo, four);
      q[2 * h + 1] = _mm512_mask_add_epi8(u_hi, bit_set(hmask, 4 * h + 2, 4 * h + 3), u_hi, four);
    }
  }
  static __m256i scales(const Block& blk) { return _mm256_cvtepi8_epi16(q3k_scales(blk.scales)); }
  static __m256i mins(const Block&) { return _mm256_setzero_si256(); }
  static uint16_t dmin(const Block&) { return 0; }
};

struct Q2KFormat {
  using Block = BlockQ2_K;
  static constexpr int kBias = 0;
  static constexpr bool kMin = true;
  static void unpack(const Block& blk, __m512i q[4]) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i bytes = _mm512_broadcast_i64x4(load256(blk.qs + 32 * h));
      q[2 * h] = two_bits(bytes, 0, 2);
      q[2 * h + 1] = two_bits(bytes, 4, 6);
    }
  }
  static __m256i scales(const Block& blk) {
    return _mm256_cvtepu8_epi16(_mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.scales)), _mm_set1_epi8(0x0f)));
  }
  static __m256i mins(const Block& blk) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.scales));
    return _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0f)));
  }
  static uint16_t dmin(const Block& blk) { return blk.dmin; }
};

// Q2_K / Q3_K / Q6_K: each row's block is unpacked once for all tokens of the tile. Per token
// the four vpdpbusd vectors (dwords: sums of four products, |.| <= 63 * 128 * 4 = 32256 for
// Q6_K, less for the others) are packed to int16 exactly and one vpmaddwd per vector pair
// applies the sub-block scales (the per-row kernels use four vpmulld, two uops each on Intel);
// the bias comes back through one more vpmaddwd of kBias * s_j (|32 s_j| <= 4096: int16) with
// the bsums. Integer totals are exact and the float step per block is the reference's, so
// every (row, token) result is bitwise the per-row kernel's (and vec_dot_reference's).
// Measured on one Zen 5 core (matvec_tokens 256 x 2048 in L2, GB/s of weights per CPU second,
// per-row kernels -> tile, 1 / 4 / 16 tokens): Q6_K 40.3 / 10.6 / 2.7 -> 45.1 / 22.5 / 6.3.
template <typename Fmt, int T>
void k16_tile(int64_t nb, const uint8_t* w, size_t row_stride, const BlockQ8_K* const* a, float* y, int64_t y_stride) {
  using Block = typename Fmt::Block;
  static_assert(kRows * T % 4 == 0);
  constexpr int kGroups = kRows * T / 4;
  __m128 acc[kGroups];
  for (auto& v : acc) v = _mm_setzero_ps();
  const __m512i idx01 = _mm512_load_si512(kK16ScaleIndex.w[0]), idx23 = _mm512_load_si512(kK16ScaleIndex.w[1]);
  auto row_block = [&](int r, int64_t b) -> const Block& {
    return reinterpret_cast<const Block*>(w + static_cast<size_t>(r) * row_stride)[b];
  };
  for (int64_t b = 0; b < nb; ++b) {
    const __m128 dw = _mm_cvtph_ps(_mm_setr_epi16(static_cast<short>(row_block(0, b).d), static_cast<short>(row_block(1, b).d),
                                                  static_cast<short>(row_block(2, b).d), static_cast<short>(row_block(3, b).d), 0, 0, 0, 0));
    __m128 dminw = _mm_setzero_ps();
    if constexpr (Fmt::kMin) {
      dminw = _mm_cvtph_ps(_mm_setr_epi16(static_cast<short>(Fmt::dmin(row_block(0, b))), static_cast<short>(Fmt::dmin(row_block(1, b))),
                                          static_cast<short>(Fmt::dmin(row_block(2, b))), static_cast<short>(Fmt::dmin(row_block(3, b))), 0, 0, 0, 0));
    }
    const __m128 da = _mm_setr_ps(a[0 % T][b].d, a[1 % T][b].d, a[2 % T][b].d, a[3 % T][b].d);
    __m512i isum[4], msum[4];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const Block& blk = row_block(r, b);
      __m512i q[4];
      Fmt::unpack(blk, q);
      const __m256i sc16 = Fmt::scales(blk);
      const __m512i s01 = _mm512_permutexvar_epi16(idx01, _mm512_castsi256_si512(sc16));
      const __m512i s23 = _mm512_permutexvar_epi16(idx23, _mm512_castsi256_si512(sc16));
      const __m256i sc_bias = _mm256_mullo_epi16(sc16, _mm256_set1_epi16(static_cast<short>(-Fmt::kBias)));
      const __m256i mn16 = Fmt::mins(blk);
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const int8_t* q8 = a[t][b].qs;
        const __m512i zero = _mm512_setzero_si512();
        const __m512i p01 = _mm512_packs_epi32(_mm512_dpbusd_epi32(zero, q[0], load512(q8)), _mm512_dpbusd_epi32(zero, q[1], load512(q8 + 64)));
        const __m512i p23 = _mm512_packs_epi32(_mm512_dpbusd_epi32(zero, q[2], load512(q8 + 128)), _mm512_dpbusd_epi32(zero, q[3], load512(q8 + 192)));
        // (vpdpwssd in place of the second vpmaddwd + vpaddd: +3-5% at 4-16 tokens, -2% at 1 on
        // the Zen 5 dev box; not taken, as on Intel it may compete for port 0 only.)
        __m512i s = _mm512_add_epi32(_mm512_madd_epi16(p01, s01), _mm512_madd_epi16(p23, s23));
        if constexpr (Fmt::kBias != 0) s = _mm512_add_epi32(s, _mm512_zextsi256_si512(_mm256_madd_epi16(sc_bias, load256(a[t][b].bsums))));
        isum[(r * T + t) % 4] = s;
        if constexpr (Fmt::kMin) msum[(r * T + t) % 4] = _mm512_zextsi256_si512(_mm256_madd_epi16(mn16, load256(a[t][b].bsums)));
      }
      if ((r + 1) * T % 4 != 0) continue;
      // Four (row, token) pairs complete: the reference's float step, lane by lane.
      const int g = (r + 1) * T / 4 - 1;
      const __m128i tot = reduce4(isum[0], isum[1], isum[2], isum[3]);
      const __m128i row_of_lane = _mm_setr_epi32((4 * g) / T, (4 * g + 1) / T, (4 * g + 2) / T, (4 * g + 3) / T);
      const __m128 d = _mm_mul_ps(_mm_permutevar_ps(dw, row_of_lane), da);
      if constexpr (Fmt::kMin) {
        const __m128i ms = reduce4(msum[0], msum[1], msum[2], msum[3]);
        const __m128 dmin = _mm_mul_ps(_mm_permutevar_ps(dminw, row_of_lane), da);
        acc[g] = _mm_add_ps(acc[g], _mm_sub_ps(_mm_mul_ps(d, _mm_cvtepi32_ps(tot)), _mm_mul_ps(dmin, _mm_cvtepi32_ps(ms))));
      } else {
        acc[g] = _mm_add_ps(acc[g], _mm_mul_ps(d, _mm_cvtepi32_ps(tot)));
      }
    }
  }
  store_tile_pairs<T>(acc, y, y_stride);
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

// e - 128 as a float for every e8m0 byte (Mxfp4Weights::scales).
struct ExponentTable {
  alignas(64) float v[256];
  constexpr ExponentTable() : v() {
    for (int e = 0; e < 256; ++e) v[e] = static_cast<float>(e - 128);
  }
};
constexpr ExponentTable kExponents{};

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
  // e8m0_half(e) * d_a rounded once: bitwise the same, without the scalar exponent decoding.
  // The float e - 128 comes from a 1 KB table by broadcast loads: one vector ALU uop (the
  // masked broadcast's blend) per row and block pair instead of five (broadcast, masked
  // broadcast, and, subtract, convert), which on Intel cores compete with the dot products for
  // ports 0 and 5. Measured (1 token): one Zen core in L2 24.3 / 25.1 -> 27.0 / 29.1 GB/s; the
  // 16-core H200 host, all cores in L2 at once 168 -> 193 GB/s, the expert layer from DRAM
  // 87.7 -> 105.5 GB/s (same run; that machine's runs differ by ~15%).
  static __m512 scales(const Block* w, bool second) {
    const __m512 lo = _mm512_set1_ps(kExponents.v[w[0].e]);
    return second ? _mm512_mask_mov_ps(lo, 0xff00, _mm512_set1_ps(kExponents.v[w[1].e])) : _mm512_maskz_mov_ps(0x00ff, lo);
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
                  [&](const BlockQ8_K* const* at, float* yt) { q45_k_tile<BlockQ4_K, 4>(nb, wb, row_stride, at, yt, y_stride); },
                  [&](const BlockQ8_K* const* at, float* yt) { q45_k_tile<BlockQ4_K, 2>(nb, wb, row_stride, at, yt, y_stride); },
                  [&](const BlockQ8_K* const* at, float* yt) { q45_k_tile<BlockQ4_K, 1>(nb, wb, row_stride, at, yt, y_stride); });
}

void q5_k_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride) {
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* const* a = reinterpret_cast<const BlockQ8_K* const*>(acts);
  const int64_t nb = n / kQK_K;
  by_token_groups(a, n_tok, y, y_stride,
                  [&](const BlockQ8_K* const* at, float* yt) { q45_k_tile<BlockQ5_K, 4>(nb, wb, row_stride, at, yt, y_stride); },
                  [&](const BlockQ8_K* const* at, float* yt) { q45_k_tile<BlockQ5_K, 2>(nb, wb, row_stride, at, yt, y_stride); },
                  [&](const BlockQ8_K* const* at, float* yt) { q45_k_tile<BlockQ5_K, 1>(nb, wb, row_stride, at, yt, y_stride); });
}

template <typename Fmt>
static void k16_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride) {
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* const* a = reinterpret_cast<const BlockQ8_K* const*>(acts);
  const int64_t nb = n / kQK_K;
  by_token_groups(a, n_tok, y, y_stride,
                  [&](const BlockQ8_K* const* at, float* yt) { k16_tile<Fmt, 4>(nb, wb, row_stride, at, yt, y_stride); },
                  [&](const BlockQ8_K* const* at, float* yt) { k16_tile<Fmt, 2>(nb, wb, row_stride, at, yt, y_stride); },
                  [&](const BlockQ8_K* const* at, float* yt) { k16_tile<Fmt, 1>(nb, wb, row_stride, at, yt, y_stride); });
}

void q2_k_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride) {
  k16_rows4<Q2KFormat>(n, w, row_stride, acts, n_tok, y, y_stride);
}

void q3_k_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride) {
  k16_rows4<Q3KFormat>(n, w, row_stride, acts, n_tok, y, y_stride);
}

void q6_k_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride) {
  k16_rows4<Q6KFormat>(n, w, row_stride, acts, n_tok, y, y_stride);
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
