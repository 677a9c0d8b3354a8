// The attention block's per-token preparation in one launch: it replaces, in the CUDA backend's
// decode step,
//   head_rms_norm(q) -> rope_neox_at(q) -> head_rms_norm(k) -> rope_neox_at(k)
//   -> kv_store_at(k -> k_cache) -> kv_store_at(v -> v_cache)
// and gives bit for bit their outputs: packed q normed and rotated, k normed and rotated into the
// cache, v copied into the cache (tests/cuda/qk_norm_rope_store_test.cpp compares with memcmp).
// Every float step is the unfused kernels' (head_rms_norm.cu's double sum of squares over the
// same 32-lane tree, rope.cu's double theta/cos/sin and rounded rotation).
//
// Memory contract (device pointers, floats):
//   q: head h of row t at q + t * q_row_stride + h * q_head_stride (a q projection carrying a
//      gate beside each head has q_head_stride 2 * head_dim), as head_rms_norm reads it;
//   k, v: head h of row t at k + t * k_row_stride + h * head_dim (v likewise), so separate k/v
//      buffers (row stride kv_dim) and one concatenated qkv matvec output [rows][q_rows + 2 kv_dim]
//      (k = qkv + q_rows, v = qkv + q_rows + kv_dim, both row strides q_rows + 2 kv_dim) both work;
//   q_out: [rows][n_head][head_dim] packed; must not overlap q, k or v;
//   k_cache, v_cache: at least max_pos positions of kv_dim = n_head_kv * head_dim floats; row t
//      goes to position *pos0_dev + t. Or, for a cache of IEEE halves, k_cache_f16 / v_cache_f16
//      instead (exactly one pair set): each stored element is the float one rounded to nearest
//      even (__float2half_rn), nothing else changes.
// A device position outside [0, max_pos - rows] cannot be thrown from a graph replay: as
// kv_store_at, the caches are then left untouched; as rope_neox_at, a negative position leaves
// q_out NaN in its first n_rot dims of every head (a position past the end rotates q normally).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moraine::cuda {

// YaRN's rotation (gpt-oss), as reference::rope_neox_yarn computes it: pair i's angle is
// pos * base^(-2i/n_rot) divided by factor where the ramp is 0, kept where it is 1, blended
// between the correction dims low and high; cos and sin are scaled by mscale. low, high and
// mscale are model::yarn_ramp's (common/model/arch/parts.h: the one computation of them, which
// follows RopePart::yarn_truncate and attn_factor); the caller copies them here.
struct RopeYarn {
  bool on = false;
  double factor = 1.0, low = 0.0, high = 0.0, mscale = 1.0;
};

struct QkNormRopeStoreArgs {
  const float* q = nullptr;
  int64_t q_row_stride = 0, q_head_stride = 0;
  const float* k = nullptr;
  int64_t k_row_stride = 0;
  const float* v = nullptr;
  int64_t v_row_stride = 0;
  const float* q_norm = nullptr;  // [head_dim], the weight of every q head
  const float* k_norm = nullptr;  // [head_dim]
  int64_t rows = 0, n_head = 0, n_head_kv = 0, head_dim = 0;
  int64_t n_rot = 0;  // rotated dims per head (even, <= head_dim; partial rotary when smaller)
  const int32_t* pos0_dev = nullptr;
  double freq_base = 10000.0;
  float eps = 1e-6f;
  int64_t max_pos = 0;  // cache capacity in positions
  float* q_out = nullptr;
  float* k_cache = nullptr;
  float* v_cache = nullptr;
  __half* k_cache_f16 = nullptr;
  __half* v_cache_f16 = nullptr;
  // Biases added to the raw q / k / v heads first ([n_head * head_dim], [kv_dim], [kv_dim]; nullable;
  // gpt-oss without norms, glm4moe with them: one rounded add before the RMSNorm) and YaRN's
  // rotation, only without q_norm and k_norm (both null: the heads are rotated as they are, no
  // RMSNorm); YaRN with norms throws.
  const float* q_bias = nullptr;
  const float* k_bias = nullptr;
  const float* v_bias = nullptr;
  RopeYarn yarn;
};

// Throws std::invalid_argument naming the problem for a bad shape or a null pointer. q_norm and
// k_norm both null: no RMSNorm (a separate kernel: q / k / v + their biases, RoPE or YaRN, store).
void qk_norm_rope_store(const QkNormRopeStoreArgs& a, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
