// The attention kernels' shape and scratch sizes, without CUDA headers: the CUDA backend sizes
// its split-KV scratch from these, and so does the coordinator's estimate of the backend's device
// memory (gpu_worker/cuda_step_scratch.h), so the two cannot disagree. attention.h and
// attention_decode.h (the kernels) include this file.
#pragma once
#include <cstdint>

// attention_decode_splits runs on the device too; a plain C++ compiler sees a host function.
#if defined(__CUDACC__)
#define MORAINE_HOST_DEVICE __host__ __device__
#else
#define MORAINE_HOST_DEVICE
#endif

namespace moraine::cuda {

struct AttentionShape {
  int64_t n_head = 0, n_head_kv = 0, head_dim = 0;
  int64_t kv_stride = 0;  // floats per cached position (n_head_kv * head_dim when packed)
  float scale = 1.0f;
  // gpt-oss: sinks (device [n_head], nullable): head h's softmax gets one more logit sinks[h],
  // exp(sinks[h] - max) added to its denominator, no value row; window > 0: the query at position
  // p sees positions > p - window only (reference::attention_block).
  const float* sinks = nullptr;
  int64_t window = 0;
};

// attention.h's split-KV kernels: positions cut into chunks of kAttentionChunk; a record per
// (row, head, chunk) holds max, sum and head_dim unnormalised outputs.
constexpr int64_t kAttentionChunk = 256;
// Rows attention_at (and the backend's graph-safe decode) takes in one call.
constexpr int64_t kAttentionAtMaxRows = 16;

// Scratch floats for n query rows at once, the last of which sees n_ctx positions.
inline int64_t attention_scratch_floats(const AttentionShape& s, int64_t n, int64_t n_ctx) {
  const int64_t chunks = (n_ctx + kAttentionChunk - 1) / kAttentionChunk;
  return n * s.n_head * chunks * (s.head_dim + 2);
}
// attention_at covers max_ctx positions in one pass of all rows.
inline int64_t attention_at_scratch_floats(const AttentionShape& s, int64_t n, int64_t max_ctx) {
  return attention_scratch_floats(s, n, max_ctx);
}

// attention_decode.h's flash-decoding kernel: tiles of kDecodeTile positions, at most
// kDecodeMaxSplits splits per row (attention_decode.h says how they were chosen).
constexpr int64_t kDecodeTile = 32;
constexpr int64_t kDecodeMaxSplits = 64;

// Splits of a row that sees `positions` positions: one per tile up to 32, 32 up to 128 tiles, 64
// above (balanced: split c of S takes tiles [c * T / S, (c + 1) * T / S)).
MORAINE_HOST_DEVICE constexpr int64_t attention_decode_splits(int64_t positions) {
  const int64_t tiles = (positions + kDecodeTile - 1) / kDecodeTile;
  return tiles <= 32 ? tiles : tiles <= 128 ? 32 : kDecodeMaxSplits;
}

// A record per (row, head, split slot) of max, sum, head_dim outputs and padding; the grid has
// the splits of the longest row max_ctx allows.
inline int64_t attention_decode_scratch_floats(const AttentionShape& s, int64_t n, int64_t max_ctx) {
  return n * s.n_head * attention_decode_splits(max_ctx) * (s.head_dim + 4);
}

}  // namespace moraine::cuda
