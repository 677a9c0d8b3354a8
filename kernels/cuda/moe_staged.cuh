// The staged decode form of the fused MoE (MoeLayerWeights::Tuning::staged; design in
// moe_staged.cu). Internal to moe_fused.cu, which validates the call, fills StagedParams from its
// own parameters and falls back to its other kernels when moe_staged_launch declines.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/moe_fused.h"
#include "kernels/cuda/moe_fused_dots.cuh"

namespace moraine::cuda::moe_detail {

// moe_fused.cu's host helpers, which the staged form's planner and launcher use too.
struct MoeDeviceInfo {
  int device, sms, smem_optin, smem_per_sm, cc_major;
};
MoeDeviceInfo moe_device_info();  // the current device's, read once per device and thread
// Raises kernel's dynamic shared-memory limit on `device` to `bytes` where it is lower (from the
// first launch on, not only past 48 KB: the kernels' static shared memory counts against the
// 48 KB a kernel gets without the attribute, so 47 KB of dynamic memory failed to launch with
// cudaErrorInvalidValue: the golden k256 models' down kernel, H200 2026-11-30).
void ensure_dynamic_smem(const void* kernel, int device, int64_t bytes);

// Tokens the staged form serves per call (decode, short speculative verify); more fall back.
inline constexpr int kStagedMaxTokens = 4;
inline constexpr int kStagedMaxSlots = kStagedMaxTokens * kMoeMaxTopK;
inline constexpr int kStagedMaxDepth = 8;  // kernel 1's units in flight per warp, at most

// The call (MoeParams, filled by moe_fused.cu; these kernels read its shared fields, not the
// tiled kernels' rows, workspace counters and forms) and the staged form's own switches and plan.
struct StagedParams : MoeParams {
  // Kernel 1 plans with a whole SM's shared memory (all its units in flight where they fit), so
  // the down kernel's CTAs start only as kernel 1's leave (Tuning::staged_k1_whole_sm).
  bool k1_whole_sm;
  // Rows staged with bulk copies (cp.async.bulk on mbarriers, sm_90+) instead of per-lane 16-byte
  // cp.async (Tuning::staged_bulk_copies; the host clears it below sm_90).
  bool bulk;
  // Filled by moe_staged_plan.
  int unit_pairs;      // kernel 1: gate/up row pairs per unit (one dot_rows call's worth)
  int warp_slots;      // kernel 1: unit buffers per warp (units in flight per warp)
  int rows_per_cta;    // kernel 2: output rows per CTA
  int max_leaders;     // kernel 2: distinct experts its buffer holds (min(n_slots, n_expert))
  // MoeLayerWeights::Tuning::Staged::kWhereFaster: moe_staged_plan declines the calls where this
  // form measured slower than the default kernels (its comment has the numbers). Host only.
  bool only_where_faster;
};

// Fills p's plan fields (unit_pairs .. max_leaders) for the current device and says whether the
// form takes the call: it fits (at most kStagedMaxTokens tokens, buffers within an SM's shared
// memory beside each other) and, with only_where_faster, it measured faster there. Needs the
// fields above the plan ones except the call's pointers.
bool moe_staged_plan(StagedParams& p);

// Launches the two staged kernels on `stream` and returns true, or returns false without
// launching anything when moe_staged_plan declines the call. pdl_down / pdl_gate_up: launch the down
// kernel / kernel 1 programmatically (the caller has checked the device and launch.h's switch).
bool moe_staged_launch(StagedParams p, bool pdl_down, bool pdl_gate_up, cudaStream_t stream);

}  // namespace moraine::cuda::moe_detail
