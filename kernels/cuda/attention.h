// Causal softmax attention (GQA) of n query rows over a KV cache, for decode and prefill alike:
// query row t (position n_past + t) of head h attends to cached positions 0 .. n_past + t of kv
// head h / (n_head / n_head_kv): out = softmax(scale * q.K^T) V, then optionally times
// sigmoid(gate) (qwen3next's gated attention). Scalar reference:
// moraine::reference::attend_one_head (common/reference/ops.cpp).
//
// Split along the KV length: positions are cut into chunks of kAttentionChunk; one CTA per
// (row, head, chunk) computes the chunk's max, sum of exponentials and unnormalised output, and
// a merge kernel rescales and sums the chunks. The cut depends only on the number of positions a
// query sees, never on n or on n_past alone, so a token gets bit-identical output whether it is
// decoded alone or inside a prefill batch. (Prefill therefore runs this same kernel per query
// row; a tiled prefill kernel that shares K/V tiles between queries is not written yet.)
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
#include <cuda_runtime.h>

#include <cstdint>

namespace moraine::cuda {

constexpr int64_t kAttentionChunk = 256;
constexpr int64_t kAttentionMaxHeadDim = 512;

struct AttentionShape {
  int64_t n_head = 0, n_head_kv = 0, head_dim = 0;
  int64_t kv_stride = 0;  // floats per cached position (n_head_kv * head_dim when packed)
  float scale = 1.0f;
};

// Scratch floats for n query rows at once, the last of which sees n_ctx positions.
int64_t attention_scratch_floats(const AttentionShape& s, int64_t n, int64_t n_ctx);

// Throws std::invalid_argument naming the problem for a bad shape or too small scratch.
void attention(const AttentionShape& s, const float* q, const float* k_cache, const float* v_cache, int64_t n,
               int64_t n_past, const float* gate, int64_t gate_row_stride, int64_t gate_head_stride, float* out,
               float* scratch, int64_t scratch_floats, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
