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

}  // namespace moraine::cuda
