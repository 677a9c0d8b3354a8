// Device code shared by the kernels that RMS-normalise a row in one CTA (rms_norm.cu,
// rms_norm_quantize.cu, router_fused.cu): one copy of the reduction, so they keep one set of bits.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moraine::cuda {

// The row's 1 / sqrt(mean(x^2) + eps) from each thread's double sum of squares: a warp xor tree,
// one partial per warp in shared memory, the kWarps partials added in warp order by every thread,
// then the reference's roundings (mean rounded to float, then eps, sqrt and the division in float).
// partial: kWarps doubles of shared memory. Every thread of the CTA calls it (a barrier inside).
template <int kWarps>
__device__ __forceinline__ float rms_inverse(double ss, double* partial, int64_t n, float eps) {
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
  __syncthreads();
  double total = 0.0;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) total += partial[i];
  const float mean = __double2float_rn(__ddiv_rn(total, static_cast<double>(n)));
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
}

}  // namespace moraine::cuda
