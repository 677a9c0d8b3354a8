// The Qwen3-30B-A3B decode layer that the chain benches time (pdl_chain_bench.cu: PDL off / on;
// mixer_bench_chain.cu: the small-kernel fusions): its sizes, random weights and the attention
// and q/k norm-rope-store arguments of one layer at one row. Host code; one copy for both.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cuda/attention_decode.h"
#include "kernels/cuda/qk_norm_rope_store.h"

namespace moraine::kernel_bench::decode_chain {

constexpr int64_t kEmbd = 2048, kHeads = 32, kKvHeads = 4, kHeadDim = 128, kExperts = 128, kTopK = 8;
constexpr int64_t kLayers = 48, kMaxCtx = 1024;
constexpr int64_t kQDim = kHeads * kHeadDim, kKvDim = kKvHeads * kHeadDim, kQkvRows = kQDim + 2 * kKvDim;

inline std::vector<float> normal(std::mt19937& rng, size_t n, float sd) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// rows x n weights from N(0, 0.05) quantized to Q8_0.
inline std::vector<uint8_t> q8_0(std::mt19937& rng, int64_t rows, int64_t n) {
  const std::vector<float> w = normal(rng, static_cast<size_t>(rows * n), 0.05f);
  const size_t rb = row_bytes(TensorType::Q8_0, n);
  std::vector<uint8_t> q(rb * static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) quantize_row(TensorType::Q8_0, w.data() + r * n, q.data() + r * rb, n);
  return q;
}

inline cuda::AttentionShape attention_shape() {
  cuda::AttentionShape shape;
  shape.n_head = kHeads;
  shape.n_head_kv = kKvHeads;
  shape.head_dim = kHeadDim;
  shape.kv_stride = kKvDim;
  shape.scale = 0.08838834764831845f;  // 1 / sqrt(128)
  return shape;
}

// One row's q|k|v (the stacked matvec's output) normalised, rotated at *pos and stored into the
// layer's caches; q to q_out.
inline cuda::QkNormRopeStoreArgs qk_args(float* qkv_out, const float* head_norm_w, const int32_t* pos, float* q_out,
                                         float* k_cache, float* v_cache) {
  cuda::QkNormRopeStoreArgs a;
  a.q = qkv_out;
  a.q_row_stride = kQkvRows;
  a.q_head_stride = kHeadDim;
  a.k = qkv_out + kQDim;
  a.k_row_stride = kQkvRows;
  a.v = a.k + kKvDim;
  a.v_row_stride = kQkvRows;
  a.q_norm = a.k_norm = head_norm_w;
  a.rows = 1;
  a.n_head = kHeads;
  a.n_head_kv = kKvHeads;
  a.head_dim = a.n_rot = kHeadDim;
  a.pos0_dev = pos;
  a.freq_base = 1e6;
  a.max_pos = kMaxCtx;
  a.q_out = q_out;
  a.k_cache = k_cache;
  a.v_cache = v_cache;
  return a;
}

}  // namespace moraine::kernel_bench::decode_chain
