// Flash-decoding attention for short steps (decode, speculative verify, prefills below the tiled
// kernel's threshold), graph-safe: causal softmax attention (GQA, optional sigmoid gate) as
// attention.h, with the position read from device memory.
//
// Why a third kernel: the split-KV kernels of attention.h took 66-165 us per layer at 512-4096
// positions for the Qwen3-30B shape on the H200 (6.7 ms of a 7.2 ms decode step) for 2-17 MB of
// K/V: their CTAs walk positions through dependent global loads.
//
// Design: a row seeing P positions (T = ceil(P / 32) tiles) is cut into
// attention_decode_splits(P) splits of whole tiles; one CTA per (row, split, kv head), warps of
// two query heads of the kv head's group (one for an odd group). The CTA streams K and V of its
// tiles through a two-stage cp.async ring in shared memory; lane p scores position p, each warp
// keeps an online softmax per head (max, sum, and head_dim output floats spread over its lanes)
// and writes the split's record. A merge kernel (one warp per row and head) combines a row's
// records in split order and applies the gate. Both kernels use programmatic dependent launch.
// A row's arithmetic depends only on how many positions it sees (its splits are a function of
// that), never on n, row_offset, max_ctx or the other rows: a token gets the same bits decoded
// alone or inside a step of any length served by this kernel. It is NOT bit-identical to
// attention.h's kernels (other order of additions).
//
// Chosen from a sweep of 18 variants (H200, 32 query / 4 kv heads of 128, one row: 8.5 / 17.9 /
// 60.1 us at 512 / 4096 / 32768 positions, the previous design 26.5 / 32.0 / 137.9; the sweep and
// what decided each choice: docs/perf-log.md): at most 32 splits up to 128 tiles, 64 above; two
// heads per warp; programmatic dependent launch; the merge in a kernel of its own.
//
// Memory contract (device pointers, floats): q [n][n_head][head_dim] (the call's rows); row r of
// the call is the step's row row_offset + r, at position *pos_dev + row_offset + r, and sees
// positions 0 .. that position; k_cache / v_cache: position j's kv head g at cache + j * kv_stride
// + g * head_dim, filled up to the last row's position; gate (nullable): head h of row r at gate +
// r * gate_row_stride + h * gate_head_stride; out [n][n_head][head_dim]. The launch depends only
// on (shape, n, max_ctx): a captured graph serves every position. A device position outside
// 0 .. max_ctx - row_offset - n gives NaN rows (nothing can be thrown inside a graph).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/qk_norm_rope_store.h"

namespace moraine::cuda {

// kDecodeTile (positions staged and scored at once, one per lane), kDecodeMaxSplits,
// attention_decode_splits and attention_decode_scratch_floats: attention_scratch.h.
constexpr int64_t kAttentionDecodeMaxRows = 16;

// head_dim a multiple of 32 up to 256, at most 32 query heads per kv head.
bool attention_decode_supported(const AttentionShape& s);

// Throws std::invalid_argument naming the problem (unsupported shape, n outside
// 1..kAttentionDecodeMaxRows, too small scratch, q / K / V / scratch not 16-byte aligned).
void attention_decode(const AttentionShape& s, const float* q, const float* k_cache, const float* v_cache, int64_t n,
                      const int32_t* pos_dev, int64_t row_offset, int64_t max_ctx, const float* gate,
                      int64_t gate_row_stride, int64_t gate_head_stride, float* out, float* scratch,
                      int64_t scratch_floats, cudaStream_t stream = nullptr);

// The same over a cache of IEEE halves (kv_stride a multiple of 8): K and V are staged as halves
// (half the bytes of a float cache) and widened exactly to float in shared memory, so the output
// is bit for bit the float kernel's on a float cache holding the same (half-rounded) values.
void attention_decode(const AttentionShape& s, const float* q, const __half* k_cache, const __half* v_cache, int64_t n,
                      const int32_t* pos_dev, int64_t row_offset, int64_t max_ctx, const float* gate,
                      int64_t gate_row_stride, int64_t gate_head_stride, float* out, float* scratch,
                      int64_t scratch_floats, cudaStream_t stream = nullptr);

// The same, and the merge also writes out's rows quantized as Q8_0 with llama.cpp's x86 rule
// into out_q8_0 (n rows of n_head * head_dim / 32 blocks, back to back): exactly the bytes of
// quantize_activations_llama(Q8_0, out, out_q8_0, n_head * head_dim, n) after the plain call
// (tests/cuda/attention_decode_test.cpp), without its launch (the o projection's input). H200,
// Qwen3-30B-A3B decode chain: -1.14 / -0.87 us per layer at positions 0 / 600 (run C).
void attention_decode_quantized(const AttentionShape& s, const float* q, const float* k_cache, const float* v_cache,
                                int64_t n, const int32_t* pos_dev, int64_t row_offset, int64_t max_ctx,
                                const float* gate, int64_t gate_row_stride, int64_t gate_head_stride, float* out,
                                void* out_q8_0, float* scratch, int64_t scratch_floats, cudaStream_t stream = nullptr);
void attention_decode_quantized(const AttentionShape& s, const float* q, const __half* k_cache,
                                const __half* v_cache, int64_t n, const int32_t* pos_dev, int64_t row_offset,
                                int64_t max_ctx, const float* gate, int64_t gate_row_stride, int64_t gate_head_stride,
                                float* out, void* out_q8_0, float* scratch, int64_t scratch_floats,
                                cudaStream_t stream = nullptr);

// qk_norm_rope_store(qk) then attention_decode(_quantized) of its one row in one kernel pair:
// the split kernel's CTAs normalise and rotate their kv head's group of q heads themselves, and
// the CTA of the last split (which holds the new position) makes k and v of its kv head, stores
// them into the cache and uses them for that position. The cache (qk's k_cache / v_cache or the
// _f16 pair: K and V are read from there), the output and out_q8_0 (nullable) get exactly the
// bytes of the unfused calls; qk.q_out is not written (nothing else reads it in a decode layer).
// The position is qk.pos0_dev, the capacity qk.max_pos (attention's max_ctx): a device position
// outside it gives NaN rows and stores nothing. H200, Qwen3-30B-A3B decode chain of 48 layers
// (moraine-kernel-bench cuda --mixer-only, 2026-11-30 run C): -1.69 us per layer at position 0,
// -0.54 at 600 (the K / V tiles below the new position load before the wait on the q | k | v
// matvec; the fused CTAs then normalise their q heads, ~0.5 us more on the split's path).
// Supported: one row, attention_decode's shape with qk's heads, an even n_rot in 2..head_dim, q /
// k / v / q_norm / k_norm 16-byte aligned (cp.async) and the q head stride a multiple of 4; none of
// gpt-oss's options (q / k / v biases, YaRN, sinks, a window). The norms are required (null throws).
// Throws std::invalid_argument naming the problem when !attention_decode_fused_qk_supported, a
// pointer is null, or as attention_decode.
bool attention_decode_fused_qk_supported(const QkNormRopeStoreArgs& qk, const AttentionShape& s);
void attention_decode_fused_qk(const QkNormRopeStoreArgs& qk, const AttentionShape& s, const float* gate,
                               int64_t gate_row_stride, int64_t gate_head_stride, float* out, void* out_q8_0,
                               float* scratch, int64_t scratch_floats, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
