// moe_fused's limits and workspace layout, without CUDA headers: the CUDA backend sizes its
// moe_fused workspace from these, and so does the coordinator's estimate of the backend's device
// memory (gpu_worker/cuda_step_scratch.h). moe_fused.h (the kernels) includes this file.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/formats/block_layouts.h"
#include "common/formats/quant.h"
#include "common/formats/tensor_type.h"

namespace moraine::cuda {

inline constexpr int kMoeMaxTokens = 16;   // tokens per call (decode / verify)
inline constexpr int kMoeMaxTopK = 32;     // experts per token

// Bytes of one padded activation block in shared memory and the workspace (moe_fused_dots.cuh's
// kQ8KStride / kQ80Stride say why they are padded; moe_fused.cu asserts they are these).
inline constexpr int64_t kMoeActStrideQ8K = 304, kMoeActStrideQ80 = 48;

// Activation row bytes for n values quantized as `act` (Q8_K, else Q8_0 or Q8_1: both padded to
// kMoeActStrideQ80 per 32 values, moe_fused_dots.cuh's kQ80Offset / kQ81Offset): whole 16-byte
// words plus a spare one.
inline int64_t moe_fused_act_stride(TensorType act, int64_t n) {
  const int64_t bytes = act == TensorType::Q8_K ? n / kQK_K * kMoeActStrideQ8K : n / kQK * kMoeActStrideQ80;
  return (bytes + 15) / 16 * 16 + 16;
}

// Byte offsets of the workspace's parts for `slots` (tokens x k) slots, each part 256-byte
// aligned. Counters first, at offsets that do not depend on the slot count, so the zeroed
// counters of one call are where the next call (any n, k) looks for them.
struct MoeWorkspaceLayout {
  size_t count_a = 0, count_b = 0, h = 0, hq = 0, slot_out = 0, total = 0;
};

inline MoeWorkspaceLayout moe_fused_workspace_layout(TensorType down_type, int64_t n_embd, int64_t n_ff,
                                                     int64_t slots) {
  const TensorType h_act = dot_activation_type(down_type);
  const int64_t h_blocks = n_ff / type_traits(h_act).block_elems;
  MoeWorkspaceLayout l;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at = (at + bytes + 255) / 256 * 256;
    return here;
  };
  l.count_a = take(sizeof(int) * static_cast<size_t>(int64_t{kMoeMaxTokens} * kMoeMaxTopK * h_blocks));
  // Row tiles of the smallest size: kWarps rows (moe_down_kernel), 8 (moe_down_units_kernel).
  l.count_b = take(sizeof(int) * static_cast<size_t>((n_embd + 7) / 8));
  l.h = take(sizeof(float) * static_cast<size_t>(slots * n_ff));
  l.hq = take(static_cast<size_t>(slots * moe_fused_act_stride(h_act, n_ff)));
  l.slot_out = take(sizeof(float) * static_cast<size_t>(slots * n_embd));
  l.total = at;
  return l;
}

}  // namespace moraine::cuda
