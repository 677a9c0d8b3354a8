// The prefill GEMM's dequantizers (dequantize_weights.cu's slice contract: kBytes per block,
// kSlices 32-element slices, slice(block, k, y) writes elements 32k..32k+31) for the
// importance-matrix grid formats. Slice k = sub-block k; each element is the float of the scalar
// decoder (common/formats/quant_iq.cpp), its operations in its order with _rn intrinsics:
//   IQ2_*, IQ3_XXS: db = (d * (0.5f + s)) * k (k = 0.25f, 0.5f), x = db * v  (per 16 elements)
//   IQ3_S:          dl = d * (2s + 1), x = dl * v
//   IQ1_*:          dl = d * (2s + 1), x = dl * (v + delta), delta = +-0.125f per 8 elements
// with v the signed grid value. The bit layouts are matvec_formats_iq.cuh's.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "common/formats/block_layouts_iq.h"
#include "kernels/cuda/iq_grids_device.cuh"

namespace moraine::cuda::dequant_iq {

__device__ __forceinline__ float half_bits(uint32_t h) { return __half2float(__ushort_as_half(static_cast<unsigned short>(h))); }
__device__ __forceinline__ uint32_t u16_at(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }

// 8 signed grid values of an 8-byte grid entry (g) with sign bits `signs` (bit j: element j
// negative) into v.
__device__ __forceinline__ void signed8(uint2 g, uint32_t signs, int* v) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int m = static_cast<int>(((i < 4 ? g.x : g.y) >> (8 * (i % 4))) & 0xffu);
    v[i] = (signs >> i) & 1u ? -m : m;
  }
}

// ksigns_iq2xs[i] (iq_grids.h kSigns7): the 7 bits and an 8th making the count even.
__device__ __forceinline__ uint32_t signs8(uint32_t signs7) { return signs7 | ((__popc(signs7) & 1u) << 7); }

// IQ2_*, IQ3_XXS: the 32 signed values v of the slice, then the half-step scale per 16.
template <int kQuarterSteps>  // k = kQuarterSteps / 4 (IQ2: 1, IQ3_XXS: 2)
__device__ __forceinline__ void half_step_out(const int* v, float d, uint32_t s_lo, uint32_t s_hi, float* y) {
  constexpr float k = kQuarterSteps * 0.25f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float db = __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, static_cast<float>(h == 0 ? s_lo : s_hi))), k);
#pragma unroll
    for (int i = 0; i < 16; ++i) y[16 * h + i] = __fmul_rn(db, static_cast<float>(v[16 * h + i]));
  }
}

struct DequantIQ2_XXS {
  static constexpr int kBytes = sizeof(BlockIQ2_XXS), kSlices = 8;
  __device__ static void slice(const uint8_t* b, int k, float* y) {
    const uint32_t w0 = u16_at(b + 2 + 8 * k) | (u16_at(b + 4 + 8 * k) << 16);
    const uint32_t w1 = u16_at(b + 6 + 8 * k) | (u16_at(b + 8 + 8 * k) << 16);
    int v[32];
#pragma unroll
    for (int l = 0; l < 4; ++l)
      signed8(iq_device::grid8(iq_device::kIq2xxsGrid, (w0 >> (8 * l)) & 0xffu), signs8((w1 >> (7 * l)) & 127u), v + 8 * l);
    half_step_out<1>(v, half_bits(u16_at(b)), w1 >> 28, w1 >> 28, y);
  }
};

struct DequantIQ2_XS {
  static constexpr int kBytes = sizeof(BlockIQ2_XS), kSlices = 8;
  __device__ static void slice(const uint8_t* b, int k, float* y) {
    int v[32];
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const uint32_t q = u16_at(b + 2 + 2 * (4 * k + l));
      signed8(iq_device::grid8(iq_device::kIq2xsGrid, q & 511u), signs8(q >> 9), v + 8 * l);
    }
    const uint32_t sc = b[66 + k];
    half_step_out<1>(v, half_bits(u16_at(b)), sc & 15u, sc >> 4, y);
  }
};

struct DequantIQ2_S {
  static constexpr int kBytes = sizeof(BlockIQ2_S), kSlices = 8;
  __device__ static void slice(const uint8_t* b, int k, float* y) {
    const uint32_t qh = b[66 + k];
    int v[32];
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const int g = 4 * k + l;
      signed8(iq_device::grid8(iq_device::kIq2sGrid, b[2 + g] | (((qh >> (2 * l)) & 3u) << 8)), b[34 + g], v + 8 * l);
    }
    const uint32_t sc = b[74 + k];
    half_step_out<1>(v, half_bits(u16_at(b)), sc & 15u, sc >> 4, y);
  }
};

// Two 4-byte grid entries as one 8-element entry.
__device__ __forceinline__ uint2 pair4(const uint32_t* grid, uint32_t i0, uint32_t i1) {
  return make_uint2(iq_device::grid4(grid, static_cast<int>(i0)), iq_device::grid4(grid, static_cast<int>(i1)));
}

struct DequantIQ3_XXS {
  static constexpr int kBytes = sizeof(BlockIQ3_XXS), kSlices = 8;
  __device__ static void slice(const uint8_t* b, int k, float* y) {
    const uint32_t w = u16_at(b + 66 + 4 * k) | (u16_at(b + 68 + 4 * k) << 16);
    int v[32];
#pragma unroll
    for (int l = 0; l < 4; ++l)
      signed8(pair4(iq_device::kIq3xxsGrid, b[2 + 8 * k + 2 * l], b[3 + 8 * k + 2 * l]), signs8((w >> (7 * l)) & 127u),
              v + 8 * l);
    half_step_out<2>(v, half_bits(u16_at(b)), w >> 28, w >> 28, y);
  }
};

struct DequantIQ3_S {
  static constexpr int kBytes = sizeof(BlockIQ3_S), kSlices = 8;
  __device__ static void slice(const uint8_t* b, int k, float* y) {
    const uint32_t qh = b[66 + k];
    int v[32];
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const uint32_t i0 = b[2 + 8 * k + 2 * l] | (((qh >> (2 * l)) & 1u) << 8);
      const uint32_t i1 = b[3 + 8 * k + 2 * l] | (((qh >> (2 * l + 1)) & 1u) << 8);
      signed8(pair4(iq_device::kIq3sGrid, i0, i1), b[74 + 4 * k + l], v + 8 * l);
    }
    const uint32_t s = (b[106 + k / 2] >> (4 * (k % 2))) & 15u;
    const float dl = __fmul_rn(half_bits(u16_at(b)), static_cast<float>(2 * s + 1));
#pragma unroll
    for (int i = 0; i < 32; ++i) y[i] = __fmul_rn(dl, static_cast<float>(v[i]));
  }
};

// IQ1: 32 grid values (signed bytes -1..1) and the delta signs per 8, scale fields per 16.
__device__ __forceinline__ void iq1_out(const int* v, const bool* neg, float d, uint32_t s_lo, uint32_t s_hi, float* y) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float dl = __fmul_rn(d, static_cast<float>(2 * (h == 0 ? s_lo : s_hi) + 1));
#pragma unroll
    for (int i = 16 * h; i < 16 * h + 16; ++i)
      y[i] = __fmul_rn(dl, __fadd_rn(static_cast<float>(v[i]), neg[i / 8] ? -0.125f : 0.125f));
  }
}

__device__ __forceinline__ void grid1_values(uint32_t idx, int* v) {
  const uint2 g = iq_device::grid8(iq_device::kIq1sGrid, static_cast<int>(idx));
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = static_cast<int8_t>(((i < 4 ? g.x : g.y) >> (8 * (i % 4))) & 0xffu);
}

struct DequantIQ1_S {
  static constexpr int kBytes = sizeof(BlockIQ1_S), kSlices = 8;
  __device__ static void slice(const uint8_t* b, int k, float* y) {
    const uint32_t qh = u16_at(b + 34 + 2 * k);
    int v[32];
    bool neg[4];
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      grid1_values(b[2 + 4 * k + l] | (((qh >> (3 * l)) & 7u) << 8), v + 8 * l);
      neg[l] = (qh & 0x8000u) != 0;
    }
    const uint32_t s = (qh >> 12) & 7u;
    iq1_out(v, neg, half_bits(u16_at(b)), s, s, y);
  }
};

struct DequantIQ1_M {
  static constexpr int kBytes = sizeof(BlockIQ1_M), kSlices = 8;
  __device__ static void slice(const uint8_t* b, int k, float* y) {
    const uint32_t qh = u16_at(b + 32 + 2 * k);
    int v[32];
    bool neg[4];
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const uint32_t h = qh >> (4 * l);
      grid1_values(b[4 * k + l] | ((h & 7u) << 8), v + 8 * l);
      neg[l] = (h & 8u) != 0;
    }
    const uint32_t s0 = u16_at(b + 48), s1 = u16_at(b + 50), s2 = u16_at(b + 52), s3 = u16_at(b + 54);
    const uint32_t d = (s0 >> 12) | ((s1 >> 8) & 0x00f0u) | ((s2 >> 4) & 0x0f00u) | (s3 & 0xf000u);
    const uint32_t sc = u16_at(b + 48 + 2 * (k / 2)) >> (6 * (k % 2));
    iq1_out(v, neg, half_bits(d), sc & 7u, (sc >> 3) & 7u, y);
  }
};

}  // namespace moraine::cuda::dequant_iq
