// Four-block register tiles for matvec_tokens on CPUs with AVX-512 VBMI (vpermb / vpermt2b), for
// the formats of 32-element blocks against Q8_0 activations (MXFP4, Q8_0): four blocks of a row
// per step against activations repacked once per matvec_tokens call (pack_*_acts: per group of
// four blocks the first and second halves of each block in separate vectors, the bias seed per
// dword, the scales spread over their lanes), so the per-token work is done once per call
// instead of once per 4 rows.
//
// MXFP4, why: at 1 token the block-pair tile of matvec_avx512.cpp needed ~44 vector uops per 144
// weight bytes (Q8_0: ~25), and its compute ceiling sat close to DRAM bandwidth: on the 16-core
// Xeon all cores in L2 reached 150-193 GB/s against a DRAM probe of 115-165, on the 2-core Zen 5
// box 34.5 against 43-46, so the layer stayed at 69-78% of DRAM while Q8_0 (ceiling ~2x DRAM)
// reached 85-98%. Here, per row and 4 blocks (68 bytes): two loads of the 68 bytes, one
// vpermt2b dropping the four exponent bytes, two vpermb table lookups (a 64-entry table that
// repeats the 16 codes, so the low nibble needs no mask and the high nibble only a word shift),
// one vpermt2b + subtract for the block exponents (2^23 + e as float bits, minus 2^23 + 128: the
// float e - 128 without a conversion), then per token two vpdpbusd (the low and high nibbles of
// a block share its lane, so one chained sum per block) and convert / scalef / fma: 11 uops where
// the pair tile spent 18. One Zen 5 core in L2 (1 / 4 / 16 tokens): 30.0 -> 49.3 / 12.7 -> 22.6 /
// 3.3 -> 5.9 GB/s. The 16-core Xeon (moraine-kernel-bench cpu --threads 16, same run, DRAM probe
// 118-129 GB/s): all cores in L2 at 1 token 135-142 -> 179-205 GB/s; the expert layer at 1 token
// 74-76 -> 66-89 GB/s (three runs each: at or near the memory side's limit, see matvec.cpp), at
// 4 tokens 38.9 -> 59.7, at 16 tokens 9.8 -> 16.7. (Tried: the four rows' exponents gathered
// into one vector and one scalef for all 16 block factors at one token: 48 -> 44 GB/s on the Zen
// 5 core, not kept.)
//
// Q8_0, why: the pair tile decodes every row's two fp16 scales with scalar loads, a convert and a
// lane spread per block pair, and each token's bias and scale per pair per 4 rows. Here per row
// and 4 blocks (136 bytes): four loads, two vpermt2b (block halves), two xor (bias), one vpermt2w +
// convert for the four scales, then per token two vpdpbusd and convert / multiply / fma. One Zen 5
// core in L2 (1 / 4 / 16 tokens): 57.8 -> 59.8 / 28.5 -> 37.3 / 8.0 -> 10.0 GB/s.
//
// Results: the integer sum of each block is exact (biased unsigned weights, the bias times
// sum(a) precomputed per lane), the block factor is the pair tiles' (scalef(d_a, e - 128),
// bitwise e8m0_half(e) * d_a, for MXFP4; d_w * d_a for Q8_0), and each lane accumulates one
// block in four: the same per-lane summation bound as the pair tiles (tests/cpu_kernels).
#include <immintrin.h>

#include <cstring>

#include "common/formats/block_layouts.h"
#include "kernels/cpu/avx512_kernels.h"

namespace moraine::cpu::avx512 {
namespace {

constexpr int kGroupBlocks = 4;  // blocks per step
constexpr int64_t kGroupBytes = kGroupBlocks * static_cast<int64_t>(sizeof(BlockMXFP4));  // 68
constexpr int64_t kActGroup = kGroupBlocks * static_cast<int64_t>(sizeof(BlockQ8_0));     // 136

// One group of four activation blocks, as the tile reads it (256 bytes).
struct PackedGroup {
  int8_t lo[64];     // lane L (bytes 16L..16L+15): block L's elements 0..15 (the low nibbles' partners)
  int8_t hi[64];     // lane L: block L's elements 16..31 (the high nibbles')
  int32_t seed[16];  // -bias * (sum of the dword's four lo and four hi bytes): takes the weights' bias back
  float da[16];      // lane L: block L's scale, four times
};
static_assert(sizeof(PackedGroup) == kPackedGroupBytes);

struct Tables {
  alignas(64) int8_t lut[64];        // doubled E2M1 value + 12 per code, repeated four times
  alignas(64) uint8_t qs_idx[64];    // vpermt2b: byte 16L + j <- group byte 17L + 1 + j (A: 0..63, B = A + 4)
  // vpermt2b over (the group's first 64 bytes, 2^23 in every dword): dword 4L + k <- 2^23 + block
  // L's e as float bits (byte 0 = group byte 17L, byte 3 = 0x4b, bytes 1, 2 = 0).
  alignas(64) uint8_t exp_idx[64];
  // A group of four Q8_0 blocks (activations, and Q8_0 weights alike):
  alignas(64) uint8_t act_lo[64];    // vpermt2b over the group's bytes 0..127: lane L <- block L's qs[0..16)
  alignas(64) uint8_t act_hi[64];    // vpermt2b over its bytes 8..135: lane L <- block L's qs[16..32)
  alignas(64) uint16_t act_d[32];    // vpermt2w over its words 0..63: word 4L + k <- block L's d
  constexpr Tables() : lut(), qs_idx(), exp_idx(), act_lo(), act_hi(), act_d() {
    constexpr int8_t kBiased[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
    for (int i = 0; i < 64; ++i) {
      const int l = i / 16, j = i % 16;
      lut[i] = kBiased[j];
      const int src = 17 * l + 1 + j;
      qs_idx[i] = static_cast<uint8_t>(src < 64 ? src : 64 + (src - 4));
      exp_idx[i] = static_cast<uint8_t>(i % 4 == 0 ? 17 * l : i % 4 == 3 ? 64 + 3 : 64);
      constexpr int kAct = static_cast<int>(sizeof(BlockQ8_0));  // 34
      act_lo[i] = static_cast<uint8_t>(kAct * l + 2 + j);       // < 128
      act_hi[i] = static_cast<uint8_t>(kAct * l + 18 + j - 8);  // 10..127
    }
    for (int i = 0; i < 32; ++i) act_d[i] = static_cast<uint16_t>(i < 16 ? 17 * (i / 4) : 0);
  }
};
constexpr Tables kTables{};

inline __m512i load_idx(const uint8_t* p) { return _mm512_load_si512(p); }

// Mask of the first `bytes` bytes (0..64) of a 64-byte load.
inline __mmask64 first_bytes(int64_t bytes) {
  if (bytes >= 64) return ~__mmask64{0};
  if (bytes <= 0) return 0;
  return (__mmask64{1} << bytes) - 1;
}

// pf (or nullptr): part g of the pf_bytes from pf prefetched at group g (prefetch_part).
template <int kRows, int T>
void mxfp4_group_tile(int64_t nb, const uint8_t* w, size_t row_stride, const PackedGroup* const* a, float* y, int64_t y_stride,
                      const uint8_t* pf, size_t pf_bytes) {
  __m512 acc[kRows][T];
  for (auto& row : acc) {
    for (auto& v : row) v = _mm512_setzero_ps();
  }
  const __m512i lut = _mm512_load_si512(kTables.lut);
  const __m512i qs_idx = load_idx(kTables.qs_idx), exp_idx = load_idx(kTables.exp_idx);
  const __m512i magic = _mm512_set1_epi32(0x4b000000);  // 2^23: bytes 0, 0, 0, 0x4b
  const __m512 e_bias = _mm512_set1_ps(8388608.0f + 128.0f);
  const int64_t n_groups = (nb + kGroupBlocks - 1) / kGroupBlocks;
  // A group's 68 bytes as two loads, [0, 64) and [4, 68); a last partial group reads only its
  // blocks (masked loads do not fault), the rest reads as code 0 / exponent 0 against zero
  // activations, adding nothing.
  auto step = [&](int64_t g, __mmask64 ma, __mmask64 mb) __attribute__((always_inline)) {
    prefetch_part(pf, pf_bytes, g, n_groups);
    __m512i lo[kRows], hi[kRows];
    __m512 ef[kRows];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* base = w + static_cast<size_t>(r) * row_stride + g * kGroupBytes;
      const __m512i va = ~ma ? _mm512_maskz_loadu_epi8(ma, base) : _mm512_loadu_si512(base);
      const __m512i vb = ~mb ? _mm512_maskz_loadu_epi8(mb, base + 4) : _mm512_loadu_si512(base + 4);
      const __m512i codes = _mm512_permutex2var_epi8(va, qs_idx, vb);
      lo[r] = _mm512_permutexvar_epi8(codes, lut);
      hi[r] = _mm512_permutexvar_epi8(_mm512_srli_epi16(codes, 4), lut);
      // 2^23 + e as a float (e in the low mantissa byte under the exponent of 2^23), minus 2^23 + 128.
      ef[r] = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_permutex2var_epi8(va, exp_idx, magic)), e_bias);
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      const PackedGroup& p = a[t][g];
      const __m512i alo = _mm512_load_si512(p.lo), ahi = _mm512_load_si512(p.hi);
      const __m512i seed = _mm512_load_si512(p.seed);
      const __m512 da = _mm512_load_ps(p.da);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(seed, lo[r], alo), hi[r], ahi);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_scalef_ps(da, ef[r]), acc[r][t]);
      }
    }
  };
  const int64_t full = nb / kGroupBlocks;
  for (int64_t g = 0; g < full; ++g) step(g, ~__mmask64{0}, ~__mmask64{0});
  if (full < n_groups) {
    const int64_t bytes = (nb - full * kGroupBlocks) * static_cast<int64_t>(sizeof(BlockMXFP4));
    step(full, first_bytes(bytes), first_bytes(bytes - 4));
  }
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < T; ++t) y[t * y_stride + r] = _mm512_reduce_add_ps(acc[r][t]);
  }
}

// A group of four Q8_0 blocks (fewer in a last partial group: masked loads, zeros beyond) as
// the two 64-byte halves vectors and the 16 fp16 scales (word 4L + k = block L's d).
struct Q8_0Group {
  __m512i lo, hi, d16;
};
inline Q8_0Group load_q8_0_group(const uint8_t* p, int64_t bytes) {
  const bool full = bytes >= kActGroup;
  const __m512i x0 = full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(first_bytes(bytes), p);
  const __m512i x1 = full ? _mm512_loadu_si512(p + 64) : _mm512_maskz_loadu_epi8(first_bytes(bytes - 64), p + 64);
  const __m512i y0 = full ? _mm512_loadu_si512(p + 8) : _mm512_maskz_loadu_epi8(first_bytes(bytes - 8), p + 8);
  const __m512i y1 = full ? _mm512_loadu_si512(p + 72) : _mm512_maskz_loadu_epi8(first_bytes(bytes - 72), p + 72);
  return {_mm512_permutex2var_epi8(x0, load_idx(kTables.act_lo), x1), _mm512_permutex2var_epi8(y0, load_idx(kTables.act_hi), y1),
          _mm512_permutex2var_epi16(x0, _mm512_load_si512(kTables.act_d), x1)};
}

// pf (or nullptr): part g of the pf_bytes from pf prefetched at group g (prefetch_part).
template <int kRows, int T>
void q8_0_group_tile(int64_t nb, const uint8_t* w, size_t row_stride, const PackedGroup* const* a, float* y, int64_t y_stride,
                     const uint8_t* pf, size_t pf_bytes) {
  __m512 acc[kRows][T];
  for (auto& row : acc) {
    for (auto& v : row) v = _mm512_setzero_ps();
  }
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t n_groups = (nb + kGroupBlocks - 1) / kGroupBlocks;
  auto step = [&](int64_t g, int64_t bytes) __attribute__((always_inline)) {
    prefetch_part(pf, pf_bytes, g, n_groups);
    __m512i lo[kRows], hi[kRows];
    __m512 dw[kRows];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const Q8_0Group q = load_q8_0_group(w + static_cast<size_t>(r) * row_stride + g * kActGroup, bytes);
      lo[r] = _mm512_xor_si512(q.lo, bias);  // q + 128
      hi[r] = _mm512_xor_si512(q.hi, bias);
      dw[r] = _mm512_cvtph_ps(_mm512_castsi512_si256(q.d16));
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      const PackedGroup& p = a[t][g];
      const __m512i alo = _mm512_load_si512(p.lo), ahi = _mm512_load_si512(p.hi);
      const __m512i seed = _mm512_load_si512(p.seed);
      const __m512 da = _mm512_load_ps(p.da);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(seed, lo[r], alo), hi[r], ahi);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw[r], da), acc[r][t]);
      }
    }
  };
  const int64_t full = nb / kGroupBlocks;
  for (int64_t g = 0; g < full; ++g) step(g, kActGroup);
  if (full < n_groups) step(full, (nb - full * kGroupBlocks) * static_cast<int64_t>(sizeof(BlockQ8_0)));
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < T; ++t) y[t * y_stride + r] = _mm512_reduce_add_ps(acc[r][t]);
  }
}

// One activation row in groups; kBias is what the weights' unpacking adds to every value.
template <int kBias>
void pack_groups(int64_t n, const void* act, void* dst) {
  const auto* src = static_cast<const uint8_t*>(act);
  auto* out = static_cast<PackedGroup*>(dst);
  const int64_t nb = n / kQK, n_groups = (nb + kGroupBlocks - 1) / kGroupBlocks;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(kBias));
  for (int64_t g = 0; g < n_groups; ++g) {
    const int64_t blocks = nb - g * kGroupBlocks < kGroupBlocks ? nb - g * kGroupBlocks : kGroupBlocks;
    const Q8_0Group q = load_q8_0_group(src + g * kActGroup, blocks * static_cast<int64_t>(sizeof(BlockQ8_0)));
    const __m512i sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, q.lo), bias, q.hi);
    PackedGroup& o = out[g];
    _mm512_store_si512(o.lo, q.lo);
    _mm512_store_si512(o.hi, q.hi);
    _mm512_store_si512(o.seed, _mm512_sub_epi32(_mm512_setzero_si512(), sum));
    _mm512_store_ps(o.da, _mm512_cvtph_ps(_mm512_castsi512_si256(q.d16)));
  }
}

// Token groups of 4, then 2, then 1: tile.template operator()<T>(first activation, first output).
template <typename Tile>
void by_token_groups(const PackedGroup* const* a, int n_tok, float* y, int64_t y_stride, Tile tile) {
  int t = 0;
  for (; t + 4 <= n_tok; t += 4) tile.template operator()<4>(a + t, y + t * y_stride);
  if (t + 2 <= n_tok) {
    tile.template operator()<2>(a + t, y + t * y_stride);
    t += 2;
  }
  if (t < n_tok) tile.template operator()<1>(a + t, y + t * y_stride);
}

}  // namespace

void pack_mxfp4_acts(int64_t n, const void* act, void* dst) { pack_groups<12>(n, act, dst); }
void pack_q8_0_acts(int64_t n, const void* act, void* dst) { pack_groups<128>(n, act, dst); }

namespace {

// Four rows against packed activations, token groups as by_token_groups cuts them; Tile is
// q8_0_group_tile or mxfp4_group_tile (as a generic lambda over <rows, tokens>).
// The spread prefetch (pf) goes with the first token group's tile (the others re-read the rows
// from L1).
template <class Tile>
void rows4_packed(int64_t n, const void* w, size_t row_stride, const void* const* packed, int n_tok, float* y,
                  int64_t y_stride, const void* prefetch, size_t prefetch_bytes, Tile tile) {
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* const* a = reinterpret_cast<const PackedGroup* const*>(packed);
  const int64_t nb = n / kQK;
  const auto* pf = static_cast<const uint8_t*>(prefetch);
  by_token_groups(a, n_tok, y, y_stride, [&]<int T>(const PackedGroup* const* at, float* yt) {
    tile.template operator()<4, T>(nb, wb, row_stride, at, yt, y_stride, pf, prefetch_bytes);
    pf = nullptr;
  });
}

}  // namespace

void q8_0_rows4_packed(int64_t n, const void* w, size_t row_stride, const void* const* packed, int n_tok, float* y, int64_t y_stride,
                       const void* prefetch, size_t prefetch_bytes) {
  rows4_packed(n, w, row_stride, packed, n_tok, y, y_stride, prefetch, prefetch_bytes, []<int R, int T>(auto... args) {
    q8_0_group_tile<R, T>(args...);
  });
}

void mxfp4_rows4_packed(int64_t n, const void* w, size_t row_stride, const void* const* packed, int n_tok, float* y,
                        int64_t y_stride, const void* prefetch, size_t prefetch_bytes) {
  rows4_packed(n, w, row_stride, packed, n_tok, y, y_stride, prefetch, prefetch_bytes, []<int R, int T>(auto... args) {
    mxfp4_group_tile<R, T>(args...);
  });
}

}  // namespace moraine::cpu::avx512
