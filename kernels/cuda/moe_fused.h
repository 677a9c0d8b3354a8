// Routed experts of one MoE layer on the GPU for a few tokens (decode and speculative verify):
// every selected expert's SwiGLU FFN, y = down(silu(gate x) * up x), on quantized weights read
// in place, then the route-weighted sum per token:
//   sum[t] = sum over s < k, expert chosen[t][s] present on this GPU, of weight[t][s] * y(t, s)
// added in top-k order (s ascending), as reference::moe_combine adds the slots. Optionally also
// the unweighted y(t, s) rows (the group's expert_out rows, ExpertPlan order).
//
// The arithmetic is the scalar reference's (common/reference/moe_parts.cpp swiglu_expert): x is
// quantized to dot_activation_type(gate/up type) exactly as reference::pack_activations does
// (Q8_0 with llama.cpp's x86 rule, Q8_K with the reference rule), gate and up rows are dotted with
// the same per-block float terms as vec_dot_reference (matvec_formats.cuh), h = silu(g) * u in
// float, h quantized to dot_activation_type(down type) the same way, down likewise. Only the
// order of float additions and the last bits of expf differ.
//
// Design (two launches on the caller's stream, nothing allocated per call):
//  1. gate/up kernel: grid (row tiles of n_ff) x (groups). Every CTA lists the "leader" slots
//     (first slot naming each present expert) and serves leaders g, g + groups, ...; for each, it
//     handles every token routed to that expert, so each weight row is read once per step however
//     many of the n tokens chose the expert. Each warp copies its rows of gate and up into
//     shared memory with cp.async (all in flight at once, the next expert's prefetched while the
//     current one finishes) and dots them against x, which the CTA quantizes into shared memory
//     meanwhile (x rows are small and L2-resident, and doing it here saves a launch). h goes to
//     the workspace as F32; with the per-expert down kernel, the CTA that finishes the last row
//     tile of an activation block (32 or 256 rows, counted with an atomic) quantizes that block
//     for down, so h is quantized once.
//  2a. down kernel per row tile (Tuning::Down::kPerRowTile; kAuto picks it when every slot's rows
//     of a tile fit in shared memory and its grid is one wave: up to 3 tokens at Q4_K, 1 (30B-A3B)
//     or 2 (Qwen3-Next) at Q8_0): CTA = R rows of n_embd for every
//     present slot. It stages those rows of every chosen expert before waiting for kernel 1,
//     then quantizes each slot's h itself from the F32 h (the same warp quantizer: the same
//     bytes; a block of h is quantized once per CTA instead of once, cheap next to the dots),
//     dots, and adds the weighted sums from shared memory. Why: the per-expert form's tail is a
//     chain of dependent L2 round trips (h quantize after an atomic in kernel 1; y rows out,
//     fence, atomic, then the last CTA reads k rows back), each step a few hundred ns at least,
//     next to ~5 us of bytes at one token (the expectation; not timed yet, see below).
//  2b. down kernel per expert (otherwise): the same leader scheme over row tiles of n_embd; the
//     CTA copies the quantized h of its expert's tokens into shared memory, each warp dots its
//     down rows, writes the unweighted rows, and the CTA that finishes a row tile last (atomic
//     count over the groups) adds the weighted sums in top-k order: deterministic, no float
//     atomics.
//  3. the staged form (Tuning::staged, kernels/cuda/moe_staged.cu; opt-in): both kernels one
//     wave, no counters; its header says how, Tuning::staged what it measured.
//  Either down kernel is a programmatic dependent launch on sm_90+: its CTAs start while kernel 1
//  runs (as far as registers and shared memory allow) and fetch their down rows before waiting
//  for kernel 1's h. Rows per warp (at least one dot_rows call's worth when that fits) and groups
//  are chosen per call so the grid is one wave of 2 CTAs per SM when it can be
//  (MoeLayerWeights::Tuning overrides these for the bench). Why not one CTA per (expert, 256-row
//  block) keeping h in shared memory: Qwen3-30B-A3B decode has 8 experts x 3 blocks = 24 CTAs for
//  132 SMs, far too few to pull HBM bandwidth; the F32 h (n*k*n_ff floats, <= 400 KB)
//  round-trips through L2, not HBM.
//  Dots (dot_rows in moe_fused.cu): the lanes of a warp split into groups of L = blocks per row
//  (rounded up to a power of two, <= 32); each group takes one row, each lane whole weight
//  blocks of it (all of a block's parts in one lane, then the block's exact float term), so
//  there are no per-block shuffles and lanes on the same block index share the activation word
//  across rows; kernel 1 puts gate row j and up row j in adjacent groups of one call. The
//  earlier per-row dot (dot_staged: 8 lanes per K-quant block, three shuffle levels per unit)
//  stays as MoeLayerWeights::Dots::kStaged for comparison (the bench times both). Activations
//  are stored padded (moe_fused.cu: kQ8KStride, kQ80Stride) so that the Q4_K and Q8_0 dots read
//  them, and Q4_K its weights, as 16-byte words: the generic per-part code takes ~130 four-byte
//  shared loads per Q4_K block and lane, the 16-byte form 29 loads for the same integer sums.
//  Measured on the H200 (moraine-kernel-bench cuda --moe-only; read kernel 4.56 TB/s), us per
//  layer, graph-replayed (stream-launched within 2 us of it), n = 1 / 8, with dot_staged:
//  Qwen3-30B-A3B Q4_K 29.0 / 165, Q8_0 32.6 / 191; Qwen3-Next Q4_K 33.4 / 167, Q8_0 34.8 / 193:
//  12-30% of the read bandwidth. Q8_0 (twice the bytes) takes hardly longer than Q4_K, and n = 8
//  (52 distinct experts of 128, 1.2 tokens each) costs about the same per (slot, row) dot as
//  n = 1: so the dots' issue bounds both, not HBM (inferred from these timings; by its PTX and
//  bank layout dot_staged spends ~150 instructions and ~45 shared-memory wavefronts per warp
//  per 32 K-quant sub-blocks, where dot_rows needs about a third).
//  Tried and dropped: one persistent launch (atomic work tickets, gate/up tiles before down
//  tiles, down tiles spinning on per-expert counters, two items' rows in flight per CTA): with
//  the same dots it took 46.8 / 163 (Q4_K) and 44.2 / 255 (Q8_0), slower at n = 1 because CTAs
//  holding a down tile idle until the expert's gate/up tiles finish; and four tokens per
//  unpacked weight part: 238 us at n = 8 (1 CTA per SM for the registers, and random routings
//  rarely put two tokens on one expert). The first version (one row per warp, register
//  staging, plain launches) took 48.6 / 235, 57.7 / 280, 52.7 / 256, 59.7 / 298. dot_rows with
//  the per-expert down kernel: Qwen3-30B-A3B Q4_K 26.3 / 119.6 (807 GB/s at n = 1, 18%).
//  The per-row-tile down kernel and the 16-byte loads passed cuda_moe_fused_test on the H200
//  (every form; memcheck clean) but have no timing yet: the bench's "auto" rows against
//  "expert-novec" (the previous default) measure them; MoeLayerWeights::Tuning's defaults are
//  the switch if they lose.
//  Warp-unit kernels (Tuning::gate_up_warp_units, down_warp_units, the default; moe_fused.cu
//  moe_gate_up_units_kernel / moe_down_units_kernel): the same dots, staging, h expression,
//  counters and top-k-order sums, but the grid is one wave of CTAs and the work is cut into
//  units of (expert, a dot_rows call's rows) dealt round-robin over the CTAs first, then their
//  warps; each warp stages, dots and counts its own units with no CTA barrier after the start.
//  Hypotheses: (a) balance: the tiled kernel 1 at one token (30B-A3B: 8 experts x 24 tiles =
//  192 CTAs on 132 SMs) gives 60 SMs two tiles and 72 one (148 KB of rows where the average is
//  107 KB); (b) no CTA-wide waits for the slowest warp; (c) at 8 tokens a warp holds its next
//  unit in flight while it dots (stages 2); (d) one CTA per SM leaves room for a down CTA that
//  fetches its rows while kernel 1 runs. Measured (H200, graph, us per layer, 1 / 8 tokens):
//  (a)+(b) give 4-10% (30B-A3B Q4_K 23.5 -> 22.1 / 108.6 -> 106.0; Qwen3-Next Q4_K 24.7 ->
//  22.1 / 107.2 -> 102.0, Q8_0 34.7 -> 33.7 / 189.0 -> 179.2; 30B-A3B Q8_0 with gate/up units
//  37.9 -> 37.6 / 221.6 -> 206.6), far from the read bandwidth's ~5 us; (c) and (d) lose
//  (25.7 and 25.5 / 30.2 us at 30B Q4_K one token): everything that halves the warps per SM
//  loses ~3.5 us even with all rows in flight from the start, and one pair per unit (twice the
//  units, half-filled dot_rows calls) 27.6. So the time is not the transfer and not the grid's
//  balance; per-warp latency chains (rows, dot, h store + fence + atomic, quantize; in kernel 2
//  h copy, dot, y store + fence + atomic, sums) and how many warps overlap them decide it. Not
//  profiled yet (ncu of the units kernels is the next step).
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
  // How the kernels form their dot products: kRows (dot_rows: one lane per weight block, rows of
  // a warp sharing the activation reads; the default) or kStaged (the earlier per-row dot, kept
  // as the bench's baseline). Same per-block terms either way; float addition order differs.
  enum class Dots { kRows, kStaged };
  Dots dots = Dots::kRows;
  // Launch shape and down-kernel form; the defaults pick per call. The bench sweeps these, the
  // test runs every form; results are the same (per-block terms) whatever they are.
  struct Tuning {
    // Kernel 1 weight rows per warp (1, 2, 4 or 8; 0: chosen per call).
    int gate_up_rows_per_warp = 0;
    // Kernel 1 grid: a CTA per (row tile, distinct expert) even past one wave (false: at most
    // one wave, CTAs serving several experts in turn when the tiles x experts exceed it).
    bool gate_up_cta_per_expert = false;
    // Kernel 1 row buffers per CTA: 2 keeps the next expert's rows in flight while one is dotted
    // (for CTAs serving several experts; twice the shared memory), 1 reuses one buffer.
    int gate_up_stages = 1;
    // Down kernel form: kPerExpert (CTA = one expert's row tile, the last CTA of a tile adds the
    // weighted sums; kernel 1 quantizes h) or kPerRowTile (CTA = a row tile for every slot,
    // quantizes the slots' h itself and adds the sums from shared memory: no counters, no
    // second pass through L2; only while all the slots' rows of a tile fit in shared memory,
    // else kPerExpert). kAuto: kPerRowTile when it fits.
    // Default kPerExpert: on the H200 (moraine-kernel-bench cuda --moe-only, graph, 2026-11-30)
    // 30B Q4_K 23.6 / 38.6 / 108.8 us at 1 / 2 / 8 tokens against kAuto's 23.7 / 38.1 / 108.6,
    // but 30B Q8_0 at 1 token 37.9 against 43.1: the row-tile form loses where it is chosen.
    enum class Down { kAuto, kPerExpert, kPerRowTile };
    Down down = Down::kPerExpert;
    int down_tile_rows = 0;  // kPerRowTile rows per CTA (8, 16 or 32; 0: chosen per call)
    // The Q4_K and Q8_0 dots read their activations (and Q4_K its weights) as 16-byte words
    // (false: the generic 4-byte and unaligned loads of matvec_formats.cuh; same integer sums).
    bool vector_loads = true;
    // The down kernel as a programmatic dependent launch on sm_90+ (false: a plain launch after
    // kernel 1; for measuring what the overlap gives).
    bool programmatic_launch = true;
    // Warp-unit forms (moe_fused.cu: moe_gate_up_units_kernel, moe_down_units_kernel): a grid of
    // one wave of CTAs whose warps each take (expert, few rows) units in turn, spread evenly over
    // the SMs, every warp on its own after the start (its own row buffers, its own completion
    // counter: no CTA barrier waits for the slowest warp). false: the tiled kernels above.
    // gate_up_warp_units uses gate_up_rows_per_warp as the pairs per unit (0: one dot_rows
    // call's worth) and gate_up_stages as the units in flight per warp; down_warp_units uses
    // down_stages likewise, implies h quantized by kernel 1 (the per-expert bookkeeping) and
    // ignores `down`. Each is used only where two CTAs fit on an SM (units_ctas_per_sm says
    // otherwise), else the tiled form runs: 30B-A3B Q8_0's down units need 128 KB per CTA.
    // Default on: H200, moraine-kernel-bench cuda --moe-only, graph, us per layer at 1 / 8 tokens,
    // tiled (the previous default) -> warp units in both kernels: 30B-A3B Q4_K 23.5 -> 22.1 /
    // 108.6 -> 106.0; Qwen3-Next Q4_K 24.7 -> 22.1 / 107.2 -> 102.0, Q8_0 34.7 -> 33.7 /
    // 189.0 -> 179.2; 30B-A3B Q8_0 (gate/up units, tiled down) 37.9 -> 37.6 / 221.6 -> 206.6.
    bool gate_up_warp_units = false;
    bool down_warp_units = false;
    int down_stages = 1;  // 1 or 2
    // CTAs per SM of the warp-unit grids: 0 (or 2) two, and the tiled kernel where two do not
    // fit; 1 one, which leaves room beside each kernel-1 CTA for a down CTA that fetches its
    // rows while kernel 1 still runs, but measured slower (30B-A3B Q4_K, 1 token: 25.5 us
    // against 22.1 with two): the warps per SM matter more.
    int units_ctas_per_sm = 0;
    // Kernel 1 as a programmatic dependent launch too (sm_90+, and launch.h's process switch on):
    // its launch overlaps the previous kernel's tail; its threads wait for that kernel before
    // reading anything (kernels/cuda/launch.h's contract). Measured with the bench's own
    // back-to-back calls only (the predecessor is the previous call's down kernel): Qwen3-Next
    // Q4_K 1 token 22.1 -> 21.6 us, the other rows within +-0.5 us.
    bool gate_up_programmatic_launch = false;
    // With down_warp_units: the down kernel quantizes each of its units' h rows itself (a few
    // warp reductions per unit and token) and kernel 1 ends after writing the F32 h, without the
    // fence, counter and block quantization on its critical path.
    bool down_quantizes_h = false;
    // The staged decode form (kernels/cuda/moe_staged.cu), up to 4 tokens with Dots::kRows: kernel
    // 1 is one CTA per SM whose warps put all their gate/up rows in flight at once (cp.async) and
    // write the F32 h; the down kernel, launched programmatically, owns a slice of output rows,
    // fetches those rows of every chosen expert before waiting for kernel 1 (its CTAs sit beside
    // kernel 1's), quantizes h itself, and one warp per output row dots every slot and adds the
    // weighted sums in top-k order: no counters, atomics or y round trip. Bit-identical to the
    // default path. Falls back to the kernels above where its buffers do not fit (the other
    // Tuning fields then apply; programmatic_launch and gate_up_programmatic_launch apply to it
    // too). Measured (H200, moraine-kernel-bench cuda --moe-only --moe-variants auto,sform, graph,
    // us per layer, default -> staged; 2026-11-30 run B, per-lane cp.async): 30B-A3B Q4_K 1 / 2
    // tokens 23.4 -> 20.8 / 38.4 -> 35.0, Qwen3-Next Q4_K 24.7 -> 20.3 / 35.3 -> 32.2; Q8_0
    // 1 token 38.1 -> 39.8 (30B) and 34.6 -> 34.7 (Next); 4 tokens fall back. The down kernel's
    // early row fetch is worth 4.4 us (30B Q4_K without its programmatic launch: 25.3). ncu
    // (isolated launches) timed kernel 1 at 14.6 us for 14 MB. Session 8: kernels built per shape
    // (moe_staged.cu's FixedRows forms: Q4_K gate/up rows of 2048, Q4_K/Q6_K down rows of 768 or
    // 512) cut kernel 1 to 2.74 M instructions from 4.23 M and the layer to 17.4 / 26.3 us (30B
    // Q4_K, 1 / 2 tokens) and 16.8 / 24.4 (Next); kernel 1 without its dots (an experiment
    // build) still takes 8.7 us of its 11.2 (ncu): its rows' transfer, beside the down kernel's
    // early fetch, is most of it now. Two kernel-1 CTAs per SM with the down rows prefetched to
    // L2 instead of fetched beside kernel 1 measured slower (22.1 / 28.6 us; branch
    // wip/moe-k1x2-l2prefetch). kOff: never (the default); kWhereFaster: where it measured faster
    // (moe_staged.cu's moe_staged_plan declines the rest: Q8_0 experts; what the CUDA backend
    // asks for); kWhereFits: wherever its buffers fit (the test and moraine-kernel-bench's "sform"
    // rows, to compare the forms).
    enum class Staged { kOff, kWhereFaster, kWhereFits };
    Staged staged = Staged::kOff;
    // With staged: kernel 1 takes a whole SM's shared memory for its rows (all in flight where
    // they fit: 30B-A3B Q8_0, 2 tokens) instead of leaving room for a down CTA beside it; the
    // down kernel then fetches its rows as kernel 1's CTAs leave.
    bool staged_k1_whole_sm = false;
    // With staged, on sm_90+: rows staged with bulk copies (cp.async.bulk, one instruction per
    // row, completing on shared-memory mbarriers) instead of per-lane 16-byte cp.async. Why: ncu
    // (H200, 30B-A3B Q4_K, 1 token, isolated launches) timed the cp.async kernel 1 at 14.6 us for
    // 14 MB (20% of DRAM) with every row in flight from the start.
    bool staged_bulk_copies = false;
  };
  Tuning tuning;
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

// Whether moe_fused with w (its dots and Tuning::staged) runs the staged kernels (moe_staged.cu)
// for n_tokens tokens of top-k on the current device, rather than the others (tests, bench).
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
