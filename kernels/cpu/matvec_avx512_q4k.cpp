// Q4_K register tiles for matvec_tokens on CPUs with GFNI, against activations repacked once
// per matvec_tokens call.
//
// Why: at 1 token the Q4_K tile of matvec_avx512.cpp spends ~130 vector uops per super-block
// and 4 rows (576 weight bytes), Q8_0's tile ~100 for as many bytes; on the 16-core Xeon all
// cores in L2 reached 232 GB/s for Q4_K against 274 for Q8_0, and the layer 73-84% of DRAM
// against Q8_0's 85-98%. What this tile saves per super-block:
// - the nibbles of a row: two 64-byte loads, vpand for the low nibbles and one gf2p8affineqb
//   (a bit matrix moving bits 4..7 to 0..3 of each byte) for the high ones, 4 uops instead of
//   four broadcast halves shifted and masked (8);
// - per token, work that depends only on the activations, done once per call instead of once
//   per 4 rows: the activation bytes reordered to match those nibble vectors (vector k holds
//   elements 32-blocks 2(k/2)*2.. as the weights do), the bsums paired, as int16, in all four
//   lanes, and the scale; at one token the lane permutes of the float step are the identity and
//   are left out.
// - the scale application of the second word pair by vpdpwssd into the first's vpmaddwd (one
//   uop less; +3% at 1 token, +5-8% at 2-4 on the Zen 5 core).
// Measured: one Zen 5 core in L2 (1 / 4 / 16 tokens) 39.4 -> 49.5 / 17.8 -> 20.7 / 4.8 -> 5.5
// GB/s. The 16-core Xeon (moraine-kernel-bench cpu --threads 16, same run, DRAM probe 118-129
// GB/s): all cores in L2 at 1 token 185-222 -> 231-248 GB/s; the expert layer at 1 token 75-105
// -> 93-104 GB/s (three runs each), at 4 tokens 47.6 -> 50.3, at 16 tokens 14.6 -> 15.1.
// (The integer reduction of the four rows, reduce4, is ~12% of the time at 1 token on the Zen 5
// core: measured by leaving it out.)
// The integer sums and the float expression per block are those of q45_k_tile (and of the
// scalar reference): results are bitwise dot_q4_k's.
#include <immintrin.h>

#include "common/formats/block_layouts.h"
#include "kernels/cpu/avx512_kernels.h"
#include "kernels/cpu/kquant_avx512_unpack.h"

namespace moraine::cpu::avx512 {
namespace {

constexpr int kRows = 4;

// One Q8_K activation block as the tile reads it (384 bytes, 64-byte aligned in the buffer).
struct PackedQ8K {
  // a[k] for the weight nibble vector k of a 64-byte half h = k / 2 of the packed nibbles:
  // a[2h] = elements [128h, 128h + 32) then [128h + 64, 128h + 96) (the low nibbles' partners),
  // a[2h + 1] = [128h + 32, 128h + 64) then [128h + 96, 128h + 128) (the high nibbles').
  int8_t a[4][64];
  int16_t bs2[32];  // bsums[2j] + bsums[2j + 1] for j = 0..7, the eight in each 128-bit lane
  float d;
  uint8_t pad[60];
};
static_assert(sizeof(PackedQ8K) == kQ4KPackedBlockBytes);

// vpermw indices of the scale words for the packed pairs (a0, a1) and (a2, a3) of row r: in
// 128-bit lane L the pair k's words 0..3 are sub-block 4k + 2 * (L / 2), words 4..7 sub-block
// 4k + 2 * (L / 2) + 1; out of a register of the four rows' scales (row r = words 8r..8r+7).
struct PackedScaleIndex {
  alignas(64) int16_t w[kRows][2][32];
  constexpr PackedScaleIndex() : w() {
    for (int r = 0; r < kRows; ++r) {
      for (int k = 0; k < 2; ++k) {
        for (int wd = 0; wd < 32; ++wd) w[r][k][wd] = static_cast<int16_t>(8 * r + 4 * k + 2 * (wd / 16) + (wd % 8) / 4);
      }
    }
  }
};
constexpr PackedScaleIndex kPackedScaleIndex;

// gf2p8affineqb matrix: result bit i = source bit i + 4 for i < 4, 0 above (row i of the
// matrix is byte 7 - i).
constexpr long long kHighNibble = 0x1020408000000000ll;

// pf (or nullptr): part b of the pf_bytes from pf prefetched at super-block b (prefetch_part).
template <int T>
void q4_k_packed_tile(int64_t nb, const uint8_t* w, size_t row_stride, const PackedQ8K* const* a, float* y, int64_t y_stride,
                      const uint8_t* pf, size_t pf_bytes) {
  static_assert(kRows * T % 4 == 0);
  constexpr int kGroups = kRows * T / 4;
  __m128 acc[kGroups];
  for (auto& v : acc) v = _mm_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i high_nibble = _mm512_set1_epi64(kHighNibble);
  auto row_block = [&](int r, int64_t b) -> const BlockQ4_K& {
    return reinterpret_cast<const BlockQ4_K*>(w + static_cast<size_t>(r) * row_stride)[b];
  };
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_part(pf, pf_bytes, b, nb);
    // The block headers, scales and mins as in q45_k_tile (k_quant_headers4).
    const auto [head, scales, mins] = k_quant_headers4(&row_block(0, b), &row_block(1, b), &row_block(2, b), &row_block(3, b));
    // Min sums: lane r, dword t (t < T) = sum_j min_j(row r) * bs2_j(token t).
    __m512i msums;
    if constexpr (T == 1) {
      // Every dword of lane r = its four dwords' sum.
      const __m512i mx = _mm512_madd_epi16(mins, _mm512_load_si512(a[0][b].bs2));
      const __m512i s = _mm512_add_epi32(mx, _mm512_shuffle_epi32(mx, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(1, 0, 3, 2))));
      msums = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(2, 3, 0, 1))));
    } else {
      __m512i mx[4];
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) mx[t] = t < T ? _mm512_madd_epi16(mins, _mm512_load_si512(a[t][b].bs2)) : _mm512_setzero_si512();
      msums = lane_sums4(mx[0], mx[1], mx[2], mx[3]);
    }
    const __m256 dd = _mm256_permutevar8x32_ps(
        _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi32(_mm512_castsi128_si512(_mm_setr_epi32(0, 4, 8, 12)), head))),
        _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    const __m128 dw = _mm256_castps256_ps128(dd), dminw = _mm256_extractf128_ps(dd, 1);
    const __m128 da = T == 1 ? _mm_set1_ps(a[0][b].d) : _mm_setr_ps(a[0 % T][b].d, a[1 % T][b].d, a[2 % T][b].d, a[3 % T][b].d);
    __m512i isum[4];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const BlockQ4_K& blk = row_block(r, b);
      const __m512i x0 = _mm512_loadu_si512(blk.qs), x1 = _mm512_loadu_si512(blk.qs + 64);
      const __m512i q0 = _mm512_and_si512(x0, low4), q1 = _mm512_gf2p8affine_epi64_epi8(x0, high_nibble, 0);
      const __m512i q2 = _mm512_and_si512(x1, low4), q3 = _mm512_gf2p8affine_epi64_epi8(x1, high_nibble, 0);
      const __m512i s01 = _mm512_permutexvar_epi16(_mm512_load_si512(kPackedScaleIndex.w[r][0]), scales);
      const __m512i s23 = _mm512_permutexvar_epi16(_mm512_load_si512(kPackedScaleIndex.w[r][1]), scales);
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const PackedQ8K& p = a[t][b];
        const __m512i zero = _mm512_setzero_si512();
        const __m512i p01 = _mm512_packs_epi32(_mm512_dpbusd_epi32(zero, q0, _mm512_load_si512(p.a[0])),
                                               _mm512_dpbusd_epi32(zero, q1, _mm512_load_si512(p.a[1])));
        const __m512i p23 = _mm512_packs_epi32(_mm512_dpbusd_epi32(zero, q2, _mm512_load_si512(p.a[2])),
                                               _mm512_dpbusd_epi32(zero, q3, _mm512_load_si512(p.a[3])));
        isum[(r * T + t) % 4] = _mm512_dpwssd_epi32(_mm512_madd_epi16(p01, s01), p23, s23);
      }
      if ((r + 1) * T % 4 != 0) continue;
      // Four (row, token) pairs complete: acc += (dw * da) * total - (dmin * da) * msum, lane
      // by lane (the reference's expression).
      const int g = (r + 1) * T / 4 - 1;
      const __m128i tot = reduce4(isum[0], isum[1], isum[2], isum[3]);
      __m128i ms;
      __m128 d, dmin;
      if constexpr (T == 1) {
        ms = _mm512_castsi512_si128(_mm512_permutexvar_epi32(_mm512_castsi128_si512(_mm_setr_epi32(0, 4, 8, 12)), msums));
        d = _mm_mul_ps(dw, da);
        dmin = _mm_mul_ps(dminw, da);
      } else {
        const __m512i ms_idx = _mm512_castsi128_si512(_mm_setr_epi32(4 * ((4 * g) / T) + (4 * g) % T, 4 * ((4 * g + 1) / T) + (4 * g + 1) % T,
                                                                     4 * ((4 * g + 2) / T) + (4 * g + 2) % T, 4 * ((4 * g + 3) / T) + (4 * g + 3) % T));
        ms = _mm512_castsi512_si128(_mm512_permutexvar_epi32(ms_idx, msums));
        const __m128i row_of_lane = _mm_setr_epi32((4 * g) / T, (4 * g + 1) / T, (4 * g + 2) / T, (4 * g + 3) / T);
        d = _mm_mul_ps(_mm_permutevar_ps(dw, row_of_lane), da);
        dmin = _mm_mul_ps(_mm_permutevar_ps(dminw, row_of_lane), da);
      }
      acc[g] = _mm_add_ps(acc[g], _mm_sub_ps(_mm_mul_ps(d, _mm_cvtepi32_ps(tot)), _mm_mul_ps(dmin, _mm_cvtepi32_ps(ms))));
    }
  }
  store_tile_pairs<T>(acc, y, y_stride);
}

}  // namespace

void pack_q4_k_acts(int64_t n, const void* act, void* dst) {
  const auto* src = static_cast<const BlockQ8_K*>(act);
  auto* out = static_cast<PackedQ8K*>(dst);
  const int64_t nb = n / kQK_K;
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ8_K& blk = src[b];
    PackedQ8K& o = out[b];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i q0 = _mm512_loadu_si512(blk.qs + 128 * h), q1 = _mm512_loadu_si512(blk.qs + 128 * h + 64);
      _mm512_store_si512(o.a[2 * h], _mm512_shuffle_i64x2(q0, q1, _MM_SHUFFLE(1, 0, 1, 0)));
      _mm512_store_si512(o.a[2 * h + 1], _mm512_shuffle_i64x2(q0, q1, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    const __m256i pairs = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.bsums)), _mm256_set1_epi16(1));
    const __m128i bs2 = _mm_packs_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));  // |.| <= 4096
    _mm512_store_si512(o.bs2, _mm512_broadcast_i32x4(bs2));
    o.d = blk.d;
  }
}

void q4_k_rows4_packed(int64_t n, const void* w, size_t row_stride, const void* const* packed, int n_tok, float* y, int64_t y_stride,
                       const void* prefetch, size_t prefetch_bytes) {
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* const* a = reinterpret_cast<const PackedQ8K* const*>(packed);
  const int64_t nb = n / kQK_K;
  // The prefetch goes with the first token group's tile (the others re-read these rows from L1).
  const auto* pf = static_cast<const uint8_t*>(prefetch);
  int t = 0;
  for (; t + 4 <= n_tok; t += 4, pf = nullptr) q4_k_packed_tile<4>(nb, wb, row_stride, a + t, y + t * y_stride, y_stride, pf, prefetch_bytes);
  if (t + 2 <= n_tok) {
    q4_k_packed_tile<2>(nb, wb, row_stride, a + t, y + t * y_stride, y_stride, pf, prefetch_bytes);
    pf = nullptr;
    t += 2;
  }
  if (t < n_tok) q4_k_packed_tile<1>(nb, wb, row_stride, a + t, y + t * y_stride, y_stride, pf, prefetch_bytes);
}

}  // namespace moraine::cpu::avx512
