// The staged decode form of the fused MoE (MoeLayerWeights::Tuning::staged; design in
// moe_staged.cu). Internal to moe_fused.cu, which validates the call, fills StagedParams from its
// own parameters and falls back to its other kernels when moe_staged_launch declines.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/moe_fused.h"

namespace moraine::cuda::moe_detail {

// Tokens the staged form serves per call (decode, short speculative verify); more fall back.
inline constexpr int kStagedMaxTokens = 4;
inline constexpr int kStagedMaxSlots = kStagedMaxTokens * kMoeMaxTopK;
inline constexpr int kStagedMaxDepth = 8;  // kernel 1's units in flight per warp, at most

struct StagedParams {
  int gate_type, up_type, down_type;  // TensorType values
  bool x_gate_q8k, x_up_q8k, h_q8k;   // activation formats: Q8_K (true) or Q8_0
  bool vec_loads;                     // MoeLayerWeights::Tuning::vector_loads
  int n_embd, n_ff, n_expert;
  int n_tokens, k, n_slots;
  const MoeExpertSlot* slots;
  const uint8_t *gate_base, *up_base, *down_base;
  int64_t gate_expert_bytes, up_expert_bytes, down_expert_bytes;
  int64_t gate_row_bytes, up_row_bytes, down_row_bytes;
  const int32_t* chosen;
  const float* weight;
  const float* x;
  float* sum;
  bool sum_accumulate;
  float* slot_rows;
  const int32_t* slot_row_of;
  float* h;  // workspace: F32 h [slot][n_ff]
  // Padded activation bytes per token (x for gate, x for up, h for down) and 16-byte words per
  // staged row (moe_fused.cu's act_stride / seg_words).
  int xg_stride, xu_stride, hq_stride;
  int gate_seg_words, up_seg_words, down_seg_words;
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
};

// Fills p's plan fields (unit_pairs .. max_leaders) for the current device and says whether the
// call fits the form (at most kStagedMaxTokens tokens, buffers within an SM's shared memory beside
// each other). Needs the fields above the plan ones except the pointers.
bool moe_staged_plan(StagedParams& p);

// Launches the two staged kernels on `stream` and returns true, or returns false without
// launching anything when the call does not fit the form (more than kStagedMaxTokens tokens,
// per-row dots, buffers beyond an SM's shared memory). pdl_down / pdl_gate_up: launch the down
// kernel / kernel 1 programmatically (the caller has checked the device and launch.h's switch).
bool moe_staged_launch(StagedParams p, bool pdl_down, bool pdl_gate_up, cudaStream_t stream);

}  // namespace moraine::cuda::moe_detail
