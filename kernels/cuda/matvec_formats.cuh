// Per-format pieces of the matrix-vector kernel (matvec.cu). A weight block is split into
// kParts parts, one lane each; part() returns the part's exact integer sums, which the lanes of
// one block add by shuffles (integers: order-free), and term() turns them into the block's float
// contribution with the reference's exact float expression, using the _rn intrinsics so nvcc
// cannot fuse or reorder it. Scalar references (same expressions, same integer sums):
//   Q8_0: dot_q8_0_q8_0, MXFP4: dot_mxfp4_q8_0 in common/formats/quant_legacy.cpp
//   Q2_K: dot_q2_k_q8_k, Q3_K: dot_q3_k_q8_k, Q4_K, Q5_K: dot_q45_k, Q6_K: dot_q6_k_q8_k in
//   common/formats/kquant_reference.cpp
// Bit layouts: common/formats/block_layouts.h.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "common/formats/block_layouts.h"

namespace moraine::cuda::matvec_detail {

__device__ __forceinline__ float half_bits_to_float(uint16_t h) { return __half2float(__ushort_as_half(h)); }

__device__ __forceinline__ int load_i32_a4(const void* p) { return *reinterpret_cast<const int*>(p); }

// 16 bytes from an address with no alignment (MXFP4, Q8_0, Q6_K blocks are 17, 34, 210 bytes):
// five aligned 4-byte words and funnel shifts, instead of 16 byte or 8 halfword loads. Reads up
// to 3 bytes past p + 16, which the staging buffers leave room for (one spare word each).
__device__ __forceinline__ void load_16_unaligned(const uint8_t* p, int out[4]) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  const uint32_t* base = reinterpret_cast<const uint32_t*>(addr & ~uintptr_t{3});
  const unsigned shift = 8u * static_cast<unsigned>(addr & 3);
  uint32_t w[5];
#pragma unroll
  for (int i = 0; i < 5; ++i) w[i] = base[i];
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = static_cast<int>(__funnelshift_r(w[i], w[i + 1], shift));
}

// Four E2M1 codes (one per byte, 0..15) to the doubled values ggml uses (kE2M1Doubled), one
// signed byte each: the magnitude from an 8-entry byte table with __byte_perm (the selector
// wants the four 3-bit indices as consecutive nibbles), then bytes with the sign bit negated.
__device__ __forceinline__ int e2m1_doubled4(uint32_t codes) {
  constexpr uint32_t kMagLo = 0x03020100u, kMagHi = 0x0c080604u;  // 0,1,2,3 | 4,6,8,12
  const uint32_t idx = codes & 0x07070707u;
  const uint32_t spread = idx | (idx >> 4);  // nibbles: i0, i1, i1, i2, i2, i3, i3, 0
  const uint32_t sel = (spread & 0xffu) | ((spread >> 8) & 0xff00u);
  const uint32_t mag = __byte_perm(kMagLo, kMagHi, sel);
  const uint32_t neg = ((codes >> 3) & 0x01010101u) * 0xffu;
  return static_cast<int>(__vsub4(mag ^ neg, neg));  // per byte: neg ? -mag : mag
}

// Q4_K/Q5_K packed 6-bit scale and min of sub-block j (kquant::unpack_scale_min's layout).
__device__ __forceinline__ void scale_min_k4(const uint8_t* packed, int j, int& sc, int& m) {
  if (j < 4) {
    sc = packed[j] & 63;
    m = packed[j + 4] & 63;
  } else {
    sc = (packed[j + 4] & 0x0f) | ((packed[j - 4] >> 6) << 4);
    m = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
  }
}

struct FormatQ8_0 {
  using Act = BlockQ8_0;
  static constexpr int kBlockBytes = sizeof(BlockQ8_0);
  static constexpr int kParts = 1;
  __device__ static void part(const uint8_t* wb, const Act& a, int, int& isum, int&) {
    const uint8_t* aq = reinterpret_cast<const uint8_t*>(a.qs);
    int dot = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int wq[4], av[4];
      load_16_unaligned(wb + 2 + 16 * h, wq);
      load_16_unaligned(aq + 16 * h, av);
#pragma unroll
      for (int i = 0; i < 4; ++i) dot = __dp4a(wq[i], av[i], dot);
    }
    isum = dot;
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int) {
    const float dw = half_bits_to_float(*reinterpret_cast<const uint16_t*>(wb));
    return __fmul_rn(__int2float_rn(isum), __fmul_rn(dw, half_bits_to_float(a.d)));
  }
};

// Q8_0 rows whose weight and activation rows both start 4-byte aligned, with an even block count,
// are read as block pairs: for each run of 64 blocks, lane p reads the pair (2p, 2p + 1). A pair
// is 68 bytes = 17 aligned words and lanes are 17 words apart (17 is odd): each 4-byte
// shared-memory load of the warp hits 32 distinct banks, 34 loads per 64 blocks for weights and
// activations together. FormatQ8_0's per-block lanes sit 34 bytes apart (2-way bank conflicts)
// and funnel five words per 16 bytes: 40 loads per 32 blocks, about 2.4x the shared-memory
// cycles, which ncu-timed 5120 x 2048 (11 MB) at 7.7 us against 5.0 us for a plain read of the
// same bytes.
// The block terms then move by shuffles to the lane the per-block path gives them (block b to
// lane b % 32), and each lane adds its terms in increasing block order: the float sum is the
// per-block path's, bit for bit. Summing in pair order instead moved group_cuda_test's kmix
// cases from 9.5e-7 to 0.077 of max |logit| against the reference executor (session 5, run F):
// an order change amplified by Q8 re-quantization downstream, so the order is kept.
__device__ __forceinline__ float q8_0_dot_pairs(const uint8_t* wrow, const uint8_t* arow, int nblocks, int lane) {
  const uint32_t* w32 = reinterpret_cast<const uint32_t*>(wrow);
  const uint32_t* a32 = reinterpret_cast<const uint32_t*>(arow);
  float acc = 0.0f;
  for (int b0 = 0; b0 < nblocks; b0 += 64) {  // uniform per warp: every lane shuffles
    const int p = b0 / 2 + lane;               // this lane's pair
    float t_even = 0.0f, t_odd = 0.0f;
    if (2 * p < nblocks) {                      // nblocks is even: both blocks exist
      const uint32_t* wp = w32 + 17 * p;
      const uint32_t* ap = a32 + 17 * p;
      // Block 2p: d in the low half of word 0, quants in bytes 2..33 (words 0..8, 2 bytes off).
      int dot = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        dot = __dp4a(static_cast<int>(__funnelshift_r(wp[i], wp[i + 1], 16)),
                     static_cast<int>(__funnelshift_r(ap[i], ap[i + 1], 16)), dot);
      t_even = __fmul_rn(__int2float_rn(dot), __fmul_rn(half_bits_to_float(static_cast<uint16_t>(wp[0] & 0xffffu)),
                                                        half_bits_to_float(static_cast<uint16_t>(ap[0] & 0xffffu))));
      // Block 2p + 1: d in the high half of word 8, quants in words 9..16.
      dot = 0;
#pragma unroll
      for (int i = 9; i < 17; ++i) dot = __dp4a(static_cast<int>(wp[i]), static_cast<int>(ap[i]), dot);
      t_odd = __fmul_rn(__int2float_rn(dot), __fmul_rn(half_bits_to_float(static_cast<uint16_t>(wp[8] >> 16)),
                                                       half_bits_to_float(static_cast<uint16_t>(ap[8] >> 16))));
    }
    // Block b0 + lane sits in pair lane / 2, block b0 + 32 + lane in pair 16 + lane / 2.
    const bool odd = lane & 1;
    const float lo_e = __shfl_sync(0xffffffffu, t_even, lane / 2), lo_o = __shfl_sync(0xffffffffu, t_odd, lane / 2);
    const float hi_e = __shfl_sync(0xffffffffu, t_even, 16 + lane / 2);
    const float hi_o = __shfl_sync(0xffffffffu, t_odd, 16 + lane / 2);
    if (b0 + lane < nblocks) acc += odd ? lo_o : lo_e;
    if (b0 + 32 + lane < nblocks) acc += odd ? hi_o : hi_e;
  }
  return acc;
}

struct FormatMXFP4 {
  using Act = BlockQ8_0;
  static constexpr int kBlockBytes = sizeof(BlockMXFP4);
  static constexpr int kParts = 1;
  __device__ static void part(const uint8_t* wb, const Act& a, int, int& isum, int&) {
    int q[4];
    load_16_unaligned(wb + 1, q);  // element j low nibble of qs[j], j + 16 high nibble
    const uint8_t* aq = reinterpret_cast<const uint8_t*>(a.qs);
    int lo_act[4], hi_act[4];
    load_16_unaligned(aq, lo_act);
    load_16_unaligned(aq + 16, hi_act);
    int dot = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      dot = __dp4a(e2m1_doubled4(static_cast<uint32_t>(q[i]) & 0x0f0f0f0fu), lo_act[i], dot);
      dot = __dp4a(e2m1_doubled4((static_cast<uint32_t>(q[i]) >> 4) & 0x0f0f0f0fu), hi_act[i], dot);
    }
    isum = dot;
  }
  // half::e8m0_to_fp32_half: 2^(e - 128) (the E2M1 values are stored doubled).
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int) {
    const uint32_t e = wb[0];
    const float scale = __uint_as_float(e < 2 ? (0x00200000u << e) : ((e - 1) << 23));
    return __fmul_rn(__int2float_rn(isum), __fmul_rn(scale, half_bits_to_float(a.d)));
  }
};

// Q4_K and Q5_K: part j = sub-block j of 32 elements (its own 6-bit scale and min).
template <bool kHighBit>
struct FormatQ45_K {
  using Act = BlockQ8_K;
  static constexpr int kBlockBytes = kHighBit ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K);
  static constexpr int kParts = 8;
  static constexpr int kQsOffset = kHighBit ? 48 : 16;
  __device__ static void part(const uint8_t* wb, const Act& a, int j, int& isum, int& msum) {
    const int p = j / 2, t = j % 2;
    const uint8_t* qs = wb + kQsOffset + 32 * p;
    const int8_t* aq = a.qs + 32 * j;
    int dot = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      int q = (load_i32_a4(qs + 4 * i) >> (4 * t)) & 0x0f0f0f0f;
      if constexpr (kHighBit) q |= ((load_i32_a4(wb + 16 + 4 * i) >> j) & 0x01010101) << 4;
      dot = __dp4a(q, load_i32_a4(aq + 4 * i), dot);
    }
    int sc, m;
    scale_min_k4(wb + 4, j, sc, m);
    isum = sc * dot;
    msum = m * (a.bsums[2 * j] + a.bsums[2 * j + 1]);
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int msum) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(wb);
    const float d = __fmul_rn(half_bits_to_float(h[0]), a.d);
    const float dmin = __fmul_rn(half_bits_to_float(h[1]), a.d);
    return __fsub_rn(__fmul_rn(d, __int2float_rn(isum)), __fmul_rn(dmin, __int2float_rn(msum)));
  }
};

// Q6_K: part k = elements 32k..32k+31 (h = k/4, s = k%4), i.e. two 16-element sub-blocks.
struct FormatQ6_K {
  using Act = BlockQ8_K;
  static constexpr int kBlockBytes = sizeof(BlockQ6_K);
  static constexpr int kParts = 8;
  __device__ static void part(const uint8_t* wb, const Act& a, int k, int& isum, int&) {
    const int h = k / 4, s = k % 4;
    const uint8_t* ql = wb + 64 * h + 32 * (s % 2);
    const uint8_t* qh = wb + 128 + 32 * h;
    const int8_t* aq = a.qs + 32 * k;
    int lo4[8], hi4[8];
    load_16_unaligned(ql, lo4);
    load_16_unaligned(ql + 16, lo4 + 4);
    load_16_unaligned(qh, hi4);
    load_16_unaligned(qh + 16, hi4 + 4);
    int dot[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int lo = (lo4[i] >> (4 * (s / 2))) & 0x0f0f0f0f;
      const int hi = ((hi4[i] >> (2 * s)) & 0x03030303) << 4;
      const int v = static_cast<int>(__vsub4(static_cast<unsigned>(lo | hi), 0x20202020u));  // q - 32 per byte
      dot[i / 4] = __dp4a(v, load_i32_a4(aq + 4 * i), dot[i / 4]);
    }
    const int8_t* sc = reinterpret_cast<const int8_t*>(wb + 192);
    isum = sc[2 * k] * dot[0] + sc[2 * k + 1] * dot[1];
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int) {
    const float d = __fmul_rn(half_bits_to_float(*reinterpret_cast<const uint16_t*>(wb + 208)), a.d);
    return __fmul_rn(d, __int2float_rn(isum));
  }
};

// Q2_K: part k = elements 32k..32k+31 (h = k/4, s = k%4), i.e. sub-blocks 2k and 2k+1 of 16,
// each with its own 4-bit scale (low nibble) and 4-bit min (high nibble). Blocks are 84 bytes,
// so in a 4-byte aligned row every block and its qs words stay 4-byte aligned.
struct FormatQ2_K {
  using Act = BlockQ8_K;
  static constexpr int kBlockBytes = sizeof(BlockQ2_K);
  static constexpr int kParts = 8;
  __device__ static void part(const uint8_t* wb, const Act& a, int k, int& isum, int& msum) {
    const int h = k / 4, s = k % 4;
    const uint8_t* qs = wb + 16 + 32 * h;
    const int8_t* aq = a.qs + 32 * k;
    int dot[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int q = (load_i32_a4(qs + 4 * i) >> (2 * s)) & 0x03030303;
      dot[i / 4] = __dp4a(q, load_i32_a4(aq + 4 * i), dot[i / 4]);
    }
    const int sc0 = wb[2 * k], sc1 = wb[2 * k + 1];
    isum = (sc0 & 0x0f) * dot[0] + (sc1 & 0x0f) * dot[1];
    msum = (sc0 >> 4) * a.bsums[2 * k] + (sc1 >> 4) * a.bsums[2 * k + 1];
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int msum) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(wb + 80);
    const float d = __fmul_rn(half_bits_to_float(h[0]), a.d);
    const float dmin = __fmul_rn(half_bits_to_float(h[1]), a.d);
    return __fsub_rn(__fmul_rn(d, __int2float_rn(isum)), __fmul_rn(dmin, __int2float_rn(msum)));
  }
};

// Q3_K sub-block scale j: 6 bits stored biased by 32 (kquant::q3k_scale's layout).
__device__ __forceinline__ int q3k_scale(const uint8_t* packed, int j) {
  const int low = j < 8 ? (packed[j] & 0x0f) : (packed[j - 8] >> 4);
  const int high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
  return (low | (high << 4)) - 32;
}

// Q3_K: part k as Q2_K's; value = low 2 bits + 4 * hmask bit k - 4, in -4..3. Blocks are 110
// bytes (2-byte aligned only), hence the unaligned 16-byte loads.
struct FormatQ3_K {
  using Act = BlockQ8_K;
  static constexpr int kBlockBytes = sizeof(BlockQ3_K);
  static constexpr int kParts = 8;
  __device__ static void part(const uint8_t* wb, const Act& a, int k, int& isum, int&) {
    const int h = k / 4, s = k % 4;
    int lo4[8], hm4[8];
    load_16_unaligned(wb + 32 + 32 * h, lo4);
    load_16_unaligned(wb + 32 + 32 * h + 16, lo4 + 4);
    load_16_unaligned(wb, hm4);
    load_16_unaligned(wb + 16, hm4 + 4);
    const int8_t* aq = a.qs + 32 * k;
    int dot[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int lo = (lo4[i] >> (2 * s)) & 0x03030303;
      const int hi = ((hm4[i] >> k) & 0x01010101) << 2;
      const int v = static_cast<int>(__vsub4(static_cast<unsigned>(lo | hi), 0x04040404u));  // q - 4 per byte
      dot[i / 4] = __dp4a(v, load_i32_a4(aq + 4 * i), dot[i / 4]);
    }
    isum = q3k_scale(wb + 96, 2 * k) * dot[0] + q3k_scale(wb + 96, 2 * k + 1) * dot[1];
  }
  __device__ static float term(const uint8_t* wb, const Act& a, int isum, int) {
    const float d = __fmul_rn(half_bits_to_float(*reinterpret_cast<const uint16_t*>(wb + 108)), a.d);
    return __fmul_rn(d, __int2float_rn(isum));
  }
};

}  // namespace moraine::cuda::matvec_detail

// Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0 (issue 26).
#include "kernels/cuda/matvec_formats_legacy.cuh"
