// The Gated DeltaNet kernels' shape and workspace size, without CUDA headers: the CUDA backend
// sizes its DeltaNet scratch from these, and so does the coordinator's estimate of the backend's
// device memory (gpu_worker/cuda_step_scratch.h). delta_net.h (the kernels) includes this file.
#pragma once
#include <cstdint>

namespace moraine::cuda {

struct DeltaNetShape {
  int64_t n_k_heads = 0;    // query/key heads (ssm.group_count)
  int64_t n_v_heads = 0;    // value heads, a multiple of n_k_heads (ssm.time_step_rank)
  int64_t head_k_dim = 0;   // d_k, 1..128 (the recurrence keeps a head's state in registers)
  int64_t head_v_dim = 0;   // d_v, 1..256
  int64_t conv_kernel = 0;  // K, 1..16

  int64_t key_dim() const { return n_k_heads * head_k_dim; }
  int64_t value_dim() const { return n_v_heads * head_v_dim; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
  int64_t conv_state_floats() const { return (conv_kernel - 1) * conv_dim(); }
  int64_t ssm_state_floats() const { return n_v_heads * head_k_dim * head_v_dim; }
};

// delta_net_mix's workspace for n tokens: the conv output, beta and gate rows. Unchecked size
// math; delta_net_workspace_floats (delta_net.h) checks the shape and n first.
inline int64_t delta_net_mix_workspace_floats(const DeltaNetShape& s, int64_t n) {
  return n * (s.conv_dim() + 2 * s.n_v_heads);
}

}  // namespace moraine::cuda
