// Flash-decoding attention for short steps (decode, speculative verify, prefills below the tiled
// kernel's threshold), graph-safe: causal softmax attention (GQA, optional sigmoid gate) as
// attention.h, with the position read from device memory.
//
// Why a third kernel: on the H200 the split-KV kernels of attention.h take 66-165 us per layer
// at 512-4096 positions for the Qwen3-30B shape (moraine-kernel-bench cuda --backend-only,
// 2026-11-29), 48 layers of which made 6.7 ms of a 7.2 ms decode step; the K/V bytes are 2-17 MB
// (a few us of HBM). Their CTAs walk positions through dependent global loads.
//
// Design: one CTA per (kv head, chunk of kDecodeChunk positions); one warp per query head of the
// kv head's group. The CTA stages K and V of 32 positions at a time in shared memory (coalesced
// float4 loads, K rows padded so lane p reading row p is conflict-free); lane p scores position p
// (a sequential dot over head_dim), the warp keeps an online softmax (max, sum, and head_dim
// output floats spread over its lanes) and writes the chunk's record (max, sum, unnormalised
// output). A merge kernel combines a row's chunks in order and applies the gate. Rows of the call
// are served one after another by the same CTA (K/V tiles come from L2 the second time).
// A row's arithmetic depends only on how many positions it sees (its chunks and tiles are cut at
// fixed multiples of kDecodeChunk and 32), never on n, row_offset or the other rows: a token gets
// the same bits decoded alone or inside a step of any length served by this kernel. It is NOT
// bit-identical to attention.h's kernels (other order of additions).
//
// Memory contract (device pointers, floats): q [n][n_head][head_dim] (the call's rows); row r of
// the call is the step's row row_offset + r, at position *pos_dev + row_offset + r, and sees
// positions 0 .. that position; k_cache / v_cache: position j's kv head g at cache + j * kv_stride
// + g * head_dim, filled up to the last row's position; gate (nullable): head h of row r at gate +
// r * gate_row_stride + h * gate_head_stride; out [n][n_head][head_dim]. The launch depends only
// on (shape, n, max_ctx): a captured graph serves every position. A device position outside
// 0 .. max_ctx - row_offset - n gives NaN rows (nothing can be thrown inside a graph).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/attention.h"

namespace moraine::cuda {

constexpr int64_t kDecodeChunk = 128;
constexpr int64_t kAttentionDecodeMaxRows = 16;

// head_dim a multiple of 32 up to 256, at most 32 query heads per kv head.
bool attention_decode_supported(const AttentionShape& s);
int64_t attention_decode_scratch_floats(const AttentionShape& s, int64_t n, int64_t max_ctx);

// Throws std::invalid_argument naming the problem (unsupported shape, n outside
// 1..kAttentionDecodeMaxRows, too small scratch).
void attention_decode(const AttentionShape& s, const float* q, const float* k_cache, const float* v_cache, int64_t n,
                      const int32_t* pos_dev, int64_t row_offset, int64_t max_ctx, const float* gate,
                      int64_t gate_row_stride, int64_t gate_head_stride, float* out, float* scratch,
                      int64_t scratch_floats, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
