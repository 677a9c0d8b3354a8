// AVX-512 VNNI dots of the importance-matrix grid formats (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
// IQ3_S, IQ1_S, IQ1_M) with Q8_K activations, 64 elements (two 32-element sub-blocks) per step:
// the step's codebook entries are loaded from the grid tables (8 x 8 bytes, or 16 x 4 for IQ3)
// at indices built with pdep, the sign bits become a 64-bit byte mask, and vpdpbusd sums the grid
// magnitudes (unsigned) times the activations separately for the positive and the negative
// elements, so the integer sums are exact for every int8 activation (negating an activation
// would wrap at -128). vpdpwssd applies the scales to the dword sums; each super-block's sums
// are reduced exactly and the float part runs in the scalar reference's order (quant_iq.h), so
// the results are bit-identical to it. A step is decoded once for up to 8 activation rows
// (the matvec tiles); every row's numbers are the single-row kernel's.
#include <immintrin.h>

#include <cstring>

#include "common/formats/block_layouts_iq.h"
#include "common/formats/iq_grids.h"
#include "kernels/cpu/iq_kernels.h"

namespace moraine::cpu::avx512 {
namespace {

namespace iq = formats::iq;

// Step decoding returns several vectors by value: GCC would otherwise call it out of line for
// the bigger formats and pass them through memory (IQ3_S: 4.9 -> 3.1 GB/s).
#define MORAINE_IQ_INLINE [[gnu::always_inline]] inline

inline float fp16(uint16_t h) { return _cvtsh_ss(h); }
inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }
inline __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline uint32_t load_u32(const void* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t load_u64(const void* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Eight 7-bit sign indices, one per byte (bit 7 clear), to their kSigns7 bytes: bit 7 makes the
// byte's count of set bits even (the parity folds stay inside each byte).
inline uint64_t signs_from_7bit(uint64_t x) {
  uint64_t p = x ^ (x >> 4);
  p ^= p >> 2;
  p ^= p >> 1;
  return x | ((p & 0x0101010101010101ull) << 7);
}

// The sign bytes of two IQ2_XXS / IQ3_XXS sub-blocks from their sign words (four 7-bit indices
// in bits 0..27 of each).
inline uint64_t signs_of_words(uint32_t w_a, uint32_t w_b) {
  const uint64_t packed = (w_a & 0x0fffffffu) | (static_cast<uint64_t>(w_b & 0x0fffffffu) << 28);
  return signs_from_7bit(_pdep_u64(packed, 0x7f7f7f7f7f7f7f7full));
}

// acc + ls * (grid * sign * a), per dword (4 elements each): magnitudes g (unsigned bytes), byte
// k negative where bit k of `neg` is set; ls = the per-dword scales. The positive and negative
// elements are summed apart (negating an activation would wrap at -128); their difference is
// within +-4 * 62 * 128, an int16 with its sign extension in the upper half, so vpdpwssd against
// ls in the low 16 bits of each dword scales and accumulates it exactly in one instruction.
inline __m512i scaled_signed_dot(__m512i acc, __m512i g, __mmask64 neg, __m512i a, __m512i ls) {
  const __m512i pos = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_maskz_mov_epi8(~neg, g), a);
  const __m512i ngt = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_maskz_mov_epi8(neg, g), a);
  return _mm512_dpwssd_epi32(acc, _mm512_sub_epi32(pos, ngt), ls);
}

// Per-block scales: byte k of an xmm = the odd scale 2s+1 of group k (16 elements each, or
// sub-block k for the per-32 formats); a step's per-dword scales are then one shuffle + widen.
inline __m128i odd_bytes(__m128i s) { return _mm_add_epi8(_mm_add_epi8(s, s), _mm_set1_epi8(1)); }
// The 16 nibbles of the low 8 bytes of v, in order (low nibble first).
inline __m128i nibbles16(__m128i v) {
  const __m128i low4 = _mm_set1_epi8(0x0f);
  return _mm_unpacklo_epi8(_mm_and_si128(v, low4), _mm_and_si128(_mm_srli_epi16(v, 4), low4));
}
// Dwords of step c from per-16 scale bytes: dword j <- byte 4c + j/4.
inline __m512i step_scales16(__m128i ls, int c) {
  const __m128i idx = _mm_add_epi8(_mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm_set1_epi8(static_cast<char>(4 * c)));
  return _mm512_cvtepu8_epi32(_mm_shuffle_epi8(ls, idx));
}
// Dwords of step c from per-32 scale bytes: dwords 0..7 <- byte 2c, 8..15 <- byte 2c + 1.
inline __m512i step_scales32(__m128i ls, int c) {
  const __m128i idx = _mm_add_epi8(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), _mm_set1_epi8(static_cast<char>(2 * c)));
  return _mm512_cvtepu8_epi32(_mm_shuffle_epi8(ls, idx));
}
// The scale fields (bits 28..31) of the 32-bit words at p, p + 4, ..., p + 60, as 16 bytes.
inline __m128i top_nibbles16(const void* p) { return _mm512_cvtepi32_epi8(_mm512_srli_epi32(load512(p), 28)); }

// A step's 8 (IQ3: 16) codebook entries, by index(k) for k = 0..7 (0..15), from scalar loads:
// indices come from the block bytes by scalar arithmetic, which measured faster than a vector
// index plus vpgatherqq / vpgatherdd (this Zen 5: IQ3_XXS 2.4 -> 4 GB/s).
template <typename Index>
MORAINE_IQ_INLINE __m512i grid8(const uint64_t* grid, Index index) {
  auto q = [&](int k) { return static_cast<long long>(grid[index(k)]); };
  const __m256i lo = _mm256_set_m128i(_mm_set_epi64x(q(3), q(2)), _mm_set_epi64x(q(1), q(0)));
  const __m256i hi = _mm256_set_m128i(_mm_set_epi64x(q(7), q(6)), _mm_set_epi64x(q(5), q(4)));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
template <typename Index>
MORAINE_IQ_INLINE __m512i grid16(const uint32_t* grid, Index index) {
  auto q = [&](int k) { return static_cast<long long>(grid[index(2 * k)] | (static_cast<uint64_t>(grid[index(2 * k + 1)]) << 32)); };
  const __m256i lo = _mm256_set_m128i(_mm_set_epi64x(q(3), q(2)), _mm_set_epi64x(q(1), q(0)));
  const __m256i hi = _mm256_set_m128i(_mm_set_epi64x(q(7), q(6)), _mm_set_epi64x(q(5), q(4)));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// Four 16-bit codebook indices in a uint64 (lane k = index k): low bytes from the four bytes of
// `lo4`, high bits from `hi`, already placed at bits 8.. of each lane by the caller's pdep mask.
inline uint64_t index_lanes(uint32_t lo4, uint64_t hi_lanes) { return _pdep_u64(lo4, 0x00ff00ff00ff00ffull) | hi_lanes; }

// Indices built in registers with SWAR arithmetic (pdep), stored as 16-bit lanes and read back
// one by one for the table loads: far fewer instructions than extracting each index's bits.
struct IndexLanes {
  uint64_t lane[4];
  uint16_t operator()(int k) const {
    uint16_t v;
    std::memcpy(&v, reinterpret_cast<const uint8_t*>(lane) + 2 * k, 2);
    return v;
  }
};

// A step's decoded weights: codebook bytes (IQ1: biased to 0..2), the sign mask (IQ1_M: the
// deltas' dword mask), the per-dword scales (IQ1_M: ls, and 8 * ls in ls8).
struct Step {
  __m512i g;
  __mmask64 neg;
  __m512i ls, ls8;
};

// Each format is a decoder: prepare (per block, shared by every activation row), decode (per
// step), apply (per step and activation row), and the block's float terms. dot_rows runs one
// weight row against kTok activation rows, decoding each step once for all of them; each row's
// numbers are exactly the single-row kernel's (the same integer sums, the same float order).
struct PlainPrep {
  __m128i ls;
};

struct GridFloat {  // IQ2 / IQ3: acc += (fp16(d) * a.d) * (float)isum
  template <typename Block, typename Prep>
  MORAINE_IQ_INLINE static float scale(const Block& b, const Prep&) { return fp16(b.d); }
  template <typename Block, typename Prep>
  MORAINE_IQ_INLINE static __m512i block_init(const Block&, const Prep&, const BlockQ8_K&) { return _mm512_setzero_si512(); }
  MORAINE_IQ_INLINE static float value(int total) { return static_cast<float>(total); }
  MORAINE_IQ_INLINE static __m512i apply(__m512i acc, const Step& s, __m512i q8) { return scaled_signed_dot(acc, s.g, s.neg, q8, s.ls); }
};

struct Iq2xxs : GridFloat {
  using Block = BlockIQ2_XXS;
  using Prep = PlainPrep;
  static constexpr float kFactor = 0.125f;
  // Words 2s + 1 of qs hold sub-block s's scale: keep the odd bytes.
  MORAINE_IQ_INLINE static Prep prepare(const Block& b) {
    return {odd_bytes(_mm_shuffle_epi8(top_nibbles16(b.qs), _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, -1, -1, -1, -1, -1, -1, -1, -1)))};
  }
  MORAINE_IQ_INLINE static Step decode(const Block& b, int c, const Prep& p) {
    const uint8_t* q = reinterpret_cast<const uint8_t*>(b.qs) + 16 * c;  // two sub-blocks: idx, signs+scale, idx, signs+scale
    return {grid8(iq::kIq2xxsGrid, [q](int k) { return q[k + (k & 4)]; }), signs_of_words(load_u32(q + 4), load_u32(q + 12)),
            step_scales32(p.ls, c), _mm512_setzero_si512()};
  }
};

struct Iq2xs : GridFloat {
  using Block = BlockIQ2_XS;
  using Prep = PlainPrep;
  static constexpr float kFactor = 0.125f;
  MORAINE_IQ_INLINE static Prep prepare(const Block& b) { return {odd_bytes(nibbles16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.scales))))}; }
  MORAINE_IQ_INLINE static Step decode(const Block& b, int c, const Prep& p) {
    const uint16_t* q = b.qs + 8 * c;
    const __m128i s7 = _mm_srli_epi16(load128(q), 9);
    const uint64_t signs = signs_from_7bit(static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_packus_epi16(s7, s7))));
    return {grid8(iq::kIq2xsGrid, [q](int k) { return q[k] & 511; }), signs, step_scales16(p.ls, c), _mm512_setzero_si512()};
  }
};

struct Iq2s : GridFloat {
  using Block = BlockIQ2_S;
  using Prep = PlainPrep;
  static constexpr float kFactor = 0.125f;
  MORAINE_IQ_INLINE static Prep prepare(const Block& b) { return {odd_bytes(nibbles16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.scales))))}; }
  MORAINE_IQ_INLINE static Step decode(const Block& b, int c, const Prep& p) {
    const uint64_t lo = load_u64(b.qs + 8 * c);
    constexpr uint64_t kHigh2 = 0x0300030003000300ull;
    const IndexLanes idx{{index_lanes(static_cast<uint32_t>(lo), _pdep_u64(b.qh[2 * c], kHigh2)),
                          index_lanes(static_cast<uint32_t>(lo >> 32), _pdep_u64(b.qh[2 * c + 1], kHigh2)), 0, 0}};
    return {grid8(iq::kIq2sGrid, idx), load_u64(b.qs + 32 + 8 * c), step_scales16(p.ls, c), _mm512_setzero_si512()};
  }
};

struct Iq3xxs : GridFloat {
  using Block = BlockIQ3_XXS;
  using Prep = PlainPrep;
  static constexpr float kFactor = 0.25f;
  MORAINE_IQ_INLINE static Prep prepare(const Block& b) {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 64));
    return {odd_bytes(_mm256_cvtepi32_epi8(_mm256_srli_epi32(words, 28)))};
  }
  MORAINE_IQ_INLINE static Step decode(const Block& b, int c, const Prep& p) {
    const uint8_t* q = b.qs + 16 * c;
    return {grid16(iq::kIq3xxsGrid, [q](int k) { return q[k]; }), signs_of_words(load_u32(b.qs + 64 + 8 * c), load_u32(b.qs + 68 + 8 * c)),
            step_scales32(p.ls, c), _mm512_setzero_si512()};
  }
};

struct Iq3s : GridFloat {
  using Block = BlockIQ3_S;
  using Prep = PlainPrep;
  static constexpr float kFactor = 1.0f;
  MORAINE_IQ_INLINE static Prep prepare(const Block& b) {
    return {odd_bytes(nibbles16(_mm_cvtsi32_si128(static_cast<int>(load_u32(b.scales)))))};  // bytes 0..7: sub-blocks 0..7
  }
  MORAINE_IQ_INLINE static Step decode(const Block& b, int c, const Prep& p) {
    const uint64_t lo0 = load_u64(b.qs + 16 * c), lo1 = load_u64(b.qs + 16 * c + 8);
    const uint32_t qh = b.qh[2 * c] | (static_cast<uint32_t>(b.qh[2 * c + 1]) << 8);  // bit q: index q's ninth bit
    constexpr uint64_t kHigh1 = 0x0100010001000100ull;
    const IndexLanes idx{{index_lanes(static_cast<uint32_t>(lo0), _pdep_u64(qh, kHigh1)),
                          index_lanes(static_cast<uint32_t>(lo0 >> 32), _pdep_u64(qh >> 4, kHigh1)),
                          index_lanes(static_cast<uint32_t>(lo1), _pdep_u64(qh >> 8, kHigh1)),
                          index_lanes(static_cast<uint32_t>(lo1 >> 32), _pdep_u64(qh >> 12, kHigh1))}};
    return {grid16(iq::kIq3sGrid, idx), load_u64(b.signs + 8 * c), step_scales32(p.ls, c), _mm512_setzero_si512()};
  }
};

// IQ1: grid values -1..1 biased to 0..2 (unsigned for vpdpbusd); the bias comes back through
// the step's plain activation sums (vpdpbusd with ones). The reference's (float)isum + 1/8 *
// (float)dsum equals (float)(8 * isum + dsum) / 8 bit for bit while |8 isum + dsum| < 2^24
// (both sides are then that value exactly; here at most 8 * 491520 + 8 * 15 * 65536), so the
// grid sums are scaled by 8 * ls and the deltas' sums by ls into one accumulator.
inline __m512i biased_grid8(const uint64_t* lanes_grid, const IndexLanes& idx) { return _mm512_add_epi8(grid8(lanes_grid, idx), _mm512_set1_epi8(1)); }
inline __m512i unbiased_sums(__m512i g, __m512i q8, __m512i plain) {
  return _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), g, q8), plain);  // dword sums within +-1024: int16
}
inline __m512i plain_sums(__m512i q8) { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), q8); }

struct Iq1s {
  using Block = BlockIQ1_S;
  struct Prep {
    __m128i ls8;        // 8 * ls per sub-block, bytes
    __m256i per_bsum;   // +-ls per bsum (16 words)
  };
  static constexpr float kFactor = 1.0f;
  // Sub-block s: ls = 2 * (qh[s] >> 12 & 7) + 1; the delta's sign is bit 15.
  MORAINE_IQ_INLINE static Prep prepare(const Block& b) {
    const __m128i qh = load128(b.qh);
    const __m128i ls16 = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(qh, 12), _mm_set1_epi16(7)), 1), _mm_set1_epi16(1));
    const __m128i neg = _mm_srai_epi16(qh, 15);
    const __m128i signed_ls = _mm_sub_epi16(_mm_xor_si128(ls16, neg), neg);
    return {_mm_packus_epi16(_mm_slli_epi16(ls16, 3), _mm_setzero_si128()),
            _mm256_set_m128i(_mm_unpackhi_epi16(signed_ls, signed_ls), _mm_unpacklo_epi16(signed_ls, signed_ls))};
  }
  MORAINE_IQ_INLINE static float scale(const Block& b, const Prep&) { return fp16(b.d); }
  // The deltas: sum over s of +-ls * (bsums[2s] + bsums[2s+1]), as the reference takes them.
  MORAINE_IQ_INLINE static __m512i block_init(const Block&, const Prep& p, const BlockQ8_K& a) {
    return _mm512_zextsi256_si512(_mm256_madd_epi16(p.per_bsum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsums))));
  }
  MORAINE_IQ_INLINE static Step decode(const Block& b, int c, const Prep& p) {
    const uint64_t lo = load_u64(b.qs + 8 * c);
    const uint32_t h = b.qh[2 * c] | (static_cast<uint32_t>(b.qh[2 * c + 1]) << 16);
    constexpr uint64_t kHigh3 = 0x0700070007000700ull;
    const IndexLanes idx{{index_lanes(static_cast<uint32_t>(lo), _pdep_u64(h, kHigh3)),
                          index_lanes(static_cast<uint32_t>(lo >> 32), _pdep_u64(h >> 16, kHigh3)), 0, 0}};
    return {biased_grid8(iq::kIq1sGrid, idx), 0, step_scales32(p.ls8, c), _mm512_setzero_si512()};
  }
  MORAINE_IQ_INLINE static __m512i apply(__m512i acc, const Step& s, __m512i q8) { return _mm512_dpwssd_epi32(acc, unbiased_sums(s.g, q8, plain_sums(q8)), s.ls); }
  MORAINE_IQ_INLINE static float value(int total) { return static_cast<float>(total) * iq::kIq1Delta; }
};

struct Iq1m {
  using Block = BlockIQ1_M;
  struct Prep {
    __m128i ls, ls8;  // per 16 elements; 8 * 15 fits a byte
    float d;          // the fp16 block scale from the top nibbles
  };
  static constexpr float kFactor = 1.0f;
  MORAINE_IQ_INLINE static Prep prepare(const Block& b) {
    const uint64_t sc = load_u64(b.scales);
    const auto d = static_cast<uint16_t>(((sc >> 12) & 0x000f) | ((sc >> 24) & 0x00f0) | ((sc >> 36) & 0x0f00) | ((sc >> 48) & 0xf000));
    // Sixteen 3-bit scales (bits 0..11 of each 16-bit word), one byte each.
    const uint64_t fields = _pext_u64(sc, 0x0fff0fff0fff0fffull);
    const __m128i s16 = _mm_set_epi64x(static_cast<long long>(_pdep_u64(fields >> 24, 0x0707070707070707ull)),
                                       static_cast<long long>(_pdep_u64(fields, 0x0707070707070707ull)));
    const __m128i ls = odd_bytes(s16);
    return {ls, _mm_slli_epi16(ls, 3), fp16(d)};
  }
  MORAINE_IQ_INLINE static float scale(const Block&, const Prep& p) { return p.d; }
  MORAINE_IQ_INLINE static __m512i block_init(const Block&, const Prep&, const BlockQ8_K&) { return _mm512_setzero_si512(); }
  MORAINE_IQ_INLINE static Step decode(const Block& b, int c, const Prep& p) {
    const uint64_t lo = load_u64(b.qs + 8 * c);
    const uint32_t qh = load_u32(b.qh + 4 * c);  // nibble k: group k's index bits 8..10 and delta sign (bit 3)
    const uint32_t high3 = _pext_u32(qh, 0x77777777u);
    constexpr uint64_t kHigh3 = 0x0700070007000700ull;
    const IndexLanes idx{{index_lanes(static_cast<uint32_t>(lo), _pdep_u64(high3, kHigh3)),
                          index_lanes(static_cast<uint32_t>(lo >> 32), _pdep_u64(high3 >> 12, kHigh3)), 0, 0}};
    const uint64_t neg16 = _pdep_u32(_pext_u32(qh, 0x88888888u), 0x5555u) * 3u;  // two dwords per group of 8
    return {biased_grid8(iq::kIq1sGrid, idx), neg16, step_scales16(p.ls, c), step_scales16(p.ls8, c)};
  }
  MORAINE_IQ_INLINE static __m512i apply(__m512i acc, const Step& s, __m512i q8) {
    const __m512i plain = plain_sums(q8);
    acc = _mm512_dpwssd_epi32(acc, unbiased_sums(s.g, q8, plain), s.ls8);
    const __m512i delta = _mm512_mask_sub_epi32(plain, static_cast<__mmask16>(s.neg), _mm512_setzero_si512(), plain);
    return _mm512_dpwssd_epi32(acc, delta, s.ls);
  }
  MORAINE_IQ_INLINE static float value(int total) { return static_cast<float>(total) * iq::kIq1Delta; }
};

template <typename D, int kTok>
void dot_rows(int64_t n, const void* vw, const void* const* acts, float* out) {
  const auto* w = static_cast<const typename D::Block*>(vw);
  const BlockQ8_K* a[kTok];
  for (int t = 0; t < kTok; ++t) a[t] = static_cast<const BlockQ8_K*>(acts[t]);
  float acc[kTok];
  for (float& v : acc) v = 0.0f;
  for (int64_t b = 0; b < n / kQK_K; ++b) {
    const typename D::Prep prep = D::prepare(w[b]);
    __m512i isum[kTok];
    for (int t = 0; t < kTok; ++t) isum[t] = D::block_init(w[b], prep, a[t][b]);
    for (int c = 0; c < 4; ++c) {
      const Step s = D::decode(w[b], c, prep);
      for (int t = 0; t < kTok; ++t) isum[t] = D::apply(isum[t], s, load512(a[t][b].qs + 64 * c));
    }
    const float dw = D::scale(w[b], prep);
    for (int t = 0; t < kTok; ++t) acc[t] += (dw * a[t][b].d) * D::value(_mm512_reduce_add_epi32(isum[t]));
  }
  for (int t = 0; t < kTok; ++t) out[t] = D::kFactor == 1.0f ? acc[t] : D::kFactor * acc[t];
}

template <typename D>
float dot_one(int64_t n, const void* w, const void* a) {
  float out;
  dot_rows<D, 1>(n, w, &a, &out);
  return out;
}

// Four weight rows x n_tok activation rows (matvec_tokens' tile contract): each row's step
// decoded once per group of up to 8 tokens.
template <typename D>
void rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride) {
  for (int r = 0; r < 4; ++r) {
    const void* row = static_cast<const uint8_t*>(w) + static_cast<size_t>(r) * row_stride;
    for (int t0 = 0; t0 < n_tok;) {
      float out[8];
      const int left = n_tok - t0;
      const int nt = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
      switch (nt) {
        case 8: dot_rows<D, 8>(n, row, acts + t0, out); break;
        case 4: dot_rows<D, 4>(n, row, acts + t0, out); break;
        case 2: dot_rows<D, 2>(n, row, acts + t0, out); break;
        default: dot_rows<D, 1>(n, row, acts + t0, out); break;
      }
      for (int t = 0; t < nt; ++t) y[(t0 + t) * y_stride + r] = out[t];
      t0 += nt;
    }
  }
}

}  // namespace

float dot_iq2_xxs(int64_t n, const void* w, const void* a) { return dot_one<Iq2xxs>(n, w, a); }
float dot_iq2_xs(int64_t n, const void* w, const void* a) { return dot_one<Iq2xs>(n, w, a); }
float dot_iq2_s(int64_t n, const void* w, const void* a) { return dot_one<Iq2s>(n, w, a); }
float dot_iq3_xxs(int64_t n, const void* w, const void* a) { return dot_one<Iq3xxs>(n, w, a); }
float dot_iq3_s(int64_t n, const void* w, const void* a) { return dot_one<Iq3s>(n, w, a); }
float dot_iq1_s(int64_t n, const void* w, const void* a) { return dot_one<Iq1s>(n, w, a); }
float dot_iq1_m(int64_t n, const void* w, const void* a) { return dot_one<Iq1m>(n, w, a); }

void iq2_xxs_rows4(int64_t n, const void* w, size_t rs, const void* const* a, int nt, float* y, int64_t ys) { rows4<Iq2xxs>(n, w, rs, a, nt, y, ys); }
void iq2_xs_rows4(int64_t n, const void* w, size_t rs, const void* const* a, int nt, float* y, int64_t ys) { rows4<Iq2xs>(n, w, rs, a, nt, y, ys); }
void iq2_s_rows4(int64_t n, const void* w, size_t rs, const void* const* a, int nt, float* y, int64_t ys) { rows4<Iq2s>(n, w, rs, a, nt, y, ys); }
void iq3_xxs_rows4(int64_t n, const void* w, size_t rs, const void* const* a, int nt, float* y, int64_t ys) { rows4<Iq3xxs>(n, w, rs, a, nt, y, ys); }
void iq3_s_rows4(int64_t n, const void* w, size_t rs, const void* const* a, int nt, float* y, int64_t ys) { rows4<Iq3s>(n, w, rs, a, nt, y, ys); }
void iq1_s_rows4(int64_t n, const void* w, size_t rs, const void* const* a, int nt, float* y, int64_t ys) { rows4<Iq1s>(n, w, rs, a, nt, y, ys); }
void iq1_m_rows4(int64_t n, const void* w, size_t rs, const void* const* a, int nt, float* y, int64_t ys) { rows4<Iq1m>(n, w, rs, a, nt, y, ys); }

}  // namespace moraine::cpu::avx512
