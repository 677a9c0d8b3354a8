// Per-head RMSNorm of q and k (qwen3's q_norm / k_norm): every head of head_dim floats is
// normalised with the same weight w[head_dim]: out = x / sqrt(mean(x^2) + eps) * w. Scalar
// reference: moraine::reference::rms_norm per head (sum of squares in double, as there; then the
// same float steps rounded to nearest).
//
// Memory contract: head h of row r is read at x + r * x_row_stride + h * x_head_stride and
// written contiguously at out + (r * n_heads + h) * head_dim (so a q projection that carries a
// gate beside each head is normalised into a packed q). out may alias x only when x is packed
// the same way. Device pointers.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moraine::cuda {

void head_rms_norm(const float* x, int64_t x_row_stride, int64_t x_head_stride, const float* w, float* out,
                   int64_t rows, int64_t n_heads, int64_t head_dim, float eps, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
