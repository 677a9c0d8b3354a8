// Staged decode form of the fused MoE (MoeLayerWeights::Form; contract in moe_fused.h,
// launcher declared in moe_staged.cuh). Two launches, no counters, no atomics, no second pass:
//  1. moe_staged_gate_up_kernel: one CTA per SM (one wave). The (chosen expert, gate/up row
//     pair) work is cut into units of one dot_rows call's pairs; CTA c takes the c-th equal
//     contiguous run of units and its warps deal them round-robin. Every warp puts the gate and
//     up rows of all its units in flight at once with cp.async (one commit group per unit, so
//     it dots unit m as soon as m has landed), then calls allow_dependent_grids, quantizes x
//     into shared memory, and writes h = silu(g) * u as F32 to the workspace (plain stores: the
//     down kernel's griddepcontrol.wait makes them visible).
//  2. moe_staged_down_kernel (programmatic dependent launch): CTA = a slice of n_embd rows. It
//     fetches those rows of every chosen expert's down matrix BEFORE waiting for kernel 1 (its
//     CTAs sit beside kernel 1's on every SM: one CTA of each kernel fits in an SM's registers
//     and shared memory, which the launcher checks), then waits, quantizes every slot's h into
//     shared memory (the same warp quantizer as the tiled kernels: the same bytes), and one warp
//     per output row dots every slot's row and adds the weighted sums in top-k order.
// Why: the tiled kernels' time is per-warp dependent chains (halving the warps per SM cost ~3.5 us
// whatever else changed): rows, dot, h store, fence, atomic, quantize; then h copy, dot, y store,
// fence, atomic, sums. Here a warp's only chain is its rows' arrival, and the down rows arrive
// while kernel 1 runs.
// Bits: the same dot functions (moe_fused_dots.cuh) with the same row lengths, the same h
// expression, the same quantizer and the same sum order (acc = 0, then acc + w_s * y_s for
// s = 0..k-1 over present slots) as the tiled kernels, so the output is bit-identical
// (tests/cuda/moe_fused_test.cpp checks it).
#include <cuda_pipeline.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/formats/quant.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/moe_fused_dots.cuh"
#include "kernels/cuda/moe_staged.cuh"

namespace moraine::cuda::moe_detail {
namespace {

constexpr int kSWarps = 16;
constexpr int kSThreads = 32 * kSWarps;
static_assert(kSThreads >= kStagedMaxSlots, "one thread per slot in the routing scans");

// The routing in shared memory and the leader slots (find_leaders).
struct StagedRouting {
  int chosen[kStagedMaxSlots];
  int16_t leader[kStagedMaxSlots];
  int warp_count[kSWarps];
};

// Waits until at most `pending` of this thread's newest commit groups are still in flight
// (cp.async.wait_group takes an immediate); more than 7 waits for all but 7, which is only
// stricter.
__device__ __forceinline__ void wait_groups_pending(int pending) {
  switch (pending) {
    case 0: __pipeline_wait_prior(0); break;
    case 1: __pipeline_wait_prior(1); break;
    case 2: __pipeline_wait_prior(2); break;
    case 3: __pipeline_wait_prior(3); break;
    case 4: __pipeline_wait_prior(4); break;
    case 5: __pipeline_wait_prior(5); break;
    case 6: __pipeline_wait_prior(6); break;
    default: __pipeline_wait_prior(7); break;
  }
}

// Gate activation block u of x (blocks of every token in turn, as quantize_x deals them): the
// values quantize_block loads for it, 8 per lane for Q8_K, 1 (v[0]) for Q8_0.
__device__ __forceinline__ void load_x_block(const StagedParams& p, int u, float (&v)[8], int lane) {
  const int bg = p.n_embd / (p.x_gate_q8k ? kQK_K : kQK);
  const float* row = p.x + static_cast<int64_t>(u / bg) * p.n_embd;
  if (p.x_gate_q8k) {
    const float4* s = reinterpret_cast<const float4*>(row + (u % bg) * kQK_K + 8 * lane);
    const float4 lo = __ldcg(s), hi = __ldcg(s + 1);
    v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
  } else {
    v[0] = __ldcg(row + (u % bg) * kQK + lane);
  }
}

// quantize_x for kernel 1 with the warp's first gate block already loaded (first; the warp's
// blocks are u = warp, warp + kSWarps, ...): the same quantizers on the same values, so the same
// bytes.
__device__ void staged_quantize_x(const StagedParams& p, uint8_t* xg, uint8_t* xu, bool same_x, int warp, int lane,
                                  const float (&first)[8]) {
  const int bg = p.n_embd / (p.x_gate_q8k ? kQK_K : kQK);
  for (int u = warp; u < p.n_tokens * bg; u += kSWarps) {
    float v[8];
    if (u == warp) {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = first[i];
    } else {
      load_x_block(p, u, v, lane);
    }
    uint8_t* dst = xg + (u / bg) * p.xg_stride;
    if (p.x_gate_q8k) {
      quantize_detail::quantize_q8_k_warp(
          v, *reinterpret_cast<BlockQ8_K*>(dst + (u % bg) * kQ8KStride + kQ8KOffset), lane);
    } else {
      quantize_q8_0_or_1_llama(p.q81 & kQ81GateX, v[0], dst + (u % bg) * kQ80Stride, lane);
    }
  }
  if (!same_x) {
    const int bu = p.n_embd / (p.x_up_q8k ? kQK_K : kQK);
    for (int u = warp; u < p.n_tokens * bu; u += kSWarps)
      quantize_block(p.x_up_q8k, p.q81 & kQ81UpX, p.x + static_cast<int64_t>(u / bu) * p.n_embd, u % bu,
                     xu + (u / bu) * p.xu_stride, lane);
  }
}

// The routing as every warp of kernel 1 builds it itself when a call has at most 32 slots (decode
// and short verify windows): lane i holds slot i's expert, the leaders (find_leaders' list) are a
// lane mask. Why: find_leaders' shared-memory tables and three CTA barriers sat between the
// routing's arrival and the first row copy (ncu: ~20% of kernel 1's stall samples before its
// main loop, 30B-A3B Q4_K, 1 token).
struct WarpRouting {
  int e = -1;             // this lane's slot's expert (-1 past n_slots)
  unsigned leaders = 0u;  // lanes whose slot is the first naming its (present) expert
};

__device__ __forceinline__ WarpRouting warp_routing(const StagedParams& p, int lane) {
  WarpRouting w;
  w.e = lane < p.n_slots ? p.chosen[lane] : -1;
  const bool present = lane < p.n_slots && expert_present(p, w.e);
  const unsigned same = __match_any_sync(0xffffffffu, w.e);
  w.leaders = __ballot_sync(0xffffffffu, present && __ffs(same) - 1 == lane);
  return w;
}

// Leader q's expert (every lane of the warp calls it with the same q).
__device__ __forceinline__ int warp_leader_expert(const WarpRouting& w, int q) {
  unsigned m = w.leaders;
  for (int i = 0; i < q; ++i) m &= m - 1;
  return __shfl_sync(0xffffffffu, w.e, __ffs(m) - 1);
}

// FixedRows' row length in blocks (0 for void: the run-time kernels).
template <class Shape>
struct FixedBlocks : std::integral_constant<int, Shape::kRowBlocks> {};
template <>
struct FixedBlocks<void> : std::integral_constant<int, 0> {};

// FG: the gate/up rows' FixedRows (gate and up of one format, a dot_rows call holding a pair) when
// the launcher picked a kernel built for them, else void (any formats and lengths, at run time).
template <class FG>
__global__ void __launch_bounds__(kSThreads, 2) moe_staged_gate_up_kernel(const StagedParams p) {
  extern __shared__ uint4 smem[];
  __shared__ StagedRouting rt;
  wait_for_prior_grids();  // launch.h's contract (a no-op unless launched programmatically)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // This warp's first block of x, loaded before anything else: loaded after the rows' copies it
  // queued behind them (ncu, 30B-A3B Q4_K, 1 token: 15% of kernel 1's stall samples sat on its
  // first use, while every warp waits for x at the barrier below).
  float x_first[8] = {};
  if (warp < p.n_tokens * (p.n_embd / (p.x_gate_q8k ? kQK_K : kQK))) load_x_block(p, warp, x_first, lane);
  const bool same_x = same_x_format(p);
  uint8_t* xg = reinterpret_cast<uint8_t*>(smem);
  uint8_t* xu = same_x ? xg : xg + p.n_tokens * p.xg_stride;
  const int pair_words = p.gate_seg_words + p.up_seg_words;
  const int unit_words = p.unit_pairs * pair_words;
  uint4* const ring = reinterpret_cast<uint4*>(xg + p.n_tokens * (p.xg_stride + (same_x ? 0 : p.xu_stride))) +
                      warp * p.warp_slots * unit_words;

  const bool by_warp = p.n_slots <= 32;  // CTA-uniform
  WarpRouting wr;
  int n_leaders;
  if (by_warp) {
    wr = warp_routing(p, lane);
    n_leaders = __popc(wr.leaders);
  } else {
    n_leaders = find_leaders<kSWarps>(p, rt);
  }
  auto leader_expert = [&](int q) { return by_warp ? warp_leader_expert(wr, q) : rt.chosen[rt.leader[q]]; };
  const int units_per_expert = p.n_ff / p.unit_pairs;
  const int64_t n_units = int64_t{n_leaders} * units_per_expert;
  // Unit ids fit an int (moe_staged_plan: n_slots * n_ff < 2^31); 32-bit division per unit.
  const int first = static_cast<int>(n_units * blockIdx.x / gridDim.x);
  const int here = static_cast<int>(n_units * (blockIdx.x + 1) / gridDim.x) - first;
  const int mine = here > warp ? (here - warp + kSWarps - 1) / kSWarps : 0;
  const int depth = p.warp_slots;  // groups in flight per warp (empty ones past `mine`)
  // This warp's units in order (unit m is first + warp + kSWarps * m), walked by two cursors (the
  // issue and the compute loop), each a (leader, unit within the expert) pair advanced by kSWarps
  // units a step, and its ring buffer index: the per-unit divisions (u / units per expert,
  // m % depth) were ~70 of kernel 1's ~1100 instructions per unit (ncu SASS counts, 30B-A3B Q4_K).
  struct Cursor {
    int q, r, slot;  // leader index, unit within its expert, ring buffer
  };
  auto start = [&]() {
    const int u = first + warp;
    return Cursor{u / units_per_expert, u % units_per_expert, 0};
  };
  auto advance = [&](Cursor& c) {
    c.r += kSWarps;
    while (c.r >= units_per_expert) {
      c.r -= units_per_expert;
      ++c.q;
    }
    c.slot = c.slot + 1 == depth ? 0 : c.slot + 1;
  };
  Cursor in = start(), out = start();  // the next unit to issue / to compute
  int issued = 0;                      // units issued so far (the commit groups: depth + m at step m)
  auto issue = [&]() {  // the next unit's rows in flight as one commit group (empty past the last)
    if (issued < mine) {
      const int e = leader_expert(in.q);
      const int row0 = in.r * p.unit_pairs;
      const uint8_t* g = expert_tensor(p, 0, e);
      const uint8_t* u = expert_tensor(p, 1, e);
      uint4* stage = ring + in.slot * unit_words;
      if constexpr (fixed_rows_aligned<FG>()) {
        // The unit's gate rows are one contiguous run of the expert's gate matrix (rows row0..),
        // its up rows another: copied as two runs into the unit's buffer, gate rows then up rows
        // with no padding (gate_up_unit_h's layout for aligned FixedRows). Why not per row with
        // stage_row_async: its address and word-count arithmetic took ~200 instructions per unit
        // (ncu SASS counts, 30B-A3B Q4_K: 18% of kernel 1's), this ~2 per 16-byte copy.
        constexpr int kRunWords = FG::kRowBytes / 16 * (32 / lanes_per_row(FG::kRowBlocks) / 2);  // a unit's pairs
        const uint4* gr = reinterpret_cast<const uint4*>(g + static_cast<int64_t>(row0) * FG::kRowBytes);
        const uint4* ur = reinterpret_cast<const uint4*>(u + static_cast<int64_t>(row0) * FG::kRowBytes);
#pragma unroll
        for (int i = lane; i < kRunWords; i += 32) {
          __pipeline_memcpy_async(stage + i, gr + i, 16);
          __pipeline_memcpy_async(stage + kRunWords + i, ur + i, 16);
        }
      } else {
        for (int j = 0; j < p.unit_pairs; ++j) {
          const int64_t row = row0 + j;
          stage_row_async(g + row * p.gate_row_bytes, p.gate_row_bytes, stage + j * pair_words, lane);
          stage_row_async(u + row * p.up_row_bytes, p.up_row_bytes, stage + j * pair_words + p.gate_seg_words, lane);
        }
      }
      advance(in);
    }
    ++issued;
    __pipeline_commit();
  };
  for (int m = 0; m < depth; ++m) issue();
  allow_dependent_grids();  // the down kernel's CTAs may start fetching their rows now
  staged_quantize_x(p, xg, xu, same_x, warp, lane, x_first);
  __syncthreads();  // x published; from here on every warp runs on its own
  // The tiled kernels' choice of dot (gate_up_unit_h).
  const int lanes =
      lanes_per_row(std::is_void_v<FG> ? p.n_embd / format_block_elems(p.gate_type) : FixedBlocks<FG>::value);
  const int pairs = 32 / lanes / 2;
  const bool by_rows = p.gate_type == p.up_type && pairs >= 1;
  for (int m = 0; m < mine; ++m) {
    wait_groups_pending(depth - 1);  // unit m's group (groups committed so far: depth + m)
    __syncwarp();
    const int e = leader_expert(out.q);
    const int row0 = out.r * p.unit_pairs;
    const uint4* stage = ring + out.slot * unit_words;
    const uint8_t* g_base = expert_tensor(p, 0, e);  // (unused by aligned per-shape rows: folded away)
    const uint8_t* u_base = expert_tensor(p, 1, e);
    // The slots naming e, ascending (for_each_slot_of's order), from the warp's routing or the CTA's.
    for (int c0 = 0; c0 < p.n_slots; c0 += 32) {
      const bool match = by_warp ? wr.e == e : c0 + lane < p.n_slots && rt.chosen[c0 + lane] == e;
      for (unsigned m = __ballot_sync(0xffffffffu, match); m != 0; m &= m - 1)
        gate_up_unit_h<FG>(p, lanes, pairs, by_rows, stage, pair_words, g_base, u_base, row0, p.unit_pairs,
                           c0 + __ffs(m) - 1, xg, xu, lane);
    }
    __syncwarp();  // every lane is done with the buffer
    advance(out);
    issue();  // the unit that reuses it (if any)
  }
}

// Every present slot's h (kernel 1's F32 rows in L2) quantized into act [present q][hq_stride],
// block by block with quantize_block's loads and warp quantizers (the same bytes), the loads of a
// few blocks per warp issued before any is reduced (one L2 round trip per batch).
__device__ void staged_quantize_h(const StagedParams& p, const int16_t* present_list, int n_present, uint8_t* act,
                                  int warp, int lane) {
  if (p.h_q8k) {
    constexpr int kBatch = 2;
    const int hb = p.n_ff / kQK_K;
    const int total = n_present * hb;
    for (int u0 = warp; u0 < total; u0 += kBatch * kSWarps) {
      float v[kBatch][8];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int u = u0 + i * kSWarps;
        float4 lo = make_float4(0.0f, 0.0f, 0.0f, 0.0f), hi = lo;
        if (u < total) {
          const float* src = p.h + static_cast<int64_t>(present_list[u / hb]) * p.n_ff + (u % hb) * kQK_K + 8 * lane;
          lo = __ldcg(reinterpret_cast<const float4*>(src));
          hi = __ldcg(reinterpret_cast<const float4*>(src) + 1);
        }
        v[i][0] = lo.x, v[i][1] = lo.y, v[i][2] = lo.z, v[i][3] = lo.w;
        v[i][4] = hi.x, v[i][5] = hi.y, v[i][6] = hi.z, v[i][7] = hi.w;
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int u = u0 + i * kSWarps;
        if (u < total)
          quantize_detail::quantize_q8_k_warp(
              v[i], *reinterpret_cast<BlockQ8_K*>(act + (u / hb) * p.hq_stride + (u % hb) * kQ8KStride + kQ8KOffset), lane);
      }
    }
    return;
  }
  constexpr int kBatch = 8;
  const int hb = p.n_ff / kQK;
  const int total = n_present * hb;
  for (int u0 = warp; u0 < total; u0 += kBatch * kSWarps) {
    float v[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int u = u0 + i * kSWarps;
      v[i] = u < total ? __ldcg(p.h + static_cast<int64_t>(present_list[u / hb]) * p.n_ff + (u % hb) * kQK + lane) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int u = u0 + i * kSWarps;
      if (u < total) quantize_q8_0_or_1_llama(p.q81 & kQ81H, v[i], act + (u / hb) * p.hq_stride + (u % hb) * kQ80Stride, lane);
    }
  }
}

// FD: the down rows' FixedRows when the launcher picked a kernel built for them, else void.
template <class FD>
__global__ void __launch_bounds__(kSThreads, 2) moe_staged_down_kernel(const StagedParams p) {
  extern __shared__ uint4 smem[];
  __shared__ StagedRouting rt;
  __shared__ int16_t leader_index[kStagedMaxSlots];  // by leader slot: its index in rt.leader
  __shared__ int16_t present_list[kStagedMaxSlots];  // present slots, ascending
  __shared__ int16_t slot_leader[kStagedMaxSlots];   // by present index: its expert's leader index
  __shared__ int16_t present_pos[kStagedMaxSlots];   // by slot: its present index, -1 when absent
  __shared__ uint8_t misalign[kStagedMaxSlots];      // by leader index: down tensor address mod 16
  __shared__ float weight[kStagedMaxSlots];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int R = p.rows_per_cta;
  const int row_base = blockIdx.x * R;
  const int rows_here = min(R, p.n_embd - row_base);
  const int y_stride = (p.n_slots + 3) / 4 * 4;
  uint8_t* act = reinterpret_cast<uint8_t*>(smem);
  float* ybuf = reinterpret_cast<float*>(act + p.n_slots * p.hq_stride);  // [warp][y_stride]
  uint4* stage = reinterpret_cast<uint4*>(ybuf + kSWarps * y_stride);      // [leader][R][down_seg_words]

  // The routing (and the slot table) were written before kernel 1 started, and kernel 1 released
  // this launch only after its own wait for them, so they are read before this kernel's wait
  // (moe_fused.cu's down kernels rely on the same): the rows can fly while kernel 1 runs.
  const int n_leaders = find_leaders<kSWarps>(p, rt);
  if constexpr (fixed_rows_aligned<FD>()) {
    // The slice's rows of a leader are one contiguous run of its down matrix: copied as such, the
    // CTA's threads over each run in turn, unpadded ([leader][R][row words]; row_of below). Why:
    // stage_down_slice's per-row copies took 21% of this kernel's instructions (ncu SASS counts,
    // 30B-A3B Q4_K, 1 token), issued beside kernel 1 on its SMs.
    constexpr int kRowWords = FD::kRowBytes / 16;
    for (int d = 0; d < n_leaders; ++d) {
      const uint4* src = reinterpret_cast<const uint4*>(expert_tensor(p, 2, rt.chosen[rt.leader[d]]) +
                                                        static_cast<int64_t>(row_base) * FD::kRowBytes);
      for (int i = threadIdx.x; i < rows_here * kRowWords; i += kSThreads)
        __pipeline_memcpy_async(stage + d * R * kRowWords + i, src + i, 16);
    }
    __pipeline_commit();
  } else {
    stage_down_slice<kSWarps>(p, rt, n_leaders, row_base, rows_here, R, stage, warp, lane);
    __pipeline_commit();
  }
  const int i = threadIdx.x;
  if (i < n_leaders) {
    leader_index[rt.leader[i]] = static_cast<int16_t>(i);
    misalign[i] = static_cast<uint8_t>(reinterpret_cast<uintptr_t>(expert_tensor(p, 2, rt.chosen[rt.leader[i]])) & 15);
  }
  if (i < p.n_slots) present_pos[i] = -1;
  const bool present = i < p.n_slots && expert_present(p, rt.chosen[i]);
  const int n_present = cta_compact<kSWarps>(present, present_list, rt.warp_count);  // barriers: the above is set
  if (i < n_present) {
    const int slot = present_list[i];
    present_pos[slot] = static_cast<int16_t>(i);
    int first = slot;  // the expert's leader: its first slot
    for (int j = 0; j < slot; ++j)
      if (rt.chosen[j] == rt.chosen[slot]) {
        first = j;
        break;
      }
    slot_leader[i] = leader_index[first];
  }

  wait_for_prior_grids();  // kernel 1's h (and everything before it) complete and visible
  if (i < p.n_slots) weight[i] = p.weight[i];
  staged_quantize_h(p, present_list, n_present, act, warp, lane);
  __pipeline_wait_prior(0);
  __syncthreads();

  // One warp per output row: every present slot's dot (the tiled kernels' dot_rows with the same row
  // length, rows of several experts in one call), then the weighted sum in top-k order.
  const int lanes =
      lanes_per_row(std::is_void_v<FD> ? p.n_ff / format_block_elems(p.down_type) : FixedBlocks<FD>::value);
  const int per_call = 32 / lanes;
  float* y = ybuf + warp * y_stride;
  for (int j = warp; j < rows_here; j += kSWarps) {
    const int64_t row = row_base + j;
    for (int q0 = 0; q0 < n_present; q0 += per_call) {
      const int nr = min(per_call, n_present - q0);
      auto row_of = [&](int c) {
        const int d = slot_leader[q0 + c];
        if constexpr (fixed_rows_aligned<FD>()) {
          return reinterpret_cast<const uint8_t*>(stage + (d * R + j) * (FD::kRowBytes / 16));
        } else {
          return reinterpret_cast<const uint8_t*>(stage + (d * R + j) * p.down_seg_words) +
                 ((misalign[d] + row * p.down_row_bytes) & 15);
        }
      };
      auto act_of = [&](int c) { return act + (q0 + c) * p.hq_stride; };
      const float v = dot_rows_as<FD>(p.down_type, row_of, act_of, nr, p.n_ff, lane);
      const int c = lane / lanes;
      if (lane % lanes == 0 && c < nr) {
        y[q0 + c] = v;
        if (p.slot_rows != nullptr) {
          const int slot = present_list[q0 + c];
          const int out_row = p.slot_row_of != nullptr ? p.slot_row_of[slot] : slot;
          p.slot_rows[static_cast<int64_t>(out_row) * p.n_embd + row] = v;
        }
      }
    }
    __syncwarp();
    for (int t = lane; p.sum != nullptr && t < p.n_tokens; t += 32) {
      float acc = 0.0f;  // reference::moe_combine's order: slots s = 0..k-1
      for (int s = 0; s < p.k; ++s) {
        const int q = present_pos[t * p.k + s];
        if (q >= 0) acc = __fadd_rn(acc, __fmul_rn(weight[t * p.k + s], y[q]));
      }
      store_sum(p, t, row, acc);
    }
    __syncwarp();  // y is rewritten for the next row
  }
}

using StagedKernel = void (*)(StagedParams);
using Q4KRows8 = FixedRows<FormatQ45_K<false>, 8>;  // gate/up rows of 2048 (Qwen3-30B-A3B, Qwen3-Next)

// Every built form of the two kernels: per shape for the common expert formats and sizes (Q4_K
// gate/up of 2048; Q4_K and Q6_K down rows of 768 and 512: Q4_K_M files mix the two formats),
// the run-time switch (void) for the rest.
constexpr StagedKernel kGateUpKernels[] = {moe_staged_gate_up_kernel<Q4KRows8>, moe_staged_gate_up_kernel<void>};
constexpr StagedKernel kDownKernels[] = {
    moe_staged_down_kernel<FixedRows<FormatQ45_K<false>, 3>>, moe_staged_down_kernel<FixedRows<FormatQ45_K<false>, 2>>,
    moe_staged_down_kernel<FixedRows<FormatQ6_K, 3>>,         moe_staged_down_kernel<FixedRows<FormatQ6_K, 2>>,
    moe_staged_down_kernel<void>};

// The kernels built for p's formats and row lengths, else the run-time ones.
struct StagedKernels {
  StagedKernel gate_up, down;
};
StagedKernels staged_kernels(const StagedParams& p) {
  const auto t = [](int v) { return static_cast<TensorType>(v); };
  StagedKernels k{moe_staged_gate_up_kernel<void>, moe_staged_down_kernel<void>};
  if (t(p.gate_type) == TensorType::Q4_K && p.up_type == p.gate_type && p.n_embd == 8 * kQK_K)
    k.gate_up = moe_staged_gate_up_kernel<Q4KRows8>;
  const int down_blocks = p.n_ff % kQK_K == 0 ? p.n_ff / kQK_K : 0;
  const int pick = t(p.down_type) == TensorType::Q4_K ? 0 : t(p.down_type) == TensorType::Q6_K ? 2 : -1;
  if (pick >= 0 && (down_blocks == 3 || down_blocks == 2)) k.down = kDownKernels[pick + (down_blocks == 3 ? 0 : 1)];
  return k;
}

struct StagedDevice : MoeDeviceInfo {
  int static_a = 0, static_b = 0;  // the kernels' static shared memory (the same for every format)
};

StagedDevice staged_device() {
  thread_local StagedDevice info{{-1, 0, 0, 0, 0}};
  const MoeDeviceInfo dev = moe_device_info();
  if (dev.device != info.device) {
    static_cast<MoeDeviceInfo&>(info) = dev;
    cudaFuncAttributes a{}, b{};
    CUDA_CHECK(cudaFuncGetAttributes(&a, kGateUpKernels[0]));
    CUDA_CHECK(cudaFuncGetAttributes(&b, kDownKernels[0]));
    info.static_a = static_cast<int>(a.sharedSizeBytes);
    info.static_b = static_cast<int>(b.sharedSizeBytes);
    // Both kernels' CTAs share an SM (kernel 2's fetch its rows beside kernel 1's): the SM must
    // run with its largest shared-memory carveout whichever kernel it starts with.
    for (const StagedKernel k : kGateUpKernels)
      CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      static_cast<int>(cudaSharedmemCarveoutMaxShared)));
    for (const StagedKernel k : kDownKernels)
      CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      static_cast<int>(cudaSharedmemCarveoutMaxShared)));
  }
  return info;
}

// Shared memory of the two kernels for a planned p.
struct StagedSmem {
  int64_t a = 0, b = 0;
};

StagedSmem staged_smem(const StagedParams& p) {
  const int64_t y_stride = (p.n_slots + 3) / 4 * 4;
  const bool same_x = same_x_format(p);
  const int64_t x_bytes = int64_t{p.n_tokens} * (p.xg_stride + (same_x ? 0 : p.xu_stride));
  const int64_t unit_bytes = int64_t{p.unit_pairs} * (p.gate_seg_words + p.up_seg_words) * 16;
  return {x_bytes + int64_t{kSWarps} * p.warp_slots * unit_bytes,
          int64_t{p.n_slots} * p.hq_stride + int64_t{kSWarps} * y_stride * 4 +
              int64_t{p.max_leaders} * p.rows_per_cta * p.down_seg_words * 16};
}

}  // namespace

bool moe_staged_plan(StagedParams& p) {
  if (p.n_tokens < 1 || p.n_tokens > kStagedMaxTokens || p.n_slots > kStagedMaxSlots) return false;
  if (int64_t{p.n_slots} * p.n_ff >= INT32_MAX) return false;  // kernel 1's unit ids are ints
  // Where this form is slower than the tiled kernels: Q8_0 experts (decided by the gate format;
  // 30B-A3B at one token 38.1 -> 39.8 us per layer on the H200, docs/perf-log.md).
  if (p.only_where_faster && static_cast<TensorType>(p.gate_type) == TensorType::Q8_0) return false;
  const StagedDevice dev = staged_device();
  constexpr int64_t kReserve = 1024;  // the per-CTA shared memory the driver keeps
  // Kernel 2: n_embd rows over one wave of CTAs; every chosen expert's rows of a slice staged.
  p.rows_per_cta = static_cast<int>((p.n_embd + dev.sms - 1) / dev.sms);
  p.max_leaders = static_cast<int>(std::min<int64_t>(p.n_slots, p.n_expert));
  p.unit_pairs = 1;
  p.warp_slots = 0;
  const int64_t smem_b = staged_smem(p).b;
  if (smem_b + dev.static_b > dev.smem_optin) return false;
  // Kernel 1: units of one dot_rows call's gate/up pairs (moe_gate_up_kernel's grouping), one
  // CTA per SM, as many units in flight per warp as the shared memory left beside kernel 2's CTA
  // holds (all of them when they fit).
  const TensorType gate_t = static_cast<TensorType>(p.gate_type);
  const int lanes = lanes_per_row(static_cast<int>(p.n_embd / type_traits(gate_t).block_elems));
  const int pairs = 32 / lanes / 2;
  p.unit_pairs = p.gate_type == p.up_type && pairs >= 1 ? pairs : 1;
  if (p.n_ff % p.unit_pairs != 0) return false;
  const int64_t units = int64_t{p.max_leaders} * (p.n_ff / p.unit_pairs);
  const int64_t per_cta = (units + dev.sms - 1) / dev.sms;
  const int64_t per_warp = (per_cta + kSWarps - 1) / kSWarps;
  const int64_t unit_bytes = int64_t{p.unit_pairs} * (p.gate_seg_words + p.up_seg_words) * 16;
  const int64_t x_bytes = staged_smem(p).a;  // warp_slots 0: the activations only
  const int64_t beside_b = dev.smem_per_sm - kReserve - dev.static_b - smem_b;
  const int64_t room = std::min<int64_t>(beside_b - kReserve - dev.static_a, dev.smem_optin - dev.static_a) - x_bytes;
  const int64_t slots = std::min<int64_t>({per_warp, room / (int64_t{kSWarps} * unit_bytes), kStagedMaxDepth});
  if (slots < 1) return false;
  p.warp_slots = static_cast<int>(slots);
  return true;
}

bool moe_staged_launch(StagedParams p, bool pdl_down, cudaStream_t stream) {
  if (!moe_staged_plan(p)) return false;
  const StagedDevice dev = staged_device();
  const StagedSmem smem = staged_smem(p);
  const int64_t smem_a = smem.a, smem_b = smem.b;
  const StagedKernels kern = staged_kernels(p);
  ensure_dynamic_smem(reinterpret_cast<const void*>(kern.gate_up), dev.device, smem_a);
  ensure_dynamic_smem(reinterpret_cast<const void*>(kern.down), dev.device, smem_b);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.blockDim = dim3(kSThreads);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.gridDim = dim3(static_cast<unsigned>(dev.sms));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem_a);
  cfg.numAttrs = 0;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern.gate_up, p));
  cfg.gridDim = dim3(static_cast<unsigned>((p.n_embd + p.rows_per_cta - 1) / p.rows_per_cta));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem_b);
  cfg.numAttrs = pdl_down ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern.down, p));
  return true;
}

}  // namespace moraine::cuda::moe_detail
