// RMSNorm fused with the activation quantization that follows it in the CUDA backend's decode
// step (the normalised rows h feed the q/k/v and router matvecs, which dot q8 activations):
// one launch instead of rms_norm then quantize_activations_llama; and the same with the MoE
// combine that precedes the next layer's norm (moe_combine_mixed, rms_norm, quantize).
//
// Bit-identical to the unfused pair: h_out gets exactly the floats of
// rms_norm(x, w, h_out, n, rows, eps) (same double sum of squares over the same 256-thread
// tree, same rounded float steps) and act_out exactly the bytes of
// quantize_activations_llama(act_type, h_out, act_out, n, rows) (the same per-block warp code,
// quantize_block.cuh). tests/cuda/rms_norm_quantize_test.cpp compares both with memcmp.
//
// Memory contract (device pointers): x and h_out `rows` rows of n floats (h_out may alias x);
// w n floats or null (no weight); act_out rows * n / block blocks of act_type, rows back to back.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/formats/tensor_type.h"

namespace moraine::cuda {

// act_type Q8_0 or Q8_K; n a positive multiple of its block size (32 or 256), rows in 1..2^31-1;
// std::invalid_argument naming the problem otherwise.
void rms_norm_quantize(const float* x, const float* w, float* h_out, TensorType act_type, void* act_out,
                       int64_t n, int64_t rows, float eps, cudaStream_t stream = nullptr);

// One launch for moe_combine_mixed(x, slots, host_rows, host_row_of, weight, shared, gate_logit,
// n, k, d) then rms_norm(x, norm_w, h_out, d, n, eps) then, when act_out is not null,
// quantize_activations_llama(act_type, h_out, act_out, d, n): x, h_out and act_out get exactly
// their bytes (tests/cuda/rms_norm_quantize_test.cpp). Arguments and memory contract as
// moe_combine.h (n tokens of d floats; host_rows/host_row_of both null or both set; shared and
// gate_logit likewise) and as above; act_out null: norm only (act_type ignored, any d); h_out
// must not overlap the combine's inputs. std::invalid_argument naming the problem otherwise.
void moe_combine_rms_norm_quantize(float* x, const float* slots, const float* host_rows, const int32_t* host_row_of,
                                   const float* weight, const float* shared, const float* gate_logit, int64_t n,
                                   int64_t k, int64_t d, const float* norm_w, float* h_out, TensorType act_type,
                                   void* act_out, float eps, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
