#include "coordinator/device_reserve.h"

#include <algorithm>

namespace moraine::group {

std::uint64_t cuda_device_reserve_bytes(const model::Model& m, std::int64_t max_tokens, std::int64_t context) {
  const model::HParams& hp = m.hp;
  const std::uint64_t T = static_cast<std::uint64_t>(std::max<std::int64_t>(max_tokens, 1));
  const std::uint64_t k = static_cast<std::uint64_t>(std::max<std::int64_t>(hp.n_expert_used, 1));
  const std::uint64_t S = T * k;   // expert rows of a step
  const std::uint64_t d = static_cast<std::uint64_t>(hp.n_embd);
  const std::uint64_t q_dim = static_cast<std::uint64_t>(hp.n_head * hp.head_dim);
  const std::uint64_t kv = static_cast<std::uint64_t>(hp.n_head_kv * hp.head_dim);
  const std::uint64_t ff = static_cast<std::uint64_t>(hp.n_ff_exp), shexp = static_cast<std::uint64_t>(hp.n_ff_shexp);
  const std::uint64_t max_cols = std::max<std::uint64_t>(
      {d, q_dim, ff, shexp, static_cast<std::uint64_t>(std::max<std::int64_t>(hp.ssm_value_dim(), 0))});
  const std::uint64_t ctx = static_cast<std::uint64_t>(std::max<std::int64_t>(context, T));
  std::uint64_t floats = 0;
  floats += 3 * T * d;                        // residual, normalised rows, matmul output
  floats += T * (2 * q_dim + 2 * kv);         // q (+ gate) | k | v rows of a step
  floats += 2 * T * q_dim + 2 * T * kv;       // q after norm/RoPE, attention output, new k and v
  floats += std::min<std::uint64_t>(T, 16) * static_cast<std::uint64_t>(hp.n_head) * ((ctx + 255) / 256 + 64) *
            (static_cast<std::uint64_t>(hp.head_dim) + 4);   // split-KV records (the largest of the three kernels')
  floats += S * max_cols;                     // quantized activations (never more bytes than floats)
  floats += T * static_cast<std::uint64_t>(hp.n_expert) + 2 * S;   // router logits, weights, chosen
  floats += static_cast<std::uint64_t>(hp.n_layer) * S;             // every layer's chosen ids
  floats += 2 * S * d;                        // the device's and the cpu workers' expert rows
  floats += std::min<std::uint64_t>(T, 16) * static_cast<std::uint64_t>(hp.n_vocab);   // logits, 16 rows a pass
  if (shexp > 0) floats += 2 * T * shexp + T * d + T;
  if (hp.ssm_n_v_heads > 0) {
    const std::uint64_t conv = static_cast<std::uint64_t>(hp.ssm_conv_dim()), value = static_cast<std::uint64_t>(hp.ssm_value_dim());
    const std::uint64_t nv = static_cast<std::uint64_t>(hp.ssm_n_v_heads);
    floats += T * (conv + 2 * value + 2 * nv) + T * (conv + 2 * nv);   // mixed, z, ba, core + the mixer's workspace
  }
  std::uint64_t bytes = floats * sizeof(float);
  if (T >= 64) {   // prefill GEMM: BF16 weight and input staging, cuBLAS workspace, the per-expert path's rows
    bytes += (std::uint64_t{20} << 20) * 2 + S * max_cols * 2 + (std::uint64_t{32} << 20);
    bytes += S * (2 * d + 2 * ff) * sizeof(float) + 3 * S * sizeof(std::int32_t);
  }
  bytes += std::uint64_t{16} << 20;   // moe_fused's workspace and the small tables (slot table, flags)
  // The driver rounds every cudaMalloc up to 2 MiB pages: the weights arena's own allocations
  // (a layer's expert slabs, the largest tensors; kernels/cuda/device_buffer.h), ~40 scratch
  // buffers, and the arena's last, partly used 64 MiB chunk.
  bytes += (static_cast<std::uint64_t>(hp.n_layer) + 48) * (std::uint64_t{2} << 20) + (std::uint64_t{64} << 20);
  return bytes + kCudaContextReserve;
}

std::uint64_t cuda_host_resident_bytes(const model::Model& m) {
  if (!m.tok_embd || m.output.data == m.tok_embd.data) return 0;
  return m.tok_embd.row_bytes * static_cast<std::uint64_t>(m.tok_embd.n_rows);
}

}  // namespace moraine::group
