// Tensor-core causal prefill attention over the F16 KV cache: the contract of attention_prefill's
// half-cache overload (attention_prefill.h: same pointers, strides, gate and output layout), done
// flash-attention-2 style with mma.sync m16n8k16 (F16 inputs, F32 accumulation). Neither q nor p
// is a half, so each is split into two halves, x = x_hi + x_lo, and each product takes two mma's
// (q.K = q_hi.K + q_lo.K, P.V = P_hi.V + P_lo.V): the operands then carry ~2^-22 relative error
// instead of half's 2^-11, and the output stays within a first-order bound of the same form as the
// F32 kernel's (derived in tests/cuda/attention_prefill_tc_test.cpp). Not bit-identical to
// attention_prefill.
//
// Narrower than attention_prefill: head_dim 128 or 256 only, kv_stride a multiple of 8 halves and
// both caches 16-byte aligned (each K/V row moves by 16-byte cp.async). Anything else throws
// std::invalid_argument so the caller can keep attention_prefill; attention_prefill_tc_supports says
// so beforehand. q has no range limit: a CTA scales its query tile by a power of two before the split.
// AttentionShape::sinks / ::window (gpt-oss) go to a separate instantiation: KV tiles from the CTA's
// first query's window, positions below a row's window masked, the sink in the final normalisation.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/attention.h"

namespace moraine::cuda {

// Whether attention_prefill_tc takes this shape and these caches (head_dim, kv_stride, alignment).
bool attention_prefill_tc_supports(const AttentionShape& s, const __half* k_cache, const __half* v_cache);

// Throws std::invalid_argument naming the problem for a bad or unsupported shape.
void attention_prefill_tc(const AttentionShape& s, const float* q, const __half* k_cache, const __half* v_cache,
                          int64_t n, int64_t n_past, const float* gate, int64_t gate_row_stride,
                          int64_t gate_head_stride, float* out, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
