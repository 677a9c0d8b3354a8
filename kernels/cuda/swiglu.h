// SwiGLU's elementwise step: g[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u, in place over
// `count` floats (device). Scalar reference: moraine::reference::silu (common/reference/ops.h)
// times u; the device exp may differ from the host's in the last bit.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moraine::cuda {

void swiglu(float* g, const float* u, int64_t count, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
