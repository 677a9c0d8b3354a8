// The per-row pieces of the float-weight matvec (matvec_float.cu), shared with the fused router
// (router_fused.cu) so both compute a row's dot with the same float operations in the same order.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/formats/tensor_type.h"

namespace moraine::cuda::matvec_float_detail {

template <TensorType T>
__device__ __forceinline__ float load_weight(const uint8_t* row, int64_t i) {
  if constexpr (T == TensorType::F32) {
    return reinterpret_cast<const float*>(row)[i];
  } else if constexpr (T == TensorType::F16) {
    return __half2float(__ushort_as_half(reinterpret_cast<const unsigned short*>(row)[i]));
  } else {
    return __bfloat162float(__ushort_as_bfloat16(reinterpret_cast<const unsigned short*>(row)[i]));
  }
}

// The activation rounded to the weight's type, as the CPU reference's dot_activation_type does.
template <TensorType T>
__device__ __forceinline__ float round_activation(float v) {
  if constexpr (T == TensorType::F32) {
    return v;
  } else if constexpr (T == TensorType::F16) {
    return __half2float(__float2half_rn(v));
  } else {
    return __bfloat162float(__float2bfloat16_rn(v));
  }
}

// One warp's dot of weight row `row` (n elements) with the staged, rounded activations xs:
// lane-strided fused multiply-adds, then an xor tree; every lane returns the sum.
template <TensorType T>
__device__ __forceinline__ float row_dot_warp(const uint8_t* __restrict__ row, const float* __restrict__ xs, int64_t n,
                                             int lane) {
  float acc = 0.0f;
  for (int64_t i = lane; i < n; i += 32) acc = fmaf(load_weight<T>(row, i), xs[i], acc);
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  return acc;
}

}  // namespace moraine::cuda::matvec_float_detail
