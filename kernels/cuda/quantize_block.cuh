// One activation block quantized by one warp, shared by quantize_activations.cu and the fused
// MoE kernel (which quantizes x and the SwiGLU output inside its CTAs), so both give the bytes
// of the scalar reference: quantize_q8_0 (common/formats/quant_legacy.cpp) and quantize_q8_k
// (common/formats/kquant_quantize.cpp); and Q8_0 with llama.cpp's x86 rule, which the reference
// executor uses. Every rounding step uses the explicit round-to-nearest intrinsics (__fdiv_rn,
// __fmul_rn) so nvcc cannot contract or approximate them.
#pragma once
#include <cuda_fp16.h>

#include "common/formats/block_layouts.h"

namespace moraine::cuda::quantize_detail {

// Q8_0, element `lane` of the block in v: d = amax / 127, q = round(x / d) with the
// reference's safe inverse (0 when d is 0 or 1/d overflows) and round-half-away (roundf).
__device__ __forceinline__ void quantize_q8_0_warp(float v, BlockQ8_0& out, int lane) {
  float amax = fabsf(v);
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float d = __fdiv_rn(amax, 127.0f);
  const float r = __fdiv_rn(1.0f, d);
  const float id = (d != 0.0f && isfinite(r)) ? r : 0.0f;
  out.qs[lane] = static_cast<int8_t>(roundf(__fmul_rn(v, id)));
  if (lane == 0) out.d = __half_as_ushort(__float2half_rn(d));
}

// Q8_0 with llama.cpp's x86 run-time rule, the one reference::pack_activations (and so the CPU
// executor) uses (cpu::quantize_activation_row_llama_x86): d = fp16(amax / 127) as above, but
// q = nearest-even(x * (127 / amax)) saturated to int8 (cvtps_epi32 and saturating packs: out of
// range and NaN become -128, reached only when 127/amax overflows, amax below ~7e-37).
__device__ __forceinline__ void quantize_q8_0_llama_warp(float v, BlockQ8_0& out, int lane) {
  float amax = fabsf(v);
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
  const float r = rintf(__fmul_rn(v, id));
  int q = -128;
  if (!isnan(r) && r < 2147483648.0f && r >= -2147483648.0f) q = max(-128, min(127, static_cast<int>(r)));
  out.qs[lane] = static_cast<int8_t>(q);
  if (lane == 0) out.d = __half_as_ushort(__float2half_rn(__fdiv_rn(amax, 127.0f)));
}

// Q8_K, elements 8*lane .. 8*lane+7 of the 256-element block in v. The reference keeps the
// first element of largest magnitude (strict >) as `max`, so ties go to the lowest index.
// `y` must be 4-byte aligned (its float d; qs is written as ints).
__device__ __forceinline__ void quantize_q8_k_warp(const float v[8], BlockQ8_K& y, int lane) {
  float amax = 0.0f;
  int idx = 8 * lane;
  float maxv = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (fabsf(v[i]) > amax) {
      amax = fabsf(v[i]);
      idx = 8 * lane + i;
      maxv = v[i];
    }
  }
  for (int off = 16; off > 0; off /= 2) {
    const float oa = __shfl_xor_sync(0xffffffffu, amax, off);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, off);
    const float ov = __shfl_xor_sync(0xffffffffu, maxv, off);
    if (oa > amax || (oa == amax && oi < idx)) {
      amax = oa;
      idx = oi;
      maxv = ov;
    }
  }
  const float iscale = amax == 0.0f ? 0.0f : __fdiv_rn(-127.0f, maxv);
  if (amax == 0.0f || !isfinite(iscale)) {  // the reference writes an all-zero block
    reinterpret_cast<int*>(y.qs)[2 * lane] = 0;
    reinterpret_cast<int*>(y.qs)[2 * lane + 1] = 0;
    if (lane < 16) y.bsums[lane] = 0;
    if (lane == 0) y.d = 0.0f;
    return;
  }
  int q[8];
  int sum = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    q[i] = min(127, __float2int_rn(__fmul_rn(iscale, v[i])));  // lrint: ties to even
    sum += q[i];
  }
  int packed[2];
#pragma unroll
  for (int w = 0; w < 2; ++w)
    packed[w] = (q[4 * w] & 0xff) | ((q[4 * w + 1] & 0xff) << 8) | ((q[4 * w + 2] & 0xff) << 16) |
                ((q[4 * w + 3] & 0xff) << 24);
  // Q8_K blocks are 292 bytes: qs is only 4-byte aligned, so two int stores, not one int2.
  reinterpret_cast<int*>(y.qs)[2 * lane] = packed[0];
  reinterpret_cast<int*>(y.qs)[2 * lane + 1] = packed[1];
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // two lanes make one 16-element group
  if (lane % 2 == 0) y.bsums[lane / 2] = static_cast<int16_t>(sum);
  if (lane == 0) y.d = __fdiv_rn(1.0f, iscale);
}

// Q8_1 (the activations of Q4_1 / Q5_1): quantize_q8_0_warp's rule, and s = fp16(sum(q) * d)
// with d the float scale (common/formats/quant_legacy_extra.cpp quantize_q8_1).
__device__ __forceinline__ void quantize_q8_1_warp(float v, BlockQ8_1& out, int lane) {
  float amax = fabsf(v);
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float d = __fdiv_rn(amax, 127.0f);
  const float r = __fdiv_rn(1.0f, d);
  const float id = (d != 0.0f && isfinite(r)) ? r : 0.0f;
  const int q = static_cast<int8_t>(roundf(__fmul_rn(v, id)));
  out.qs[lane] = static_cast<int8_t>(q);
  int sum = q;
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) {
    out.d = __half_as_ushort(__float2half_rn(d));
    out.s = __half_as_ushort(__float2half_rn(__fmul_rn(__int2float_rn(sum), d)));
  }
}

// Q8_1 with llama.cpp's x86 rule (cpu::quantize_activation_row_llama_x86): quantize_q8_0_llama_warp's
// quants, and s = fp16(d * sum) over the int32 values before saturation (INT_MIN where 127/amax
// overflows, summed with wrap-around as the int32 lanes do), d = amax / 127 in float.
__device__ __forceinline__ void quantize_q8_1_llama_warp(float v, BlockQ8_1& out, int lane) {
  float amax = fabsf(v);
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
  const float r = rintf(__fmul_rn(v, id));
  int i = static_cast<int>(0x80000000u);  // INT_MIN
  if (!isnan(r) && r < 2147483648.0f && r >= -2147483648.0f) i = static_cast<int>(r);
  out.qs[lane] = static_cast<int8_t>(max(-128, min(127, i)));
  unsigned sum = static_cast<unsigned>(i);
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) {
    const float d = __fdiv_rn(amax, 127.0f);
    out.d = __half_as_ushort(__float2half_rn(d));
    out.s = __half_as_ushort(__float2half_rn(__fmul_rn(d, __int2float_rn(static_cast<int>(sum)))));
  }
}

}  // namespace moraine::cuda::quantize_detail
