// Per-format pieces of the matvec (matvec_formats.cuh's contract: part() gives a part's exact
// integer sums, term() the block's float term) for ggml's importance-matrix grid formats:
// IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M against Q8_K activations. Part j = the
// 32-element sub-block j of the 256-element super-block. Scalar reference (same integer sums, same
// float expression): common/formats/quant_iq.cpp; bit layouts: common/formats/block_layouts_iq.h.
//
// Blocks are 50..110 bytes, so in a row only 2-byte alignment holds: fields are read as bytes and
// halfwords. The grid entries come from the device codebooks (iq_grids_device.cuh) through the
// read-only cache; each 8-element group is an entry (IQ3: two 4-element entries) with 8 sign bits
// applied per byte, then __dp4a against the activation quants.
//
// The float term: the reference sums (fp16(d) * a.d) * (float)isum over the blocks and multiplies
// the sum by 0.125 (IQ2_*) or 0.25 (IQ3_XXS) once at the end. Here that factor goes into each
// block's term, after the reference's two products: a multiplication by a power of two is exact
// (no term is near float's subnormal range or overflow), so each term is the reference's one-block
// dot bit for bit and the row differs from the reference only by the order of the additions, as for
// every other format. IQ1_*: (fp16(d) * a.d) * ((float)isum + 0.125f * (float)dsum), the delta sum
// dsum carried in the second integer.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "common/formats/block_layouts_iq.h"
#include "kernels/cuda/iq_grids_device.cuh"
#include "kernels/cuda/matvec_formats.cuh"

namespace moraine::cuda::matvec_detail {

__device__ __forceinline__ uint32_t iq_u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
// A 32-bit little-endian word at a 2-byte aligned address.
__device__ __forceinline__ uint32_t iq_u32_a2(const uint8_t* p) { return iq_u16(p) | (iq_u16(p + 2) << 16); }

// The four bytes of mag with byte i negated where bit i of signs (0..15) is set.
__device__ __forceinline__ int iq_signed4(uint32_t mag, uint32_t signs) {
  const uint32_t neg = __vcmpne4((signs * 0x01010101u) & 0x08040201u, 0u);  // 0xff per negated byte
  return static_cast<int>(__vsub4(mag ^ neg, neg));
}

// ksigns_iq2xs[i]: the 7 stored sign bits and an 8th making the count even (iq_grids.h kSigns7).
__device__ __forceinline__ uint32_t iq_signs8(uint32_t signs7) { return signs7 | ((__popc(signs7) & 1u) << 7); }

// Dot of 8 elements (grid words lo, hi: elements 0..3, 4..7; signs: 8 bits, bit j element j)
// with 8 activation quants at aq (4-byte aligned), added to acc.
__device__ __forceinline__ int iq_dot8(uint32_t lo, uint32_t hi, uint32_t signs, const int8_t* aq, int acc) {
  acc = __dp4a(iq_signed4(lo, signs & 15u), load_i32_a4(aq), acc);
  return __dp4a(iq_signed4(hi, signs >> 4), load_i32_a4(aq + 4), acc);
}

// (fp16(d) * a.d) * (float)isum, then the exact power-of-two factor (header comment).
template <int kFactorLog2>
__device__ __forceinline__ float iq_term(uint32_t d_bits, float a_d, int isum) {
  const float t = __fmul_rn(__fmul_rn(half_bits_to_float(static_cast<uint16_t>(d_bits)), a_d), __int2float_rn(isum));
  if constexpr (kFactorLog2 == 0) {
    return t;
  } else {
    return __fmul_rn(t, static_cast<float>(1.0 / (1 << -kFactorLog2)));
  }
}

// IQ1's term: (fp16(d) * a.d) * ((float)isum + 0.125f * (float)dsum).
__device__ __forceinline__ float iq1_term(uint32_t d_bits, float a_d, int isum, int dsum) {
  const float d = __fmul_rn(half_bits_to_float(static_cast<uint16_t>(d_bits)), a_d);
  return __fmul_rn(d, __fadd_rn(__int2float_rn(isum), __fmul_rn(0.125f, __int2float_rn(dsum))));
}

// IQ2_XXS: sub-block j is the words w0 (4 grid indices) and w1 (4 x 7 sign bits, scale nibble 28..31)
// at qs[4j..4j+3].
struct FormatIQ2_XXS {
  using Act = BlockQ8_K;
  static constexpr int kBlockBytes = sizeof(BlockIQ2_XXS);
  static constexpr int kParts = 8;
  __device__ static void part(const uint8_t* wb, const Act& a, int j, int& isum, int&) {
    const uint32_t w0 = iq_u32_a2(wb + 2 + 8 * j), w1 = iq_u32_a2(wb + 6 + 8 * j);
    const int8_t* aq = a.qs + 32 * j;
    int dot = 0;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const uint2 g = iq_device::grid8(iq_device::kIq2xxsGrid, (w0 >> (8 * l)) & 0xffu);
      dot = iq_dot8(g.x, g.y, iq_signs8((w1 >> (7 * l)) & 127u), aq + 8 * l, dot);
    }
    isum = static_cast<int>(2 * (w1 >> 28) + 1) * dot;
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int) {
    return iq_term<-3>(iq_u16(wb), a.d, isum);
  }
};

// IQ2_XS: group g's halfword qs[g] = 9-bit grid index | 7 sign bits << 9; scales[j] low nibble for
// the first 16 elements of sub-block j, high nibble for the second.
struct FormatIQ2_XS {
  using Act = BlockQ8_K;
  static constexpr int kBlockBytes = sizeof(BlockIQ2_XS);
  static constexpr int kParts = 8;
  __device__ static void part(const uint8_t* wb, const Act& a, int j, int& isum, int&) {
    const int8_t* aq = a.qs + 32 * j;
    int dot[2] = {0, 0};
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const uint32_t q = iq_u16(wb + 2 + 2 * (4 * j + l));
      const uint2 g = iq_device::grid8(iq_device::kIq2xsGrid, q & 511u);
      dot[l / 2] = iq_dot8(g.x, g.y, iq_signs8(q >> 9), aq + 8 * l, dot[l / 2]);
    }
    const uint32_t sc = wb[66 + j];
    isum = static_cast<int>(2 * (sc & 15u) + 1) * dot[0] + static_cast<int>(2 * (sc >> 4) + 1) * dot[1];
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int) {
    return iq_term<-3>(iq_u16(wb), a.d, isum);
  }
};

// IQ2_S: group g = 4j + l: grid index qs[g] | ((qh[j] >> 2l) & 3) << 8, its sign byte qs[32 + g];
// scales as IQ2_XS.
struct FormatIQ2_S {
  using Act = BlockQ8_K;
  static constexpr int kBlockBytes = sizeof(BlockIQ2_S);
  static constexpr int kParts = 8;
  __device__ static void part(const uint8_t* wb, const Act& a, int j, int& isum, int&) {
    const int8_t* aq = a.qs + 32 * j;
    const uint32_t qs = iq_u32_a2(wb + 2 + 4 * j), signs = iq_u32_a2(wb + 34 + 4 * j), qh = wb[66 + j];
    int dot[2] = {0, 0};
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const uint32_t idx = ((qs >> (8 * l)) & 0xffu) | (((qh >> (2 * l)) & 3u) << 8);
      const uint2 g = iq_device::grid8(iq_device::kIq2sGrid, idx);
      dot[l / 2] = iq_dot8(g.x, g.y, (signs >> (8 * l)) & 0xffu, aq + 8 * l, dot[l / 2]);
    }
    const uint32_t sc = wb[74 + j];
    isum = static_cast<int>(2 * (sc & 15u) + 1) * dot[0] + static_cast<int>(2 * (sc >> 4) + 1) * dot[1];
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int) {
    return iq_term<-3>(iq_u16(wb), a.d, isum);
  }
};

// IQ3_XXS: sub-block j's 8 grid indices (4 elements each) at qs[8j..8j+7], its sign/scale word at
// qs[64 + 4j] (4 x 7 sign bits, one per 8 elements, scale nibble 28..31).
struct FormatIQ3_XXS {
  using Act = BlockQ8_K;
  static constexpr int kBlockBytes = sizeof(BlockIQ3_XXS);
  static constexpr int kParts = 8;
  __device__ static void part(const uint8_t* wb, const Act& a, int j, int& isum, int&) {
    const int8_t* aq = a.qs + 32 * j;
    const uint32_t w = iq_u32_a2(wb + 66 + 4 * j);
    int dot = 0;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const uint32_t lo = iq_device::grid4(iq_device::kIq3xxsGrid, wb[2 + 8 * j + 2 * l]);
      const uint32_t hi = iq_device::grid4(iq_device::kIq3xxsGrid, wb[3 + 8 * j + 2 * l]);
      dot = iq_dot8(lo, hi, iq_signs8((w >> (7 * l)) & 127u), aq + 8 * l, dot);
    }
    isum = static_cast<int>(2 * (w >> 28) + 1) * dot;
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int) {
    return iq_term<-2>(iq_u16(wb), a.d, isum);
  }
};

// IQ3_S: quad q of sub-block j: grid index qs[8j + q] | ((qh[j] >> q) & 1) << 8; sign byte
// signs[4j + l] for elements 8l..8l+7; scale nibble j % 2 of scales[j / 2].
struct FormatIQ3_S {
  using Act = BlockQ8_K;
  static constexpr int kBlockBytes = sizeof(BlockIQ3_S);
  static constexpr int kParts = 8;
  __device__ static void part(const uint8_t* wb, const Act& a, int j, int& isum, int&) {
    const int8_t* aq = a.qs + 32 * j;
    const uint32_t qh = wb[66 + j], signs = iq_u32_a2(wb + 74 + 4 * j);
    int dot = 0;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const int q = 2 * l;
      const uint32_t lo = iq_device::grid4(iq_device::kIq3sGrid, wb[2 + 8 * j + q] | (((qh >> q) & 1u) << 8));
      const uint32_t hi = iq_device::grid4(iq_device::kIq3sGrid, wb[3 + 8 * j + q] | (((qh >> (q + 1)) & 1u) << 8));
      dot = iq_dot8(lo, hi, (signs >> (8 * l)) & 0xffu, aq + 8 * l, dot);
    }
    const uint32_t sc = (wb[106 + j / 2] >> (4 * (j % 2))) & 15u;
    isum = static_cast<int>(2 * sc + 1) * dot;
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int) {
    return iq_term<0>(iq_u16(wb), a.d, isum);
  }
};

// IQ1_S: group l of sub-block j: grid index qs[4j + l] | ((qh[j] >> 3l) & 7) << 8 (signed grid
// bytes -1..1); qh[j] bits 12..14 the scale, bit 15 the delta's sign. msum carries the delta sum
// ls * sign * (the sub-block's two activation bsums), as the reference forms it.
struct FormatIQ1_S {
  using Act = BlockQ8_K;
  static constexpr int kBlockBytes = sizeof(BlockIQ1_S);
  static constexpr int kParts = 8;
  __device__ static void part(const uint8_t* wb, const Act& a, int j, int& isum, int& msum) {
    const int8_t* aq = a.qs + 32 * j;
    const uint32_t qs = iq_u32_a2(wb + 2 + 4 * j), qh = iq_u16(wb + 34 + 2 * j);
    int dot = 0;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const uint2 g = iq_device::grid8(iq_device::kIq1sGrid, ((qs >> (8 * l)) & 0xffu) | (((qh >> (3 * l)) & 7u) << 8));
      dot = __dp4a(static_cast<int>(g.x), load_i32_a4(aq + 8 * l), dot);
      dot = __dp4a(static_cast<int>(g.y), load_i32_a4(aq + 8 * l + 4), dot);
    }
    const int ls = static_cast<int>(2 * ((qh >> 12) & 7u) + 1);
    isum = ls * dot;
    const int bs = a.bsums[2 * j] + a.bsums[2 * j + 1];
    msum = ls * ((qh & 0x8000u) ? -bs : bs);
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int msum) {
    return iq1_term(iq_u16(wb), a.d, isum, msum);
  }
};

// IQ1_M: group l of sub-block j: grid index qs[4j + l] | (h & 7) << 8 with h = qh[2j + l/2] >>
// 4(l%2), delta sign h bit 3 (per 8 elements); 3-bit scales per 16 elements in the low 12 bits of
// the four scale halfwords, the fp16 block scale in their top nibbles. msum: the delta sum
// ls * sign * (sum of the group's 8 activation quants), summed from the quants as the reference does.
struct FormatIQ1_M {
  using Act = BlockQ8_K;
  static constexpr int kBlockBytes = sizeof(BlockIQ1_M);
  static constexpr int kParts = 8;
  __device__ static void part(const uint8_t* wb, const Act& a, int j, int& isum, int& msum) {
    const int8_t* aq = a.qs + 32 * j;
    const uint32_t qs = iq_u32_a2(wb + 4 * j), qh = iq_u16(wb + 32 + 2 * j);
    const uint32_t sc = iq_u16(wb + 48 + 2 * (j / 2)) >> (6 * (j % 2));
    const int ls[2] = {static_cast<int>(2 * (sc & 7u) + 1), static_cast<int>(2 * ((sc >> 3) & 7u) + 1)};
    int is = 0, ds = 0;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const uint32_t h = qh >> (4 * l);  // qh[2j + l/2] >> 4(l%2)
      const uint2 g = iq_device::grid8(iq_device::kIq1sGrid, ((qs >> (8 * l)) & 0xffu) | ((h & 7u) << 8));
      const int a0 = load_i32_a4(aq + 8 * l), a1 = load_i32_a4(aq + 8 * l + 4);
      const int dot = __dp4a(static_cast<int>(g.y), a1, __dp4a(static_cast<int>(g.x), a0, 0));
      const int s = __dp4a(0x01010101, a1, __dp4a(0x01010101, a0, 0));  // sum of the 8 quants
      is += ls[l / 2] * dot;
      ds += ls[l / 2] * ((h & 8u) ? -s : s);
    }
    isum = is;
    msum = ds;
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int msum) {
    const uint32_t s0 = iq_u16(wb + 48), s1 = iq_u16(wb + 50), s2 = iq_u16(wb + 52), s3 = iq_u16(wb + 54);
    const uint32_t d = (s0 >> 12) | ((s1 >> 8) & 0x00f0u) | ((s2 >> 4) & 0x0f00u) | (s3 & 0xf000u);
    return iq1_term(d, a.d, isum, msum);
  }
};

}  // namespace moraine::cuda::matvec_detail
