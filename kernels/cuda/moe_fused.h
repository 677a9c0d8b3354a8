// Routed experts of one MoE layer on the GPU for a few tokens (decode and speculative verify):
// every selected expert's SwiGLU FFN, y = down(silu(gate x) * up x), on quantized weights read
// in place, then the route-weighted sum per token:
//   sum[t] = sum over s < k, expert chosen[t][s] present on this GPU, of weight[t][s] * y(t, s)
// added in top-k order (s ascending), as reference::moe_combine adds the slots. Optionally also
// the unweighted y(t, s) rows (the group's expert_out rows, ExpertPlan order).
//
// The arithmetic is the scalar reference's (common/reference/moe_parts.cpp swiglu_expert): x is
// quantized to dot_activation_type(gate/up type) exactly as reference::pack_activations does
// (Q8_0 and Q8_1 with llama.cpp's x86 rule, Q8_K with the reference rule), gate and up rows are dotted with
// the same per-block float terms as vec_dot_reference (matvec_formats.cuh), h = silu(g) * u in
// float, h quantized to dot_activation_type(down type) the same way, down likewise. Only the
// order of float additions and the last bits of expf differ.
//
// Design: two launches on the caller's stream, nothing allocated per call, in one of two forms
// with the same bits (MoeLayerWeights::Form):
//  - the staged form (moe_staged.cu, whose header says how): both kernels one wave, no counters;
//    kernel 1 puts every gate/up row in flight at once, the down kernel fetches its rows of every
//    chosen expert beside kernel 1 and adds the weighted dots in top-k order. It runs up to 4
//    tokens where its buffers fit, except for Q8_0 experts, where it measured slower: H200,
//    30B-A3B Q4_K, one token, 17.4 us per layer against 23.4 for the tiled kernels.
//  - the tiled kernels (moe_fused.cu), everywhere else:
//    1. gate/up kernel: grid (row tiles of n_ff) x (groups). Every CTA lists the "leader" slots
//       (first slot naming each present expert) and serves leaders g, g + groups, ...; for each,
//       it handles every token routed to that expert, so each weight row is read once per step
//       however many of the n tokens chose the expert. Each warp copies its rows of gate and up
//       into shared memory with cp.async (the next expert's prefetched while the current one
//       finishes) and dots them against x, which the CTA quantizes into shared memory meanwhile
//       (x rows are small and L2-resident, and doing it here saves a launch). h goes to the
//       workspace as F32; the CTA that finishes the last row tile of an activation block (32 or
//       256 rows, counted with an atomic) quantizes that block for down, so h is quantized once.
//    2. down kernel: the same leader scheme over row tiles of n_embd; the CTA copies the
//       quantized h of its expert's tokens into shared memory, each warp dots its down rows,
//       writes the unweighted rows, and the CTA that finishes a row tile last (atomic count over
//       the groups) adds the weighted sums in top-k order: deterministic, no float atomics. A
//       programmatic dependent launch on sm_90+: its CTAs start while kernel 1 runs (as far as
//       registers and shared memory allow) and fetch their down rows before waiting for h.
//    Rows per warp (at least one dot_rows call's worth when that fits) and groups are chosen per
//    call so the grid is one wave of 2 CTAs per SM when it can be. Why not one CTA per (expert,
//    256-row block) keeping h in shared memory: Qwen3-30B-A3B decode has 8 experts x 3 blocks =
//    24 CTAs for 132 SMs, far too few to pull HBM bandwidth; the F32 h (n*k*n_ff floats, <= 400
//    KB) round-trips through L2, not HBM.
//  Dots (dot_rows, moe_fused_dots.cuh): the lanes of a warp split into groups of L = blocks per
//  row (rounded up to a power of two, <= 32); each group takes one row, each lane whole weight
//  blocks of it (all of a block's parts in one lane, then the block's exact float term), so
//  there are no per-block shuffles and lanes on the same block index share the activation word
//  across rows; kernel 1 puts gate row j and up row j in adjacent groups of one call (where a
//  pair fits: the per-row dot_staged otherwise, for gate and up of different formats or rows of
//  more than 16 blocks). Activations are stored padded (kQ8KStride, kQ80Stride) so that the Q4_K
//  and Q8_0 dots read them, and Q4_K its weights, as 16-byte words (29 shared loads per Q4_K
//  block and lane where the generic per-part code takes ~130).
//  The variants measured against these and removed, and the warp-unit kernels the bench keeps
//  (tools/kernel_bench/moe_fused_units.cu): docs/perf-log.md.
//
// Memory contract: weight rows are read as aligned 16-byte words (as matvec.h), so each
// expert's gate/up/down tensor must start 16-byte aligned and be readable up to the next
// multiple of 16 past its end (cudaMalloc'd slabs and DeviceBuffer are). All pointers are device
// pointers; routing and outputs may live anywhere in device memory.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/formats/tensor_type.h"
#include "kernels/cuda/moe_fused_workspace.h"   // kMoeMaxTokens, kMoeMaxTopK, the workspace layout

namespace moraine::cuda {

// One expert's three tensors ([n_ff][n_embd], [n_ff][n_embd], [n_embd][n_ff], row-major, in
// their GGUF formats). gate == nullptr: the expert is not on this GPU; its slots are skipped.
struct MoeExpertSlot {
  const void* gate = nullptr;
  const void* up = nullptr;
  const void* down = nullptr;
};

struct MoeLayerWeights {
  TensorType gate_type = TensorType::F32, up_type = TensorType::F32, down_type = TensorType::F32;
  int64_t n_embd = 0, n_ff = 0, n_expert = 0;
  // Either a slot table (device array [n_expert], e.g. the VRAM expert cache's map from expert id
  // to slab addresses; entries may be changed between calls) ...
  const MoeExpertSlot* slots = nullptr;
  // ... or, when slots is null, one tensor per kind holding all n_expert experts back to back
  // (GGUF's ffn_*_exps layout): expert e at base + e * (bytes of one expert's matrix).
  const void* gate = nullptr;
  const void* up = nullptr;
  const void* down = nullptr;
  // Which kernels run; every form gives the same bits (tests/cuda/moe_fused_test.cpp).
  enum class Form {
    kBest,    // the staged form where moe_staged_plan takes the call and it measured faster (not
              // Q8_0 experts), else the tiled kernels: what the CUDA backend runs
    kTiled,   // the tiled kernels always (the fallback, for the test and bench to compare)
    kStaged,  // the staged form wherever its buffers fit, else the tiled kernels (test, bench)
  };
  Form form = Form::kBest;
  // The down kernels launched programmatically on sm_90+, their rows fetched while kernel 1 runs
  // (the staged form at 30B-A3B Q4_K, one token: 20.8 us per layer, 25.3 without). false: plain
  // launches, what a device below sm_90 runs, for the tests (compute-sanitizer refused
  // programmatic launches).
  bool programmatic_launch = true;
  // gpt-oss (ExpertsPart::biases, Activation::SwiGluClamped): per-expert biases by expert id (device
  // [n_expert][n_ff] for gate and up, [n_expert][n_embd] for down; nullable), and the clamped SwiGLU
  // g = min(gate + bg, limit), u = clamp(up + bu, -limit, limit), h = g sigmoid(alpha g) (u + 1);
  // y = down h + bd (reference::biased_expert). Such a layer runs the tiled kernels built for it
  // (the other instantiations are untouched); its gate / up formats must not be issue 26's or IQ.
  const float* gate_bias = nullptr;
  const float* up_bias = nullptr;
  const float* down_bias = nullptr;
  bool swiglu_clamped = false;
  float swiglu_alpha = 1.702f, swiglu_limit = 7.0f;
  bool oss() const { return gate_bias != nullptr || up_bias != nullptr || down_bias != nullptr || swiglu_clamped; }
};

struct MoeRouting {
  int n_tokens = 0;               // 1..kMoeMaxTokens
  int k = 0;                      // 1..kMoeMaxTopK
  const int32_t* chosen = nullptr;  // device [n_tokens][k]; ids outside 0..n_expert-1 count as absent
  const float* weight = nullptr;    // device [n_tokens][k]
};

struct MoeOutputs {
  // Device [n_tokens][n_embd], overwritten (a token none of whose experts is present gets 0).
  // May be null when only slot_rows are wanted.
  float* sum = nullptr;
  // Optional device rows of n_embd floats: the unweighted down output of slot i = t*k + s goes
  // to slot_rows + row * n_embd, row = slot_row_of[i] (a device array, e.g. ExpertPlan::row_of)
  // or i when slot_row_of is null. Rows of slots whose expert is absent are not written.
  float* slot_rows = nullptr;
  const int32_t* slot_row_of = nullptr;
  // sum[t][r] = sum[t][r] + (the weighted sum), one rounded float addition, instead of
  // overwriting: adds the routed experts straight into a residual stream, bit-identical to
  // writing the sum and then adding it (as moe_combine's x + acc does).
  bool sum_accumulate = false;
};

// Shape and formats check: throws std::invalid_argument naming the problem (a format without a
// matvec kernel, n_embd / n_ff not multiples of the formats' blocks, rows too long for the
// shared-memory staging). moe_fused calls it too.
void moe_fused_check(const MoeLayerWeights& w);

// Whether moe_fused with w (its form) runs the staged kernels (moe_staged.cu) for n_tokens tokens
// of top-k on the current device, rather than the tiled ones (tests, bench).
bool moe_fused_staged_applies(const MoeLayerWeights& w, int n_tokens, int k);

// Workspace (device memory, 256-byte aligned) for up to max_tokens tokens of top-k: scratch h,
// its quantized form, per-slot outputs and the completion counters. Sized once, e.g. for the
// model's n_embd / n_ff / k and max tokens; it must be zeroed once after allocation
// (moe_fused_workspace_init) and is left zeroed by every completed call. One workspace per
// stream: two calls in flight at once must not share it.
size_t moe_fused_workspace_bytes(const MoeLayerWeights& w, int max_tokens, int k);
void moe_fused_workspace_init(void* workspace, size_t bytes, cudaStream_t stream = nullptr);

// x: device [n_tokens][n_embd] F32 (the normalised MoE input). Asynchronous on `stream`.
// Throws std::invalid_argument for bad shapes, counts or a too small workspace.
void moe_fused(const MoeLayerWeights& w, const float* x, const MoeRouting& routing,
               const MoeOutputs& out, void* workspace, size_t workspace_bytes,
               cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
