// The warp-unit form of the fused MoE (moe_fused_units.h), on the tiled kernels' shared pieces
// (kernels/cuda/moe_fused_internal.cuh).
#include "tools/kernel_bench/moe_fused_units.h"

#include <cuda_pipeline.h>

#include <algorithm>
#include <cstdint>

#include "common/formats/quant.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/moe_fused_dots.cuh"
#include "kernels/cuda/moe_fused_internal.cuh"

namespace moraine::kernel_bench {
namespace {

using namespace cuda::matvec_detail;
using namespace cuda::moe_detail;

// Unit `it` of this warp: units are dealt round-robin over the CTAs first, so every CTA (and so
// every SM of a one-wave grid) gets the same number +-1 whatever the expert count; the tiled grid
// gave 60 of 132 SMs two 32-row tiles and the rest one (30B-A3B, one token: 8 experts x 24 tiles
// = 192 CTAs).
__device__ __forceinline__ int unit_of_warp(int warp, int it) {
  return static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) * (warp + kWarps * it);
}

// Kernel 1: unit = (leader d, rows_a gate/up row pairs); a warp stages its unit's rows with
// cp.async, dots them against every token routed to the expert (gate_up_unit_h: the tiled kernel
// 1's dots and h expression), and counts the unit on the (expert, h block) counter: the warp that
// completes a block quantizes it. Only one CTA barrier (x published).
__global__ void __launch_bounds__(kThreads, 2) moe_gate_up_units_kernel(const MoeParams p) {
  extern __shared__ uint4 smem[];
  __shared__ SlotTables st;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const GateUpSmem sm = gate_up_smem(p, smem, warp);   // the tiled kernel 1's layout
  const bool same_x = sm.same_x;
  uint8_t* const xg = sm.xg;
  uint8_t* const xu = sm.xu;
  const int pair_words = sm.pair_words;
  uint4* const stage = sm.stage;
  const int n_leaders = find_leaders<kWarps>(p, st);
  const int units_per_expert = p.n_ff / p.rows_a;  // rows_a divides the h block, which divides n_ff
  const int n_units = n_leaders * units_per_expert;
  auto issue = [&](int it) {  // this warp's unit `it`, in flight (an empty group past the last)
    const int u = unit_of_warp(warp, it);
    if (u < n_units) {
      const int e = st.chosen[st.leader[u / units_per_expert]];
      const int row0 = (u % units_per_expert) * p.rows_a;
      const uint8_t* g = expert_tensor(p, 0, e);
      const uint8_t* up = expert_tensor(p, 1, e);
      for (int j = 0; j < p.rows_a; ++j) {
        const int64_t row = row0 + j;
        stage_row_async(g + row * p.gate_row_bytes, p.gate_row_bytes, stage + j * pair_words, lane);
        stage_row_async(up + row * p.up_row_bytes, p.up_row_bytes, stage + j * pair_words + p.gate_seg_words, lane);
      }
    }
    __pipeline_commit();
  };
  issue(0);
  allow_next_kernel();
  quantize_x<kWarps>(p, xg, xu, same_x, warp, lane);
  __syncthreads();  // x published; from here on every warp runs on its own
  const int h_block_rows = p.h_q8k ? kQK_K : kQK;
  const int h_blocks = p.n_ff / h_block_rows;
  const int lanes = lanes_per_row(p.n_embd / format_block_elems(p.gate_type));
  const int pairs = 32 / lanes / 2;  // gate/up row pairs per dot_rows call
  const bool by_rows = p.gate_type == p.up_type && pairs >= 1;
  for (int it = 0; unit_of_warp(warp, it) < n_units; ++it) {
    __pipeline_wait_prior(0);
    __syncwarp();
    const int u = unit_of_warp(warp, it);
    const int leader = st.leader[u / units_per_expert];
    const int e = st.chosen[leader];
    const int row0 = (u % units_per_expert) * p.rows_a;
    const uint8_t* g_base = expert_tensor(p, 0, e);
    const uint8_t* u_base = expert_tensor(p, 1, e);
    for_each_slot_of(p, st, e, lane, [&](int slot) {
      gate_up_unit_h(p, lanes, pairs, by_rows, stage, pair_words, g_base, u_base, row0, p.rows_a, slot, xg, xu,
                     lane);
    });
    __syncwarp();      // every lane is done with the buffer
    issue(it + 1);     // this warp's next unit flies meanwhile
    // This unit's h rows are done for expert e: the unit completing its activation block quantizes it.
    __threadfence();
    __syncwarp();
    const int h_block = row0 / h_block_rows;
    int* counter = p.count_a + leader * h_blocks + h_block;
    int last = 0;
    if (lane == 0) last = atomicAdd(counter, 1) == h_block_rows / p.rows_a - 1;
    if (__shfl_sync(0xffffffffu, last, 0) == 0) continue;
    __threadfence();
    for_each_slot_of(p, st, e, lane, [&](int slot) {
      quantize_block(p.h_q8k, p.q81 & kQ81H, p.h + static_cast<int64_t>(slot) * p.n_ff, h_block,
                     p.hq + static_cast<int64_t>(slot) * p.hq_stride, lane);
    });
    if (lane == 0) *counter = 0;  // the workspace is left zeroed for the next call
  }
}

// Kernel 2: unit = (leader d, rows_b rows of n_embd); the warp stages the rows (issued before
// waiting for kernel 1), then per token routed to the expert copies its quantized h into its own
// shared buffer (L2 reads with __ldcg, as the tiled down kernel), dots, writes the unweighted
// row; the unit completing a row chunk over all the experts (count_b) adds the weighted sums of
// those rows in top-k order.
__global__ void __launch_bounds__(kThreads, 2) moe_down_units_kernel(const MoeParams p) {
  extern __shared__ uint4 smem[];
  __shared__ SlotTables st;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int R = p.rows_b;
  const int unit_words = R * p.down_seg_words;
  const int act_words = p.hq_stride / 16;
  uint4* const act = smem + warp * (unit_words + act_words);
  uint4* const stage = act + act_words;
  const int n_leaders = find_leaders<kWarps>(p, st);
  const int chunks = p.n_embd / R;  // R divides n_embd (host)
  const int n_units = n_leaders * chunks;
  auto issue = [&](int it) {
    const int u = unit_of_warp(warp, it);
    if (u < n_units) {
      const uint8_t* w = expert_tensor(p, 2, st.chosen[st.leader[u / chunks]]);
      const int64_t r0 = static_cast<int64_t>(u % chunks) * R;
      for (int j = 0; j < R; ++j)
        stage_row_async(w + (r0 + j) * p.down_row_bytes, p.down_row_bytes, stage + j * p.down_seg_words, lane);
    }
    __pipeline_commit();
  };
  issue(0);             // the weights do not depend on kernel 1
  allow_next_kernel();  // the next kernel may launch now; it still waits for this grid's completion
  wait_for_previous_kernel();
  const int lanes = lanes_per_row(p.n_ff / format_block_elems(p.down_type));
  const int per_call = 32 / lanes;
  const uint8_t* ht = reinterpret_cast<const uint8_t*>(act);
  // Rows r0 .. r0 + R - 1 of every token's weighted sum, from the slots' rows in L2.
  auto add_weighted_sums = [&](int r0) {
    for (int i = lane; p.sum != nullptr && i < p.n_tokens * R; i += 32) {
      const int t = i / R, r = r0 + i % R;
      const float acc = weighted_sum_of_rows(p, st, t, r);
      store_sum(p, t, r, acc);
    }
  };
  for (int it = 0; unit_of_warp(warp, it) < n_units; ++it) {
    __pipeline_wait_prior(0);
    __syncwarp();
    const int u = unit_of_warp(warp, it);
    const int e = st.chosen[st.leader[u / chunks]];
    const int chunk = u % chunks;
    const int r0 = chunk * R;
    const uint8_t* d_base = expert_tensor(p, 2, e);
    for_each_slot_of(p, st, e, lane, [&](int slot) {
      const uint4* src = reinterpret_cast<const uint4*>(p.hq + static_cast<int64_t>(slot) * p.hq_stride);
      for (int i = lane; i < act_words; i += 32) act[i] = __ldcg(src + i);
      __syncwarp();
      float* y_row = slot_output_row(p, slot) + r0;
      for (int j0 = 0; j0 < R; j0 += per_call) {
        const int nr = min(per_call, R - j0);
        auto row_of = [&](int r) {
          return staged(stage + (j0 + r) * p.down_seg_words, d_base + static_cast<int64_t>(r0 + j0 + r) * p.down_row_bytes);
        };
        const float y = dot_rows(p.down_type, row_of, [&](int) { return ht; }, nr, p.n_ff, lane);
        if (lane % lanes == 0 && lane / lanes < nr) y_row[j0 + lane / lanes] = y;
      }
      __syncwarp();  // act is rewritten for the next slot
    });
    issue(it + 1);
    // Every expert's unit of this row chunk counts once; the last one adds the weighted sums.
    __threadfence();
    __syncwarp();
    int* counter = p.count_b + chunk;
    int last = 0;
    if (lane == 0) last = atomicAdd(counter, 1) == n_leaders - 1;
    if (__shfl_sync(0xffffffffu, last, 0) == 0) continue;
    __threadfence();
    add_weighted_sums(r0);
    if (lane == 0) *counter = 0;
  }
  // No expert present at all: no units; the sums are still written (0, or the residual + 0).
  for (int it = 0; n_leaders == 0 && unit_of_warp(warp, it) < chunks; ++it) add_weighted_sums(unit_of_warp(warp, it) * R);
}

// A grid of one wave of two CTAs per SM, at most a CTA per unit; 0 where two CTAs of `smem` do not
// fit on an SM (every one-CTA-per-SM form measured slower than the tiled kernels). A whole wave
// even when fewer warps would hold the units: the units are dealt over the CTAs first, so each SM
// gets its share.
int units_grid(int64_t smem, int64_t max_units, const MoeDeviceInfo& dev) {
  const int64_t need = smem + static_cast<int64_t>(sizeof(SlotTables));
  if (need > dev.smem_optin) return 0;
  const int64_t per_sm = std::min<int64_t>(2, dev.smem_per_sm / (need + 1024));
  if (per_sm < 2) return 0;
  return static_cast<int>(std::clamp<int64_t>(max_units, 1, per_sm * dev.sms));
}

}  // namespace

MoeUnitsRan moe_fused_units(const cuda::MoeLayerWeights& w, const float* x, const cuda::MoeRouting& routing,
                            const cuda::MoeOutputs& out, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  MoeParams p = moe_call_params(w, x, routing, out, workspace, workspace_bytes);
  const MoeDeviceInfo dev = moe_device_info();
  const bool pdl = w.programmatic_launch && dev.cc_major >= 9;
  const TiledPlan t = plan_tiled(p, w, dev);  // either kernel's fallback
  p.rows_a = t.gate_up.rows_per_warp;
  p.rows_b = t.down.rows_per_warp;
  const int64_t leaders_max = std::min<int64_t>(p.n_slots, w.n_expert);
  // Kernel 1: pairs per unit, one dot_rows call's worth; they must divide the h block (the unit's
  // counter is per block).
  const int64_t h_block = type_traits(dot_activation_type(w.down_type)).block_elems;
  int pairs = std::max(1, 32 / lanes_per_row(static_cast<int>(w.n_embd / type_traits(w.gate_type).block_elems)) / 2);
  while (pairs > 1 && h_block % pairs != 0) pairs /= 2;
  const bool same_x = same_x_format(p);
  const int64_t smem_a = int64_t{p.n_tokens} * (p.xg_stride + (same_x ? 0 : p.xu_stride)) +
                         int64_t{kWarps} * pairs * (p.gate_seg_words + p.up_seg_words) * 16;
  const int grid_a = units_grid(smem_a, leaders_max * (w.n_ff / pairs), dev);
  // Kernel 2: rows per unit, a dot_rows call's worth, at least 8 (the counters' granularity) and
  // at most 32.
  const int rows_per_call_b = 32 / lanes_per_row(static_cast<int>(w.n_ff / type_traits(w.down_type).block_elems));
  int grid_b = 0, rows_b = 0;
  int64_t smem_b = 0;
  for (int r : {std::clamp(rows_per_call_b, 8, 32), 8}) {
    if (grid_b > 0 || w.n_embd % r != 0) continue;
    smem_b = int64_t{kWarps} * (int64_t{r} * p.down_seg_words * 16 + p.hq_stride);
    grid_b = units_grid(smem_b, leaders_max * (w.n_embd / r), dev);
    rows_b = r;
  }
  if (grid_a > 0) p.rows_a = pairs;
  if (grid_b > 0) p.rows_b = rows_b;

  cudaLaunchConfig_t cfg{};
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  if (grid_a > 0) {
    ensure_dynamic_smem(reinterpret_cast<const void*>(moe_gate_up_units_kernel), dev.device, smem_a);
    cfg.gridDim = dim3(static_cast<unsigned>(grid_a));
    cfg.dynamicSmemBytes = static_cast<size_t>(smem_a);
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, moe_gate_up_units_kernel, p));
  } else {
    launch_tiled_gate_up(p, t.gate_up, dev, stream);
  }
  if (grid_b > 0) {
    ensure_dynamic_smem(reinterpret_cast<const void*>(moe_down_units_kernel), dev.device, smem_b);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.gridDim = dim3(static_cast<unsigned>(grid_b));
    cfg.dynamicSmemBytes = static_cast<size_t>(smem_b);
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, moe_down_units_kernel, p));
  } else {
    launch_tiled_down(p, t.down, dev, pdl, stream);
  }
  return {grid_a > 0, grid_b > 0};
}

}  // namespace moraine::kernel_bench
