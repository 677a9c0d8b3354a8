// RMSNorm on the GPU: out = x / sqrt(mean(x^2) + eps) * w for `rows` rows of n floats (device),
// w null for no weight; out may alias x. Scalar reference: moraine::reference::rms_norm
// (common/reference/ops.cpp): the sum of squares is taken in double as there, then the same
// float steps with round-to-nearest intrinsics, so only the order of the double additions
// differs.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moraine::cuda {

void rms_norm(const float* x, const float* w, float* out, int64_t n, int64_t rows, float eps,
              cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
