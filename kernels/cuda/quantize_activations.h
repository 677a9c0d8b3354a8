// Activation quantization on the GPU into the ggml block formats the scalar reference dots
// against (dot_activation_type): Q8_0 (blocks of 32, fp16 scale) for Q8_0/MXFP4 weights and Q8_K
// (blocks of 256, float scale, 16-element sums) for the K-quants. We keep ggml's byte layouts
// rather than a GPU-private q8_1 so the output is checked byte for byte against
// moraine::quantize_row (common/formats/quant.h) and the matrix-vector kernels are checked
// against vec_dot_reference on identical activation bytes.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/formats/tensor_type.h"

namespace moraine::cuda {

// x: `rows` rows of n floats (device). out: rows * n / block_elems blocks of act_type (device),
// rows back to back. act_type must be Q8_0, Q8_1 (Q4_1 / Q5_1 weights: Q8_0's rule plus
// s = fp16(d * sum q)) or Q8_K and n a multiple of its block size
// (std::invalid_argument otherwise). Finite inputs give the bytes quantize_row gives.
void quantize_activations(TensorType act_type, const float* x, void* out, int64_t n,
                          int64_t rows, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
