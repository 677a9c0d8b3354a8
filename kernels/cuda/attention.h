// Causal softmax attention (GQA) of n query rows over a KV cache, for decode and prefill alike:
// query row t (position n_past + t) of head h attends to cached positions 0 .. n_past + t of kv
// head h / (n_head / n_head_kv): out = softmax(scale * q.K^T) V, then optionally times
// sigmoid(gate) (qwen3next's gated attention). Scalar reference:
// moraine::reference::attend_one_head (common/reference/ops.cpp).
//
// Split along the KV length: positions are cut into chunks of kAttentionChunk; for every query
// (row, head) and chunk the kernel computes the chunk's max, sum of exponentials and unnormalised
// output, and a merge kernel rescales and sums the chunks. One CTA serves one (kv head, chunk)
// and up to 8-40 of the query heads (and rows) of that kv head, so a K/V row is read once per
// such group, not once per query head (GQA sharing). When that grid would leave SMs idle (short
// contexts: few chunks) the queries are split over more CTAs, down to one per CTA. Each query's
// arithmetic is exactly that of a CTA of its own (attention_unshared below, the kernel before the
// sharing), so every split gives the same bits (H200, Qwen3-30B shape, one row at 32K context:
// 169 us shared against 226 unshared; docs/perf-log.md). The cut
// depends only on the number of positions a query sees, never on n or on n_past alone, so a token
// gets bit-identical output whether it is decoded alone or inside a batch of rows, through
// `attention` or through the graph-safe `attention_at`. (The tiled prefill kernel,
// attention_prefill.h, is NOT bit-identical to these.)
//
// Memory contract (device pointers, floats): q [n][n_head][head_dim]; k_cache, v_cache: position
// j's kv head g at cache + j * kv_stride + g * head_dim, positions 0 .. n_past + n - 1 filled;
// gate (nullable): head h of row t at gate + t * gate_row_stride + h * gate_head_stride; out
// [n][n_head][head_dim]; scratch: overwritten, at least attention_scratch_floats(s, 1, n_past + n)
// floats. Rows go through in passes of as many rows as the scratch holds (each row's arithmetic is
// the same in any pass), so a scratch sized for a few rows serves a prefill of any length: the
// per-chunk records of every row at once would take n * n_head * chunks * (head_dim + 2) floats,
// over a GB for 512 rows at 32K context.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/attention_scratch.h"   // AttentionShape, kAttentionChunk, the scratch sizes

namespace moraine::cuda {

constexpr int64_t kAttentionMaxHeadDim = 512;

// Throws std::invalid_argument naming the problem for a bad shape or too small scratch.
void attention(const AttentionShape& s, const float* q, const float* k_cache, const float* v_cache, int64_t n,
               int64_t n_past, const float* gate, int64_t gate_row_stride, int64_t gate_head_stride, float* out,
               float* scratch, int64_t scratch_floats, cudaStream_t stream = nullptr);

// Graph-safe variant for CUDA graph capture: n_past is read from device memory (*n_past_dev, an
// int32 the caller updates before each replay), and the launch depends only on (s, n, max_ctx),
// never on the position: the grid covers max_ctx positions and CTAs of chunks past the live length
// exit at once; the merge reads the live length. Same contract as `attention` otherwise, and the
// same bits as `attention` for the same inputs. 1 <= n <= kAttentionAtMaxRows; scratch at least
// attention_at_scratch_floats(s, n, max_ctx) floats (one pass, all rows). The caller guarantees
// *n_past_dev >= 0 and *n_past_dev + n <= max_ctx; a device value outside that cannot be thrown
// from inside a graph, so the output is then all NaN (never a read out of bounds).
void attention_at(const AttentionShape& s, const float* q, const float* k_cache, const float* v_cache, int64_t n,
                  const int32_t* n_past_dev, int64_t max_ctx, const float* gate, int64_t gate_row_stride,
                  int64_t gate_head_stride, float* out, float* scratch, int64_t scratch_floats,
                  cudaStream_t stream = nullptr);

// `attention` and `attention_at` over caches of IEEE halves (the CUDA backend's F16 KV cache):
// each element is widened exactly to float where the float kernels load it, so the output is bit
// for bit theirs on float caches holding the same (half-rounded) values.
void attention(const AttentionShape& s, const float* q, const __half* k_cache, const __half* v_cache, int64_t n,
               int64_t n_past, const float* gate, int64_t gate_row_stride, int64_t gate_head_stride, float* out,
               float* scratch, int64_t scratch_floats, cudaStream_t stream = nullptr);
void attention_at(const AttentionShape& s, const float* q, const __half* k_cache, const __half* v_cache, int64_t n,
                  const int32_t* n_past_dev, int64_t max_ctx, const float* gate, int64_t gate_row_stride,
                  int64_t gate_head_stride, float* out, float* scratch, int64_t scratch_floats,
                  cudaStream_t stream = nullptr);

// The kernel before GQA sharing: one CTA per (row, head, chunk), so each K/V row is read once per
// query head. Same contract and bits as `attention`; kept as the arithmetic spec the shared kernel
// is tested bit-identical against, and as the bench's baseline. Not for production use.
void attention_unshared(const AttentionShape& s, const float* q, const float* k_cache, const float* v_cache,
                        int64_t n, int64_t n_past, const float* gate, int64_t gate_row_stride,
                        int64_t gate_head_stride, float* out, float* scratch, int64_t scratch_floats,
                        cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
