// Residual add: x[i] += y[i] over `count` floats (device), one correctly rounded float addition
// per element, as the reference's `x[i] += y[i]`.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moraine::cuda {

void residual_add(float* x, const float* y, int64_t count, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
