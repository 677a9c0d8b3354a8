// Per-format pieces (matvec_formats.cuh's interface) of the 32-element formats Q4_0, Q4_1, Q5_0,
// Q5_1, IQ4_NL and the 256-element IQ4_XS, TQ1_0, TQ2_0 (issue 26). Scalar references, whose
// float expressions term() repeats with _rn intrinsics in the same order:
//   Q4_0: dot_q4_0_q8_0 (common/formats/quant_legacy.cpp)
//   Q4_1, Q5_0, Q5_1: dot_q4_1_q8_1, dot_q5_0_q8_0, dot_q5_1_q8_1 (quant_legacy_extra.cpp)
//   IQ4_NL, IQ4_XS, TQ1_0, TQ2_0: dot_iq4_nl_q8_0, dot_iq4_xs_q8_k, dot_tq1_0_q8_k, dot_tq2_0_q8_k
//   (quant_iq4_tq.cpp)
// Bit layouts: common/formats/block_layouts_legacy_iq4_tq.h.
// IQ4_XS adds one float term per 32-element sub-block, not per block, so its Format sets
// kTermPerPart: part_term() gives sub-block j's term and the kernels add a block's terms in
// sub-block order (matvec.cu, moe_fused_dots.cuh), as the reference does.
// Included at the end of matvec_formats.cuh, whose helpers it uses.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "common/formats/block_layouts.h"

namespace moraine::cuda::matvec_detail {

// Whether Format F adds one float term per part (part_term) rather than one per block (term).
template <class F>
__host__ __device__ constexpr bool term_per_part() {
  if constexpr (requires { F::kTermPerPart; }) {
    return F::kTermPerPart;
  } else {
    return false;
  }
}

// The 16 IQ4_NL grid values (kIQ4NLValues) as int8 bytes, four per word.
inline constexpr uint32_t kIQ4Words[4] = {0xbfad9881u, 0xf6eaddcfu, 0x26190d01u, 0x71594535u};

// Four 4-bit codes (one per byte, 0..15) to their grid values, one signed byte each: the low 3
// bits pick a byte of the lower or upper 8-entry half with __byte_perm (selectors as consecutive
// nibbles, as e2m1_doubled4), bit 3 picks the half.
__device__ __forceinline__ int iq4_values4(uint32_t codes) {
  const uint32_t idx = codes & 0x07070707u;
  const uint32_t spread = idx | (idx >> 4);
  const uint32_t sel = (spread & 0xffu) | ((spread >> 8) & 0xff00u);
  const uint32_t lo = __byte_perm(kIQ4Words[0], kIQ4Words[1], sel);
  const uint32_t hi = __byte_perm(kIQ4Words[2], kIQ4Words[3], sel);
  const uint32_t upper = ((codes >> 3) & 0x01010101u) * 0xffu;
  return static_cast<int>((lo & ~upper) | (hi & upper));
}

// Bits 4b..4b+3 of qh moved to bit 4 of bytes 0..3 (the fifth bit of four Q5 elements).
__device__ __forceinline__ int q5_high4(uint32_t qh, int b) {
  const uint32_t n = (qh >> (4 * b)) & 0x0fu;
  return static_cast<int>(((n * 0x00204081u) & 0x01010101u) << 4);
}

// Integer dot of 32 4/5-bit weights against 32 activation quants: w_lo[i] / w_hi[i] hold
// elements 4i..4i+3 / 16+4i..16+4i+3 as signed bytes; aq the activations (any 2-byte alignment).
__device__ __forceinline__ int dot32_split(const int w_lo[4], const int w_hi[4], const int8_t* aq) {
  int lo_act[4], hi_act[4];
  load_16_unaligned(reinterpret_cast<const uint8_t*>(aq), lo_act);
  load_16_unaligned(reinterpret_cast<const uint8_t*>(aq) + 16, hi_act);
  int dot = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    dot = __dp4a(w_lo[i], lo_act[i], dot);
    dot = __dp4a(w_hi[i], hi_act[i], dot);
  }
  return dot;
}

// Q4_0 (18-byte blocks, 2-byte aligned): x = d * (q - 8).
struct FormatQ4_0 {
  using Act = BlockQ8_0;
  static constexpr int kBlockBytes = sizeof(BlockQ4_0);
  static constexpr int kParts = 1;
  __device__ static void part(const uint8_t* wb, const Act& a, int, int& isum, int&) {
    int q[4], lo[4], hi[4];
    load_16_unaligned(wb + 2, q);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      lo[i] = static_cast<int>(__vsub4(static_cast<uint32_t>(q[i]) & 0x0f0f0f0fu, 0x08080808u));
      hi[i] = static_cast<int>(__vsub4((static_cast<uint32_t>(q[i]) >> 4) & 0x0f0f0f0fu, 0x08080808u));
    }
    isum = dot32_split(lo, hi, a.qs);
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int) {
    const float dw = half_bits_to_float(*reinterpret_cast<const uint16_t*>(wb));
    return __fmul_rn(__int2float_rn(isum), __fmul_rn(dw, half_bits_to_float(a.d)));
  }
};

// Q4_1 (20-byte blocks, 4-byte aligned in 16-byte aligned rows): x = d * q + m, against Q8_1.
struct FormatQ4_1 {
  using Act = BlockQ8_1;
  static constexpr int kBlockBytes = sizeof(BlockQ4_1);
  static constexpr int kParts = 1;
  __device__ static void part(const uint8_t* wb, const Act& a, int, int& isum, int&) {
    int lo[4], hi[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t q = static_cast<uint32_t>(load_i32_a4(wb + 4 + 4 * i));
      lo[i] = static_cast<int>(q & 0x0f0f0f0fu);
      hi[i] = static_cast<int>((q >> 4) & 0x0f0f0f0fu);
    }
    isum = dot32_split(lo, hi, a.qs);
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(wb);
    const float dd = __fmul_rn(half_bits_to_float(h[0]), half_bits_to_float(a.d));
    return __fadd_rn(__fmul_rn(dd, __int2float_rn(isum)), __fmul_rn(half_bits_to_float(h[1]), half_bits_to_float(a.s)));
  }
};

// Q5_0 (22-byte blocks, 2-byte aligned): x = d * (q - 16), q's bit 4 in qh.
struct FormatQ5_0 {
  using Act = BlockQ8_0;
  static constexpr int kBlockBytes = sizeof(BlockQ5_0);
  static constexpr int kParts = 1;
  __device__ static void part(const uint8_t* wb, const Act& a, int, int& isum, int&) {
    const uint16_t* qh16 = reinterpret_cast<const uint16_t*>(wb + 2);
    const uint32_t qh = static_cast<uint32_t>(qh16[0]) | (static_cast<uint32_t>(qh16[1]) << 16);
    int q[4], lo[4], hi[4];
    load_16_unaligned(wb + 6, q);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t l = (static_cast<uint32_t>(q[i]) & 0x0f0f0f0fu) | static_cast<uint32_t>(q5_high4(qh, i));
      const uint32_t h = ((static_cast<uint32_t>(q[i]) >> 4) & 0x0f0f0f0fu) | static_cast<uint32_t>(q5_high4(qh, 4 + i));
      lo[i] = static_cast<int>(__vsub4(l, 0x10101010u));
      hi[i] = static_cast<int>(__vsub4(h, 0x10101010u));
    }
    isum = dot32_split(lo, hi, a.qs);
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int) {
    const float dd = __fmul_rn(half_bits_to_float(*reinterpret_cast<const uint16_t*>(wb)), half_bits_to_float(a.d));
    return __fmul_rn(dd, __int2float_rn(isum));
  }
};

// Q5_1 (24-byte blocks, 8-byte aligned in 16-byte aligned rows): x = d * q + m, against Q8_1.
struct FormatQ5_1 {
  using Act = BlockQ8_1;
  static constexpr int kBlockBytes = sizeof(BlockQ5_1);
  static constexpr int kParts = 1;
  __device__ static void part(const uint8_t* wb, const Act& a, int, int& isum, int&) {
    const uint32_t qh = static_cast<uint32_t>(load_i32_a4(wb + 4));
    int lo[4], hi[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t q = static_cast<uint32_t>(load_i32_a4(wb + 8 + 4 * i));
      lo[i] = static_cast<int>((q & 0x0f0f0f0fu) | static_cast<uint32_t>(q5_high4(qh, i)));
      hi[i] = static_cast<int>(((q >> 4) & 0x0f0f0f0fu) | static_cast<uint32_t>(q5_high4(qh, 4 + i)));
    }
    isum = dot32_split(lo, hi, a.qs);
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int) {
    return FormatQ4_1::term(wb, a, isum, 0);  // d and m lead both blocks; the same expression
  }
};

// IQ4_NL (18-byte blocks, 2-byte aligned): x = d * grid[q].
struct FormatIQ4_NL {
  using Act = BlockQ8_0;
  static constexpr int kBlockBytes = sizeof(BlockIQ4_NL);
  static constexpr int kParts = 1;
  __device__ static void part(const uint8_t* wb, const Act& a, int, int& isum, int&) {
    int q[4], lo[4], hi[4];
    load_16_unaligned(wb + 2, q);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      lo[i] = iq4_values4(static_cast<uint32_t>(q[i]) & 0x0f0f0f0fu);
      hi[i] = iq4_values4((static_cast<uint32_t>(q[i]) >> 4) & 0x0f0f0f0fu);
    }
    isum = dot32_split(lo, hi, a.qs);
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int) {
    const float d = __fmul_rn(half_bits_to_float(a.d), half_bits_to_float(*reinterpret_cast<const uint16_t*>(wb)));
    return __fmul_rn(d, __int2float_rn(isum));
  }
};

// IQ4_XS (136-byte blocks, 8-byte aligned in 16-byte aligned rows): part j = sub-block j, its own
// 6-bit scale ls; term (fp16(d) * a.d * (ls - 32)) * isum per sub-block.
struct FormatIQ4_XS {
  using Act = BlockQ8_K;
  static constexpr int kBlockBytes = sizeof(BlockIQ4_XS);
  static constexpr int kParts = 8;
  static constexpr bool kTermPerPart = true;
  __device__ static float part_term(const uint8_t* wb, const Act& a, int j) {
    const int8_t* aq = a.qs + 32 * j;
    int dot = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t q = static_cast<uint32_t>(load_i32_a4(wb + 8 + 16 * j + 4 * i));
      dot = __dp4a(iq4_values4(q & 0x0f0f0f0fu), load_i32_a4(aq + 4 * i), dot);
      dot = __dp4a(iq4_values4((q >> 4) & 0x0f0f0f0fu), load_i32_a4(aq + 16 + 4 * i), dot);
    }
    const uint16_t scales_h = reinterpret_cast<const uint16_t*>(wb)[1];
    const int ls = ((wb[4 + j / 2] >> (4 * (j % 2))) & 0x0f) | (((scales_h >> (2 * j)) & 3) << 4);
    const float d4d8 = __fmul_rn(half_bits_to_float(*reinterpret_cast<const uint16_t*>(wb)), a.d);
    return __fmul_rn(__fmul_rn(d4d8, __int2float_rn(ls - 32)), __int2float_rn(dot));
  }
};

// TQ1_0 trits of four bytes at position n (p3 = 3^n), as signed bytes t - 1: per byte
// ((uint8_t)(byte * 3^n) * 3) >> 8 (the reference's tq1_trit), two bytes at a time in 16-bit
// lanes (byte * 81 and q * 3 stay below 2^16, so the lanes never carry into each other).
__device__ __forceinline__ int tq1_trits4(uint32_t w, uint32_t p3) {
  const uint32_t even = ((((w & 0x00ff00ffu) * p3) & 0x00ff00ffu) * 3u >> 8) & 0x00ff00ffu;
  const uint32_t odd = (((((w >> 8) & 0x00ff00ffu) * p3) & 0x00ff00ffu) * 3u >> 8) & 0x00ff00ffu;
  return static_cast<int>(__vsub4(even | (odd << 8), 0x01010101u));
}

// 3^n for n in 0..4, without a local-memory table (n is the lane's part).
__device__ __forceinline__ uint32_t pow3(int n) { return n == 0 ? 1u : n == 1 ? 3u : n == 2 ? 9u : n == 3 ? 27u : 81u; }

// TQ1_0 (54-byte blocks, 2-byte aligned): part k = elements 32k..32k+31. k < 5: trit k of
// qs[0..31]; k = 5, 6: trits 2(k-5) and 2(k-5)+1 of qs[32..47]; k = 7: trit 4 of qs[32..47], then
// trits 0..3 of qh[0..3] (elements 240 + 4n + j).
struct FormatTQ1_0 {
  using Act = BlockQ8_K;
  static constexpr int kBlockBytes = sizeof(BlockTQ1_0);
  static constexpr int kParts = 8;
  __device__ static void part(const uint8_t* wb, const Act& a, int k, int& isum, int&) {
    const int8_t* aq = a.qs + 32 * k;
    int dot = 0;
    if (k < 5) {
      int q[8];
      load_16_unaligned(wb, q);
      load_16_unaligned(wb + 16, q + 4);
#pragma unroll
      for (int i = 0; i < 8; ++i) dot = __dp4a(tq1_trits4(static_cast<uint32_t>(q[i]), pow3(k)), load_i32_a4(aq + 4 * i), dot);
    } else {
      int q[4];
      load_16_unaligned(wb + 32, q);
      const int n0 = 2 * (k - 5);
#pragma unroll
      for (int i = 0; i < 4; ++i) dot = __dp4a(tq1_trits4(static_cast<uint32_t>(q[i]), pow3(n0)), load_i32_a4(aq + 4 * i), dot);
      if (k < 7) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
          dot = __dp4a(tq1_trits4(static_cast<uint32_t>(q[i]), pow3(n0 + 1)), load_i32_a4(aq + 16 + 4 * i), dot);
      } else {
        const uint16_t* qh16 = reinterpret_cast<const uint16_t*>(wb + 48);
        const uint32_t qh = static_cast<uint32_t>(qh16[0]) | (static_cast<uint32_t>(qh16[1]) << 16);
#pragma unroll
        for (int n = 0; n < 4; ++n) dot = __dp4a(tq1_trits4(qh, pow3(n)), load_i32_a4(aq + 16 + 4 * n), dot);
      }
    }
    isum = dot;
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int) {
    const float dw = half_bits_to_float(*reinterpret_cast<const uint16_t*>(wb + 52));
    return __fmul_rn(__int2float_rn(isum), __fmul_rn(dw, a.d));
  }
};

// TQ2_0 (66-byte blocks, 2-byte aligned): part k = elements 32k..32k+31 = bits 2l..2l+1 of
// qs[32h..32h+31] (h = k / 4, l = k % 4), value - 1.
struct FormatTQ2_0 {
  using Act = BlockQ8_K;
  static constexpr int kBlockBytes = sizeof(BlockTQ2_0);
  static constexpr int kParts = 8;
  __device__ static void part(const uint8_t* wb, const Act& a, int k, int& isum, int&) {
    const int h = k / 4, l = k % 4;
    int q[8];
    load_16_unaligned(wb + 32 * h, q);
    load_16_unaligned(wb + 32 * h + 16, q + 4);
    const int8_t* aq = a.qs + 32 * k;
    int dot = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t v = __vsub4((static_cast<uint32_t>(q[i]) >> (2 * l)) & 0x03030303u, 0x01010101u);
      dot = __dp4a(static_cast<int>(v), load_i32_a4(aq + 4 * i), dot);
    }
    isum = dot;
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int) {
    const float dw = half_bits_to_float(*reinterpret_cast<const uint16_t*>(wb + 64));
    return __fmul_rn(__int2float_rn(isum), __fmul_rn(a.d, dw));
  }
};

}  // namespace moraine::cuda::matvec_detail
