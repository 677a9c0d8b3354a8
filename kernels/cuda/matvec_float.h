// Matrix-vector products on F32, F16 and BF16 weights read in place (the golden F32 files, and
// the F16/BF16 tensors quantizers leave unquantized): y[r] = dot(W[r], x) for a row-major matrix
// of `rows` rows of n elements and float activations. As the CPU reference does
// (dot_activation_type of a half type is the type itself), each activation is first rounded to
// the weight's type (F16: nearest-even half; BF16: nearest-even bfloat16), then products and sums
// are float. Only the order of the float additions differs from the reference (per-lane sums,
// then a warp tree).
//
// Memory contract: w is read element by element (no alignment beyond the element's); x is
// `n` floats per activation row; y gets `rows` floats per matrix. Device pointers.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/formats/tensor_type.h"
#include "kernels/cuda/matvec.h"

namespace moraine::cuda {

bool matvec_float_supported(TensorType weight);

// The batched form of matvec.h: matrix e reads w + id(e) * weight_stride_bytes, activations
// x + e * act_stride_bytes (bytes, a multiple of 4) and writes (with batch.accumulate: adds
// into, as matvec.h says) y + e * out_stride. With weight_stride_bytes 0 and one activation row
// per e, it is a token batch against one matrix.
// Throws std::invalid_argument naming the problem for an unsupported type or a bad shape.
void matvec_float_batched(TensorType weight, const void* w, int64_t rows, int64_t n, const float* x,
                          float* y, const MatvecBatch& batch, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
