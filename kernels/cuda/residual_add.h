// Residual add: x[i] += y[i] over `count` floats (device), one correctly rounded float addition
// per element, as the reference's `x[i] += y[i]`.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moraine::cuda {

void residual_add(float* x, const float* y, int64_t count, cudaStream_t stream = nullptr);

// x[r][i] = x[r][i] + (y[r][i] + bias[i]) for rows of d floats: a projection's bias, then the
// residual add, each one rounded float addition (reference::attention_block's o bias).
void residual_add_bias(float* x, const float* y, const float* bias, int64_t rows, int64_t d,
                       cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
