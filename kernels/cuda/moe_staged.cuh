// The staged decode form of the fused MoE (MoeLayerWeights::Form; design in moe_staged.cu).
// Internal to moe_fused.cu, which validates the call, fills StagedParams from its own parameters
// and falls back to the tiled kernels when moe_staged_launch declines.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/moe_fused.h"
#include "kernels/cuda/moe_fused_dots.cuh"
#include "kernels/cuda/moe_fused_internal.cuh"   // MoeDeviceInfo, ensure_dynamic_smem

namespace moraine::cuda::moe_detail {

// Tokens the staged form serves per call (decode, short speculative verify); more fall back.
inline constexpr int kStagedMaxTokens = 4;
inline constexpr int kStagedMaxSlots = kStagedMaxTokens * kMoeMaxTopK;
inline constexpr int kStagedMaxDepth = 8;  // kernel 1's units in flight per warp, at most

// The call (MoeParams, filled by moe_fused.cu; these kernels read its shared fields, not the
// tiled kernels' rows and workspace counters) and the staged form's plan.
struct StagedParams : MoeParams {
  // Filled by moe_staged_plan.
  int unit_pairs;      // kernel 1: gate/up row pairs per unit (one dot_rows call's worth)
  int warp_slots;      // kernel 1: unit buffers per warp (units in flight per warp)
  int rows_per_cta;    // kernel 2: output rows per CTA
  int max_leaders;     // kernel 2: distinct experts its buffer holds (min(n_slots, n_expert))
  // MoeLayerWeights::Form::kBest: moe_staged_plan declines the calls where this form measured
  // slower than the tiled kernels (its comment has the numbers). Host only.
  bool only_where_faster;
};

// Fills p's plan fields (unit_pairs .. max_leaders) for the current device and says whether the
// form takes the call: it fits (at most kStagedMaxTokens tokens, buffers within an SM's shared
// memory beside each other) and, with only_where_faster, it measured faster there. Needs the
// fields above the plan ones except the call's pointers.
bool moe_staged_plan(StagedParams& p);

// Launches the two staged kernels on `stream` and returns true, or returns false without
// launching anything when moe_staged_plan declines the call. pdl_down: launch the down kernel
// programmatically (the caller has checked the device).
bool moe_staged_launch(StagedParams p, bool pdl_down, cudaStream_t stream);

}  // namespace moraine::cuda::moe_detail
