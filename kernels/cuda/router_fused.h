// The MoE router in one launch: the router matvec (float weights: F32, F16 or BF16, as
// matvec_float.h) and the softmax top-k (router.h) for n tokens. Bit-identical to
// matvec_float_batched (token batch: weight stride 0, activation stride d floats, out stride
// n_expert) followed by route_softmax_top_k: logits, chosen and weight get exactly their bytes
// (tests/cuda/router_fused_test.cpp). The CTAs of a token write its logits; the last one to
// finish (a per-token arrival counter) routes the token.
//
// Memory contract (device): w [n_expert][d] of w_type; x [n][d] floats; logits [n][n_expert]
// floats (written: the unfused pair's intermediate); chosen / weight [n][k] as router.h.
// `arrivals`: n uint32 counters, zero before the first call (cudaMemset once); every call leaves
// them zero again, so a captured graph can replay it. One call at a time per counter array.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/formats/tensor_type.h"

namespace moraine::cuda {

// Throws std::invalid_argument naming the problem: w_type not F32/F16/BF16, n outside 1..65535,
// n_expert outside 1..4096, k outside 1..min(n_expert, 64), (d + 2 n_expert) floats above 48 KiB
// of shared memory, or a null pointer.
void router_fused(TensorType w_type, const void* w, int64_t n_expert, int64_t d, const float* x, int64_t n, int64_t k,
                  bool renormalize, float* logits, int32_t* chosen, float* weight, uint32_t* arrivals,
                  cudaStream_t stream = nullptr);

// The FFN input's RMSNorm in front, in the same launch: h = rms_norm(x, norm_w, eps) for the n
// rows of x (norm_w null: no weight) is written to h_out with exactly rms_norm's bits (rms_norm.h)
// and routed as router_fused routes it: h_out, logits, chosen and weight get the bytes of
// rms_norm, matvec_float_batched, route_softmax_top_k in a row (tests/cuda/router_fused_test.cpp).
// Every CTA of a token normalises the token's row itself (d floats from L2); the router rows
// and norm weights are loaded before the launch waits on the kernel before it (PDL, launch.h).
// H200, Qwen3-30B-A3B decode chain (moraine-kernel-bench cuda --mixer-only, run C): the step
// costs 4.7-4.9 us per layer against 6.3 for the three launches (-1.2 us per layer); the last
// CTA's hand-off (fence, counter, logits back from L2, routing) is most of what is left.
// h_out must not overlap x; arrivals as above. std::invalid_argument naming the problem when
// !rms_norm_router_fused_supported, n outside 1..65535, k outside 1..min(n_expert, 64), w not
// 16-byte aligned or a null pointer. Supported: F32/F16/BF16 weights, d up to 4096 with rows of whole
// 16-byte words, n_expert up to 4096, d floats and two weight rows within 47 KiB.
bool rms_norm_router_fused_supported(TensorType w_type, int64_t n_expert, int64_t d);
void rms_norm_router_fused(TensorType w_type, const void* w, int64_t n_expert, int64_t d, const float* x,
                           const float* norm_w, float eps, int64_t n, float* h_out, int64_t k, bool renormalize,
                           float* logits, int32_t* chosen, float* weight, uint32_t* arrivals,
                           cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
