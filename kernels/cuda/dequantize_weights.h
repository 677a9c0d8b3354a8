// Weight matrices in their GGUF layout (any format the matvec kernels read, plus F32/F16/BF16)
// expanded on the GPU to BF16 or F16 elements, the input of a tensor-core GEMM (gemm_prefill.h),
// and float activations rounded to the same type.
//
// Each element is first computed in float exactly as dequantize_row (common/formats/quant.h)
// computes it (same products and subtractions, _rn intrinsics so nvcc cannot fuse them into an
// FMA), then rounded to nearest even: the output equals fp32_to_bf16(dequantize_row(...)) (or
// fp32_to_fp16) bit for bit, which tests/cuda/gemm_prefill_test.cpp checks.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/formats/tensor_type.h"

namespace moraine::cuda {

// The 16-bit element type a prefill GEMM multiplies. BF16 is the default: it keeps float's
// exponent range, so no activation overflows (Qwen3 hidden states reach the thousands, F16 stops
// at 65504) and no small weight goes subnormal; F16 rounds 4x finer (11 vs 8 significant bits)
// where the caller knows the values fit. Tensor-core throughput is the same for both.
enum class GemmInput : uint8_t { BF16, F16 };

// Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, F16, BF16, F32; Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL,
// IQ4_XS, TQ1_0, TQ2_0 (issue 26); the IQ grid formats (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
// IQ1_S, IQ1_M).
bool dequantize_weights_supported(TensorType weight);

// `count` matrices of `elems` elements each (rows * cols, rows back to back; elems a multiple of
// 32 and of the type's block size), matrix i read from weights[i] (a host array of device
// pointers, each aligned to its element or block field: 4 bytes for F32, 2 otherwise), written
// to out + i * elems elements of `out_type`. One launch per 64 matrices. Throws
// std::invalid_argument naming the problem for a bad type, size or pointer.
void dequantize_weights(TensorType weight, const void* const* weights, int count, int64_t elems, GemmInput out_type,
                        void* out, cudaStream_t stream = nullptr);

// count floats (a multiple of 4, x 16-byte aligned) rounded to nearest even into out_type.
void convert_gemm_input(const float* x, int64_t count, GemmInput out_type, void* out, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
