// Tiled causal attention for prefill (many query rows, n >= 64 or so): same maths and memory
// contract as `attention` (attention.h) but flash-attention style: a CTA takes one kv head and a
// tile of queries (rows x the query heads of that kv head, so K/V tiles are shared by the GQA
// group and by the rows), walks the KV positions in tiles through shared memory with an online
// softmax, and writes the normalised (and gated) output directly: no scratch, one launch.
// F32 throughout (no tensor cores). Its arithmetic order differs from `attention`'s (a sequential
// dot product, running max/sum rescaled per KV tile), so its output is NOT bit-identical to the
// decode kernels: it agrees with the exact attention within the tolerance derived in
// tests/cuda/attention_prefill_test.cpp. A token prefilled here and the same token decoded with
// `attention` / `attention_at` can differ in the last bits.
//
// Memory contract (device pointers, floats): q [n][n_head][head_dim]; k_cache, v_cache: position
// j's kv head g at cache + j * kv_stride + g * head_dim, positions 0 .. n_past + n - 1 filled;
// gate (nullable): head h of row t at gate + t * gate_row_stride + h * gate_head_stride; out
// [n][n_head][head_dim]. head_dim <= kAttentionPrefillMaxHeadDim. Host n_past: prefill is not
// graph-captured.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/attention.h"

namespace moraine::cuda {

constexpr int64_t kAttentionPrefillMaxHeadDim = 512;

// Throws std::invalid_argument naming the problem for a bad shape.
void attention_prefill(const AttentionShape& s, const float* q, const float* k_cache, const float* v_cache, int64_t n,
                       int64_t n_past, const float* gate, int64_t gate_row_stride, int64_t gate_head_stride,
                       float* out, cudaStream_t stream = nullptr);
// The same over a cache of IEEE halves, widened exactly when staged: the float kernel's bits for
// a float cache holding the same values.
void attention_prefill(const AttentionShape& s, const float* q, const __half* k_cache, const __half* v_cache, int64_t n,
                       int64_t n_past, const float* gate, int64_t gate_row_stride, int64_t gate_head_stride,
                       float* out, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
