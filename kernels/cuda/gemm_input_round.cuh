// A float rounded to nearest even into the prefill GEMM's 16-bit input type (GemmInput), as raw
// bits: the one rounding dequantize_weights (the expanded path) and expert_gemm_fused (weights
// decoded in the kernel) share, which is what keeps the two paths' operands bit-identical.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/dequantize_weights.h"

namespace moraine::cuda {

template <GemmInput T>
__device__ __forceinline__ unsigned short round_to_gemm_input(float v) {
  if constexpr (T == GemmInput::BF16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  } else {
    return __half_as_ushort(__float2half_rn(v));
  }
}

// Two floats rounded as round_to_gemm_input rounds each (nearest even, independently), packed
// with `lo` in the low 16 bits (the lower address): one cvt.rn.{bf16,f16}x2.f32 for the pair.
// Why: expert_gemm_fused rounds every weight it decodes; the pair form halves its conversions.
template <GemmInput T>
__device__ __forceinline__ unsigned round_pair_to_gemm_input(float lo, float hi) {
  if constexpr (T == GemmInput::BF16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return static_cast<unsigned>(__bfloat16_as_ushort(v.x)) | (static_cast<unsigned>(__bfloat16_as_ushort(v.y)) << 16);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return static_cast<unsigned>(__half_as_ushort(v.x)) | (static_cast<unsigned>(__half_as_ushort(v.y)) << 16);
  }
}

}  // namespace moraine::cuda
