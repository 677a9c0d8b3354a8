// NEOX rotary embedding, in place, over the first n_rot dims of every head (partial rotary when
// n_rot < head_dim; the rest is left as it is): dims i and i + n_rot/2 of a head at position p
// rotate by theta = p * base^(-2i/n_rot). Scalar reference: moraine::reference::rope_neox
// (common/reference/ops.cpp); theta, cos and sin are taken in double as there, then rounded to
// float, so the rotation uses the same float cos/sin up to the last bit of a double.
//
// Memory contract: x holds `rows` rows (one per token, row r at position pos0 + r) of n_heads
// heads; head h of row r starts at x + r * row_stride + h * head_stride (floats). Device pointer.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moraine::cuda {

void rope_neox(float* x, int64_t rows, int64_t n_heads, int64_t row_stride, int64_t head_stride,
               int64_t n_rot, int64_t pos0, double freq_base, cudaStream_t stream = nullptr);

// Graph-safe variant for CUDA graph capture: pos0 read from device memory (row r at position
// *pos0_dev + r), so a captured launch serves every step. Bit-identical to rope_neox at the same
// position. A negative *pos0_dev (which cannot be thrown from inside a graph) leaves x all NaN in
// the rotated dims.
void rope_neox_at(float* x, int64_t rows, int64_t n_heads, int64_t row_stride, int64_t head_stride,
                  int64_t n_rot, const int32_t* pos0_dev, double freq_base, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
