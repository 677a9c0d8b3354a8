// Activation quantization with llama.cpp's x86 run-time rule, the one the CPU reference executor
// uses (cpu::quantize_activation_row_llama_x86, kernels/cpu/vec_dot.h), so the CUDA backend's
// int8 activations are the reference's byte for byte and logits on quantized files agree with it
// (a single activation rounded the other way moves a tiny MoE model's logits by up to 2e-2 of
// their range: tests/reference/llama_oracle_test.cpp). Q8_0: d = fp16(amax / 127), q =
// nearest-even(x * (127 / amax)) saturated to int8. Q8_K: as quantize_activations.h (the x86 rule
// differs only in the sign of an all-zero block's scale, which no dot can see).
//
// Memory contract: as quantize_activations.h (x: rows * n floats; out: rows * n / block blocks,
// rows back to back; device pointers).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/formats/tensor_type.h"

namespace moraine::cuda {

// act_type Q8_0, Q8_1 (the x86 q8_1: Q8_0's rule here, s = fp16(d * sum of the int32 quants)) or
// Q8_K; n a multiple of the block size (std::invalid_argument otherwise).
void quantize_activations_llama(TensorType act_type, const float* x, void* out, int64_t n, int64_t rows,
                                cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
