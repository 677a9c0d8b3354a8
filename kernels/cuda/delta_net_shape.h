// The Gated DeltaNet kernels' shape and workspace size, without CUDA headers: the CUDA backend
// sizes its DeltaNet scratch from these, and so does the coordinator's estimate of the backend's
// device memory (gpu_worker/cuda_step_scratch.h). delta_net.h (the kernels) includes this file.
#pragma once
#include <cstdint>

// The head maps below run on the device too; a plain C++ compiler sees host functions.
#if !defined(MORAINE_HOST_DEVICE)
#if defined(__CUDACC__)
#define MORAINE_HOST_DEVICE __host__ __device__
#else
#define MORAINE_HOST_DEVICE
#endif
#endif

namespace moraine::cuda {

struct DeltaNetShape {
  int64_t n_k_heads = 0;    // query/key heads (ssm.group_count)
  int64_t n_v_heads = 0;    // value heads, a multiple of n_k_heads (ssm.time_step_rank)
  int64_t head_k_dim = 0;   // d_k, 1..128 (the recurrence keeps a head's state in registers)
  int64_t head_v_dim = 0;   // d_v, 1..256
  int64_t conv_kernel = 0;  // K, 1..16
  // qwen35moe's layout (model::DeltaNetPart): value head hv reads key head hv % n_k_heads
  // (tiled) instead of hv / (n_v_heads / n_k_heads) (grouped, qwen3next); and a token's ba row
  // is [b of every value head | alpha of every value head] (ssm_beta and ssm_alpha stacked)
  // instead of grouped per key head.
  bool v_heads_tiled = false;
  bool split_ba = false;

  int64_t key_dim() const { return n_k_heads * head_k_dim; }
  int64_t value_dim() const { return n_v_heads * head_v_dim; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
  int64_t conv_state_floats() const { return (conv_kernel - 1) * conv_dim(); }
  int64_t ssm_state_floats() const { return n_v_heads * head_k_dim * head_v_dim; }
};

// The key head value head hv reads.
MORAINE_HOST_DEVICE inline int64_t delta_net_key_head(int64_t hv, int64_t n_k_heads, int64_t n_v_heads, bool tiled) {
  return tiled ? hv % n_k_heads : hv / (n_v_heads / n_k_heads);
}

// Where value head hv's b and alpha sit in a token's ba row of 2 * n_v_heads floats: split, b at
// hv and alpha at n_v + hv; grouped, key head g's [b of its r heads | alpha of them] from 2 r g.
MORAINE_HOST_DEVICE inline int64_t delta_net_b_index(int64_t hv, int64_t n_k_heads, int64_t n_v_heads, bool split) {
  const int64_t r = n_v_heads / n_k_heads;
  return split ? hv : hv / r * 2 * r + hv % r;
}
MORAINE_HOST_DEVICE inline int64_t delta_net_alpha_index(int64_t hv, int64_t n_k_heads, int64_t n_v_heads, bool split) {
  return delta_net_b_index(hv, n_k_heads, n_v_heads, split) + (split ? n_v_heads : n_v_heads / n_k_heads);
}

// delta_net_mix's workspace for n tokens: the conv output, beta and gate rows. Unchecked size
// math; delta_net_workspace_floats (delta_net.h) checks the shape and n first.
inline int64_t delta_net_mix_workspace_floats(const DeltaNetShape& s, int64_t n) {
  return n * (s.conv_dim() + 2 * s.n_v_heads);
}

}  // namespace moraine::cuda
