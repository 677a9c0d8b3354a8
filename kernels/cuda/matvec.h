// Decode matrix-vector products on quantized weights read in place: y[r] = dot(W[r], act) for a
// row-major weight matrix of `rows` rows of n elements in a ggml block format, against
// activations already quantized on the GPU to dot_activation_type(weight) (Q8_0 or Q8_K, see
// quantize_activations.h). F32 out. Formats: Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4; and
// (issue 26) Q4_0, Q5_0, IQ4_NL against Q8_0, Q4_1, Q5_1 against Q8_1, IQ4_XS, TQ1_0, TQ2_0 against
// Q8_K; the importance-matrix grid formats IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M
// against Q8_K.
//
// Each row's float result is the sum of the same per-block float terms the scalar reference
// (vec_dot_reference, common/formats/quant.h) adds, bit for bit; only the order of the float
// additions differs (per-lane running sums, then a warp tree), which bounds the difference by
// 2 * gamma(n_blocks) * sum|term| (tests/cuda/matvec_test.cpp).
//
// Memory contract: rows and activations are read as whole aligned 16-byte words, so the weight
// allocation must be 16-byte aligned and it and the activation allocation readable up to the
// next multiple of 16 past their ends (cudaMalloc and DeviceBuffer guarantee both).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/formats/tensor_type.h"

namespace moraine::cuda {

bool matvec_supported(TensorType weight);

// Several matrices of the same shape in one launch (the selected experts of a MoE layer):
// matrix e reads weights at w + id(e) * weight_stride_bytes with id(e) = expert_ids[e] (a
// device array) or e when expert_ids is null, activations at act + e * act_stride_bytes (0:
// every matrix sees the same activations) and writes y + e * out_stride.
// accumulate: add each dot into y (y[r] = y[r] + dot, one rounded float addition) instead of
// storing it, bit-identical to the plain matvec followed by residual_add(y, out) (so an output
// projection can add straight into the residual stream; tests/cuda/matvec_accumulate_test.cpp).
// weights_from_previous_kernel: launched with programmatic dependent launch (launch.h), the
// kernel starts its first weight loads before it waits for the previous kernel in the stream
// (model weights are written once, long before), so the HBM latency overlaps that kernel's
// tail. Set it when the kernel right before this one in the stream writes the weights; with
// expert_ids the kernel always waits first (the ids select the weights).
// (The staged kernel's first version summed aligned Q8_0 rows in block-pair order and moved the
// group's kmix models 0.077 of max |logit| off the reference; matvec_formats.cuh's
// q8_0_dot_pairs now keeps the per-block order, bits equal: matvec_test.cpp.)
struct MatvecBatch {
  int count = 1;
  int64_t weight_stride_bytes = 0;
  int64_t act_stride_bytes = 0;
  int64_t out_stride = 0;
  const int32_t* expert_ids = nullptr;
  bool accumulate = false;
  bool weights_from_previous_kernel = false;
};

// Throws std::invalid_argument naming the problem for an unsupported type, a bad shape or a
// row too long for the shared-memory staging (about 200 KB of row bytes per 4 rows).
void matvec_quantized(TensorType weight, const void* w, int64_t rows, int64_t n, const void* act,
                      float* y, cudaStream_t stream = nullptr);
void matvec_quantized_batched(TensorType weight, const void* w, int64_t rows, int64_t n,
                              const void* act, float* y, const MatvecBatch& batch,
                              cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
