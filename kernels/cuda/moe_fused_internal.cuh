// The tiled fused-MoE kernels' pieces that the staged form (moe_staged.cu) and the kernel bench's
// warp-unit form (tools/kernel_bench/moe_fused_units.cu) share with moe_fused.cu: the device
// tables and helpers of the tiled kernels, the call's checks and parameters, and the tiled
// kernels' plans and launches. Internal: the public interface is moe_fused.h.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cuda/moe_fused.h"
#include "kernels/cuda/moe_fused_dots.cuh"

namespace moraine::cuda::moe_detail {

// ---- Device side of the tiled kernels.

constexpr int kWarps = 16;  // rows_per_warp weight rows (gate+up pairs, or down rows) per warp
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxSlots = kMoeMaxTokens * kMoeMaxTopK;
static_assert(kThreads >= kMaxSlots, "one thread per slot in the leader scan");

__device__ __forceinline__ float* slot_output_row(const MoeParams& p, int slot) {
  if (p.slot_rows == nullptr) return p.slot_out + static_cast<int64_t>(slot) * p.n_embd;
  const int row = p.slot_row_of != nullptr ? p.slot_row_of[slot] : slot;
  return p.slot_rows + static_cast<int64_t>(row) * p.n_embd;
}

// The routing in shared memory, and the leader slots (first slot of each present expert).
struct SlotTables {
  int chosen[kMaxSlots];
  int16_t leader[kMaxSlots];
  int16_t list[kMaxSlots];
  int warp_count[kWarps];
  int flag;
};

// Token t's weighted sum at output row r from the slots' unweighted rows (in L2, written by this
// launch's other CTAs or warps), added in reference::moe_combine's order (slots s = 0..k-1,
// present experts only): eight slots' loads issued together, then added in order, one L2 round
// trip per eight slots instead of one per slot.
__device__ __forceinline__ float weighted_sum_of_rows(const MoeParams& p, const SlotTables& st, int t, int r) {
  float acc = 0.0f;
  for (int s0 = 0; s0 < p.k; s0 += 8) {
    float wv[8], yv[8];
    bool use[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const int slot = t * p.k + s0 + q;
      use[q] = s0 + q < p.k && expert_present(p, st.chosen[slot]);
      wv[q] = use[q] ? p.weight[slot] : 0.0f;
      yv[q] = use[q] ? __ldcg(slot_output_row(p, slot) + r) : 0.0f;
    }
#pragma unroll
    for (int q = 0; q < 8; ++q)
      if (use[q]) acc = __fadd_rn(acc, __fmul_rn(wv[q], yv[q]));
  }
  return acc;
}

// Kernel 1's shared memory, as the tiled kernel and the bench's warp-unit kernel both carve it: x
// of every token quantized for gate (and for up when its format differs), then each warp's
// staged rows (gate row j at j * pair_words, up row j after it).
struct GateUpSmem {
  uint8_t* xg;
  uint8_t* xu;
  uint4* stage;     // this warp's rows
  int pair_words;   // one gate row and one up row, in uint4 words
  bool same_x;
};
__device__ __forceinline__ GateUpSmem gate_up_smem(const MoeParams& p, uint4* smem, int warp) {
  GateUpSmem m;
  m.same_x = same_x_format(p);
  m.xg = reinterpret_cast<uint8_t*>(smem);
  m.xu = m.same_x ? m.xg : m.xg + p.n_tokens * p.xg_stride;
  m.pair_words = p.gate_seg_words + p.up_seg_words;
  m.stage = reinterpret_cast<uint4*>(m.xg + p.n_tokens * (p.xg_stride + (m.same_x ? 0 : p.xu_stride))) +
            warp * p.rows_a * m.pair_words;
  return m;
}

// Programmatic dependent launch (sm_90+): the down kernel starts while kernel 1 runs, prefetches
// its rows, and waits for kernel 1's results here.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
#endif
}
__device__ __forceinline__ void allow_next_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();
#endif
}

// ---- Host side.

struct MoeDeviceInfo {
  int device, sms, smem_optin, smem_per_sm, cc_major;
};
MoeDeviceInfo moe_device_info();  // the current device's, read once per device and thread
// Raises kernel's dynamic shared-memory limit on `device` to `bytes` where it is lower (from the
// first launch on, not only past 48 KB: the kernels' static shared memory counts against the
// 48 KB a kernel gets without the attribute, so 47 KB of dynamic memory failed to launch with
// cudaErrorInvalidValue: the golden k256 models' down kernel, H200 2026-11-30).
void ensure_dynamic_smem(const void* kernel, int device, int64_t bytes);

// " (gate q4_k, up ..., n_embd=...)": the shape, for exception messages.
std::string where(const MoeLayerWeights& w);

// The fields of MoeParams that follow from the weights and the call's shape.
void fill_moe_params(MoeParams& p, const MoeLayerWeights& w, int n_tokens, int k);

// moe_fused's checks (std::invalid_argument naming the problem) and the call's MoeParams: all of
// them but the launch shape (rows_a, rows_b).
MoeParams moe_call_params(const MoeLayerWeights& w, const float* x, const MoeRouting& routing, const MoeOutputs& out,
                          void* workspace, size_t workspace_bytes);

// One tiled kernel's launch: weight rows per warp (the CTA tile is kWarps times that), row
// tiles, CTAs per tile (groups: each serves experts g, g + groups, ...) and dynamic shared memory.
struct KernelPlan {
  int rows_per_warp = 0, tiles = 0, groups = 0;
  int64_t smem = 0;
};
struct TiledPlan {
  KernelPlan gate_up, down;
};
// The tiled kernels' plans for the call p on dev; std::invalid_argument when the rows do not fit
// the shared-memory staging.
TiledPlan plan_tiled(const MoeParams& p, const MoeLayerWeights& w, const MoeDeviceInfo& dev);
// The tiled kernels on `stream`; p.rows_a / p.rows_b must be the plans' rows_per_warp. The down
// kernel is launched programmatically when pdl (the caller has checked the device).
void launch_tiled_gate_up(const MoeParams& p, const KernelPlan& plan, const MoeDeviceInfo& dev, cudaStream_t stream);
void launch_tiled_down(const MoeParams& p, const KernelPlan& plan, const MoeDeviceInfo& dev, bool pdl,
                       cudaStream_t stream);

}  // namespace moraine::cuda::moe_detail
