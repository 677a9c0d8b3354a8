// Fused routed-expert FFN (design and contract in moe_fused.h). Both kernels share the slot
// bookkeeping: every CTA loads the step's routing into shared memory, lists the "leader" slots
// (first slot naming each present expert, ascending) and serves leaders g, g + G, ... where g is
// its blockIdx.y and G = gridDim.y, so each expert's rows are read once per step by one CTA per
// row tile, with no host round trip to learn which experts were chosen.
#include "kernels/cuda/moe_fused.h"

#include <cuda_pipeline.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/moe_fused_dots.cuh"
#include "kernels/cuda/moe_staged.cuh"

namespace moraine::cuda {
namespace moe_detail {

MoeDeviceInfo moe_device_info() {
  thread_local int cached_device = -1;
  thread_local MoeDeviceInfo info{};
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  if (device != cached_device) {
    info.device = device;
    CUDA_CHECK(cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device));
    CUDA_CHECK(cudaDeviceGetAttribute(&info.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    CUDA_CHECK(cudaDeviceGetAttribute(&info.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    CUDA_CHECK(cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, device));
    cached_device = device;
  }
  return info;
}

void ensure_dynamic_smem(const void* kernel, int device, int64_t bytes) {
  // What each (kernel, device) was raised to, per thread: a launch costs a scan of the few
  // fused-MoE kernels, and cudaFuncSetAttribute only when the size grows.
  struct Raised {
    const void* kernel;
    int device;
    int64_t bytes;
  };
  thread_local std::vector<Raised> raised;
  auto it = std::find_if(raised.begin(), raised.end(),
                         [&](const Raised& r) { return r.kernel == kernel && r.device == device; });
  if (it != raised.end() && bytes <= it->bytes) return;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  if (it == raised.end()) {
    raised.push_back({kernel, device, bytes});
  } else {
    it->bytes = bytes;
  }
}

}  // namespace moe_detail
namespace {

using namespace matvec_detail;
using namespace moe_detail;

constexpr int kWarps = 16;           // rows_per_warp weight rows (gate+up pairs, or down rows) per warp
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

// The slots naming expert e, ascending, into st.list.
__device__ int list_slots(const MoeParams& p, SlotTables& st, int e) {
  const int i = threadIdx.x;
  return cta_compact<kWarps>(i < p.n_slots && st.chosen[i] == e, st.list, st.warp_count);
}

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


// Programmatic dependent launch (sm_90+): kernel 2 starts while kernel 1 runs, prefetches its
// down rows, and waits for kernel 1's results here.
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

// Kernel 1: h[slot][r] = silu(gate_e[r] . x_t) * (up_e[r] . x_t) for the rows r of this CTA's
// tile, for every slot (t, s) of each expert e this CTA serves; then the last CTA to finish a
// whole activation block of h (of one expert) quantizes it for down.
__global__ void __launch_bounds__(kThreads, 2) moe_gate_up_kernel(const MoeParams p) {
  extern __shared__ uint4 smem[];
  __shared__ SlotTables st;
  wait_for_previous_kernel();  // a no-op unless launched programmatically (Tuning::gate_up_programmatic_launch)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tile_rows = kWarps * p.rows_a;
  const int row0 = blockIdx.x * tile_rows + warp * p.rows_a;  // this warp's rows: row0 .. row0 + rows_a - 1
  const int h_block_rows = p.h_q8k ? kQK_K : kQK;
  const int h_block = blockIdx.x * tile_rows / h_block_rows;  // a tile lies in one block (host check)
  const int tiles_per_h_block = h_block_rows / tile_rows;
  const int h_blocks = p.n_ff / h_block_rows;
  const bool same_x = p.x_gate_q8k == p.x_up_q8k;

  // Shared memory: x of every token quantized for gate (and for up when its format differs),
  // then each warp's staged rows (gate row j at j * pair_words, up row j after it).
  uint8_t* xg = reinterpret_cast<uint8_t*>(smem);
  uint8_t* xu = same_x ? xg : xg + p.n_tokens * p.xg_stride;
  const int pair_words = p.gate_seg_words + p.up_seg_words;
  // stages_a buffers of the CTA's rows: with two, expert d + 2G's rows fly while d + G's are
  // dotted (CTAs serving several experts).
  uint4* const stage_base = reinterpret_cast<uint4*>(xg + p.n_tokens * (p.xg_stride + (same_x ? 0 : p.xu_stride))) +
                            warp * p.rows_a * pair_words;
  const int buffer_words = kWarps * p.rows_a * pair_words;
  auto issue_rows = [&](int d, int buffer) {  // this warp's rows of leader d's expert, in flight
    uint4* stage = stage_base + buffer * buffer_words;
    const int e = st.chosen[st.leader[d]];
    const uint8_t* g = expert_tensor(p, 0, e);
    const uint8_t* u = expert_tensor(p, 1, e);
    for (int j = 0; j < p.rows_a; ++j) {
      const int row = row0 + j;
      if (row >= p.n_ff) break;
      stage_row_async(g + row * p.gate_row_bytes, p.gate_row_bytes, stage + j * pair_words, lane);
      stage_row_async(u + row * p.up_row_bytes, p.up_row_bytes, stage + j * pair_words + p.gate_seg_words, lane);
    }
    __pipeline_commit();
  };

  const int n_leaders = find_leaders<kWarps>(p, st);
  if (blockIdx.y < n_leaders) issue_rows(blockIdx.y, 0);
  if (p.stages_a > 1 && blockIdx.y + gridDim.y < n_leaders) issue_rows(blockIdx.y + gridDim.y, 1);
  allow_next_kernel();
  quantize_x<kWarps>(p, xg, xu, same_x, warp, lane);  // while the first rows are in flight
  for (int d = blockIdx.y, it = 0; d < n_leaders; d += gridDim.y, ++it) {
    const int leader = st.leader[d];
    const int e = st.chosen[leader];
    const int count = list_slots(p, st, e);  // CTA barrier: also publishes x the first time
    const int buffer = it % p.stages_a;
    uint4* const stage = stage_base + buffer * buffer_words;
    if (p.stages_a > 1 && d + gridDim.y < n_leaders) {
      __pipeline_wait_prior(1);  // d's group; d + G's may still fly
    } else {
      __pipeline_wait_prior(0);
    }
    __syncwarp();
    const uint8_t* g_base = expert_tensor(p, 0, e);
    const uint8_t* u_base = expert_tensor(p, 1, e);
    const int valid_rows = min(p.rows_a, p.n_ff - row0);
    // Gate and up of one format: row pairs (gate j, up j) in adjacent lane groups of one
    // dot_rows call, so u reaches g's lanes with one shuffle (dot_rows' header says why).
    const int lanes = lanes_per_row(p.n_embd / format_block_elems(p.gate_type));
    const int pairs = 32 / lanes / 2;
    const bool by_rows = p.dots_by_rows && p.gate_type == p.up_type && pairs >= 1;
    for (int i = 0; by_rows && i < count; ++i) {
      const int slot = st.list[i], t = slot / p.k;
      for (int j0 = 0; j0 < valid_rows; j0 += pairs) {
        const int np = min(pairs, valid_rows - j0);
        auto row_of = [&](int c) {
          const int j = j0 + c / 2, row = row0 + j;
          return c % 2 == 0 ? staged(stage + j * pair_words, g_base + row * p.gate_row_bytes)
                            : staged(stage + j * pair_words + p.gate_seg_words, u_base + row * p.up_row_bytes);
        };
        const uint8_t* xt = xg + t * p.xg_stride;
        const float v = dot_rows(p.gate_type, row_of, [&](int) { return xt; }, 2 * np, p.n_embd, lane, p.vec_loads);
        const float u = __shfl_down_sync(0xffffffffu, v, lanes);  // up j, from the next group
        const int c = lane / lanes;
        if (lane % lanes == 0 && c % 2 == 0 && c / 2 < np) {
          // reference::silu(g) * u, with the reference's operations and rounding (expf aside).
          const float h = __fmul_rn(__fdiv_rn(v, __fadd_rn(1.0f, expf(-v))), u);
          p.h[static_cast<int64_t>(slot) * p.n_ff + row0 + j0 + c / 2] = h;
        }
      }
    }
    for (int j = 0; !by_rows && j < p.rows_a; ++j) {
      const int row = row0 + j;
      if (row >= p.n_ff) break;
      const uint8_t* gate_row = staged(stage + j * pair_words, g_base + row * p.gate_row_bytes);
      const uint8_t* up_row = staged(stage + j * pair_words + p.gate_seg_words, u_base + row * p.up_row_bytes);
      for (int i = 0; i < count; ++i) {
        const int slot = st.list[i], t = slot / p.k;
        const float g = dot_staged(p.gate_type, gate_row, p.n_embd, xg + t * p.xg_stride, lane, p.vec_loads);
        const float u = dot_staged(p.up_type, up_row, p.n_embd, xu + t * p.xu_stride, lane, p.vec_loads);
        // reference::silu(g) * u, with the reference's operations and rounding (expf aside).
        const float h = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
        if (lane == 0) p.h[static_cast<int64_t>(slot) * p.n_ff + row] = h;
      }
    }
    __syncwarp();
    const int next = d + p.stages_a * static_cast<int>(gridDim.y);
    if (next < n_leaders) issue_rows(next, buffer);  // the next expert's rows fly meanwhile
    // (The next list_slots' first barrier keeps st.list until every warp is done with it.)
    if (!p.k1_quantizes_h) continue;
    // This tile of h is done for expert e: the last tile of its activation block quantizes it.
    __threadfence();
    __syncthreads();
    int* counter = p.count_a + leader * h_blocks + h_block;
    if (threadIdx.x == 0) st.flag = atomicAdd(counter, 1) == tiles_per_h_block - 1;
    __syncthreads();
    if (st.flag) {
      __threadfence();
      for (int i = warp; i < count; i += kWarps) {
        const int slot = st.list[i];
        quantize_block(p.h_q8k, p.h + static_cast<int64_t>(slot) * p.n_ff, h_block, p.hq + static_cast<int64_t>(slot) * p.hq_stride, lane);
      }
      if (threadIdx.x == 0) *counter = 0;  // the workspace is left zeroed for the next call
    }
    __syncthreads();  // st.list and st.flag are rewritten for the next expert
  }
}

// Kernel 2: y(slot)[r] = down_e[r] . hq(slot) for the rows r of this CTA's tile; then the last CTA
// of the tile adds sum[t][r] over the token's present slots in top-k order.
__global__ void __launch_bounds__(kThreads, 2) moe_down_kernel(const MoeParams p) {
  extern __shared__ uint4 smem[];
  __shared__ SlotTables st;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tile_rows = kWarps * p.rows_b;
  const int row0 = blockIdx.x * tile_rows + warp * p.rows_b;
  uint8_t* act = reinterpret_cast<uint8_t*>(smem);
  uint4* stage = reinterpret_cast<uint4*>(act + p.pass_tokens * p.hq_stride) + warp * p.rows_b * p.down_seg_words;
  auto issue_rows = [&](int d) {
    const uint8_t* w = expert_tensor(p, 2, st.chosen[st.leader[d]]);
    for (int j = 0; j < p.rows_b; ++j) {
      const int row = row0 + j;
      if (row >= p.n_embd) break;
      stage_row_async(w + row * p.down_row_bytes, p.down_row_bytes, stage + j * p.down_seg_words, lane);
    }
    __pipeline_commit();
  };

  const int n_leaders = find_leaders<kWarps>(p, st);
  if (blockIdx.y < n_leaders) issue_rows(blockIdx.y);  // the weights do not depend on kernel 1
  wait_for_previous_kernel();
  for (int d = blockIdx.y; d < n_leaders; d += gridDim.y) {
    const int e = st.chosen[st.leader[d]];
    const int count = list_slots(p, st, e);
    for (int g0 = 0; g0 < count; g0 += p.pass_tokens) {
      const int nt = min(p.pass_tokens, count - g0);
      const int words = p.hq_stride / 16;
      for (int i = threadIdx.x; i < nt * words; i += kThreads) {
        const int t = i / words, w = i % words;
        reinterpret_cast<uint4*>(act + t * p.hq_stride)[w] =
            __ldcg(reinterpret_cast<const uint4*>(p.hq + static_cast<int64_t>(st.list[g0 + t]) * p.hq_stride) + w);
      }
      __pipeline_wait_prior(0);
      __syncthreads();
      const uint8_t* d_base = expert_tensor(p, 2, e);
      const int valid_rows = min(p.rows_b, p.n_embd - row0);
      const int lanes = lanes_per_row(p.n_ff / format_block_elems(p.down_type));
      const int per_call = p.dots_by_rows ? 32 / lanes : 1;
      for (int t = 0; t < nt; ++t) {
        for (int j0 = 0; j0 < valid_rows && !p.dots_by_rows; ++j0) {  // the earlier per-row dot
          const uint8_t* down_row = staged(stage + j0 * p.down_seg_words, d_base + (row0 + j0) * p.down_row_bytes);
          const float y = dot_staged(p.down_type, down_row, p.n_ff, act + t * p.hq_stride, lane, p.vec_loads);
          if (lane == 0) slot_output_row(p, st.list[g0 + t])[row0 + j0] = y;
        }
        for (int j0 = 0; j0 < valid_rows && p.dots_by_rows; j0 += per_call) {
          const int nr = min(per_call, valid_rows - j0);
          auto row_of = [&](int r) {
            return staged(stage + (j0 + r) * p.down_seg_words, d_base + (row0 + j0 + r) * p.down_row_bytes);
          };
          const uint8_t* ht = act + t * p.hq_stride;
          const float y = dot_rows(p.down_type, row_of, [&](int) { return ht; }, nr, p.n_ff, lane, p.vec_loads);
          if (lane % lanes == 0 && lane / lanes < nr) slot_output_row(p, st.list[g0 + t])[row0 + j0 + lane / lanes] = y;
        }
      }
      __syncthreads();  // act is rewritten by the next pass or expert
    }
    if (d + gridDim.y < n_leaders) issue_rows(d + gridDim.y);
  }
  // Every CTA of this row tile counts once; the last one adds the weighted sums.
  __threadfence();
  __syncthreads();
  int* counter = p.count_b + blockIdx.x;
  if (threadIdx.x == 0) st.flag = atomicAdd(counter, 1) == static_cast<int>(gridDim.y) - 1;
  __syncthreads();
  if (!st.flag) return;
  __threadfence();
  if (p.sum != nullptr) {
    for (int i = threadIdx.x; i < p.n_tokens * tile_rows; i += kThreads) {
      const int t = i / tile_rows, r = blockIdx.x * tile_rows + i % tile_rows;
      if (r >= p.n_embd) continue;
      const float acc = weighted_sum_of_rows(p, st, t, r);
      store_sum(p, t, r, acc);
    }
  }
  if (threadIdx.x == 0) *counter = 0;
}

// Kernel 2, per-row-tile form: the CTA owns rows row_base .. row_base + R - 1 of n_embd for every
// present slot. It stages those rows of every distinct expert (all in flight before it waits for
// kernel 1), quantizes the slots' h itself from kernel 1's F32 h (the same warp quantizer, so the
// same bytes as kernel 1's quantization would give), dots, keeps y in shared memory and adds the
// weighted sums in top-k order: no counters, no y round trip through L2, no "last CTA" step.
// Shared memory: the slots' quantized h [present slot][hq_stride], y [present slot][R] floats,
// then the staged rows [leader][R][down_seg_words].
__global__ void __launch_bounds__(kThreads, 2) moe_down_tile_kernel(const MoeParams p) {
  extern __shared__ uint4 smem[];
  __shared__ SlotTables st;
  __shared__ int16_t leader_index[kMaxSlots];  // by leader slot: its index in st.leader
  __shared__ int16_t slot_leader[kMaxSlots];   // by slot: its expert's leader's index in st.leader
  __shared__ int16_t present_pos[kMaxSlots];   // by slot: its index in st.list, -1 when absent
  __shared__ uint8_t misalign[kMaxSlots];      // by leader: the expert's down tensor address mod 16
  __shared__ float weight[kMaxSlots];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int R = p.tile_rows_d;
  const int row_base = blockIdx.x * R;
  const int rows_here = min(R, p.n_embd - row_base);
  uint8_t* act = reinterpret_cast<uint8_t*>(smem);
  float* ybuf = reinterpret_cast<float*>(act + p.n_slots * p.hq_stride);
  uint4* stage = reinterpret_cast<uint4*>(ybuf + p.n_slots * R);

  const int n_leaders = find_leaders<kWarps>(p, st);
  stage_down_slice<kWarps>(p, st, n_leaders, row_base, rows_here, R, stage, warp, lane);
  __pipeline_commit();
  const int i = threadIdx.x;
  if (i < n_leaders) {
    const int e = st.chosen[st.leader[i]];
    leader_index[st.leader[i]] = static_cast<int16_t>(i);
    misalign[i] = static_cast<uint8_t>(reinterpret_cast<uintptr_t>(expert_tensor(p, 2, e)) & 15);
  }
  const bool present = i < p.n_slots && expert_present(p, st.chosen[i]);
  if (i < p.n_slots) weight[i] = p.weight[i];
  const int n_present = cta_compact<kWarps>(present, st.list, st.warp_count);  // barrier: leader_index set
  if (i < p.n_slots) {
    int first = i;  // the expert's leader: its first slot
    for (int j = 0; present && j < i; ++j)
      if (st.chosen[j] == st.chosen[i]) {
        first = j;
        break;
      }
    slot_leader[i] = present ? leader_index[first] : int16_t{-1};
    present_pos[i] = -1;
  }
  __syncthreads();
  if (i < n_present) present_pos[st.list[i]] = static_cast<int16_t>(i);

  wait_for_previous_kernel();
  const int h_block_elems = p.h_q8k ? kQK_K : kQK;
  const int h_blocks = p.n_ff / h_block_elems;
  for (int u = warp; u < n_present * h_blocks; u += kWarps) {
    const int q = u / h_blocks, b = u % h_blocks;
    quantize_block(p.h_q8k, p.h + static_cast<int64_t>(st.list[q]) * p.n_ff, b, act + q * p.hq_stride, lane);
  }
  __pipeline_wait_prior(0);
  __syncthreads();

  const int units = n_present * rows_here;  // unit u: present slot u / rows_here, row u % rows_here
  auto unit_row = [&](int u) {
    const int q = u / rows_here, j = u % rows_here;
    const int d = slot_leader[st.list[q]];
    return reinterpret_cast<const uint8_t*>(stage + (d * R + j) * p.down_seg_words) +
           ((misalign[d] + static_cast<int64_t>(row_base + j) * p.down_row_bytes) & 15);
  };
  auto unit_act = [&](int u) { return act + (u / rows_here) * p.hq_stride; };
  auto store = [&](int u, float y) {
    const int q = u / rows_here, j = u % rows_here;
    ybuf[q * R + j] = y;
    if (p.slot_rows != nullptr) slot_output_row(p, st.list[q])[row_base + j] = y;
  };
  if (p.dots_by_rows) {
    const int lanes = lanes_per_row(p.n_ff / format_block_elems(p.down_type));
    const int per_call = 32 / lanes;
    for (int u0 = warp * per_call; u0 < units; u0 += kWarps * per_call) {
      const int nr = min(per_call, units - u0);
      const float y = dot_rows(p.down_type, [&](int c) { return unit_row(u0 + c); },
                               [&](int c) { return unit_act(u0 + c); }, nr, p.n_ff, lane, p.vec_loads);
      if (lane % lanes == 0 && lane / lanes < nr) store(u0 + lane / lanes, y);
    }
  } else {
    for (int u = warp; u < units; u += kWarps) {
      const float y = dot_staged(p.down_type, unit_row(u), p.n_ff, unit_act(u), lane, p.vec_loads);
      if (lane == 0) store(u, y);
    }
  }
  __syncthreads();
  if (p.sum == nullptr) return;
  for (int v = threadIdx.x; v < p.n_tokens * rows_here; v += kThreads) {
    const int t = v / rows_here, j = v % rows_here;
    float acc = 0.0f;  // reference::moe_combine's order: slots s = 0..k-1
    for (int s = 0; s < p.k; ++s) {
      const int q = present_pos[t * p.k + s];
      if (q >= 0) acc = __fadd_rn(acc, __fmul_rn(weight[t * p.k + s], ybuf[q * R + j]));
    }
    float* out = p.sum + static_cast<int64_t>(t) * p.n_embd + row_base + j;
    *out = p.sum_accumulate ? __fadd_rn(*out, acc) : acc;
  }
}

// Unit `it` of this warp in the warp-unit kernels: units are dealt round-robin over the CTAs
// first, so every CTA (and so every SM of a one-wave grid) gets the same number +-1 whatever the
// expert count; the tiled grid gave 60 of 132 SMs two 32-row tiles and the rest one (30B-A3B,
// one token: 8 experts x 24 tiles = 192 CTAs).
__device__ __forceinline__ int unit_of_warp(int warp, int it) {
  return static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) * (warp + kWarps * it);
}

// Kernel 1, warp-unit form (Tuning::gate_up_warp_units): unit = (leader d, rows_a gate/up row
// pairs); a warp stages its unit's rows with cp.async (stages_a units in flight), dots them
// against every token routed to the expert (the same dots and h expression as
// moe_gate_up_kernel), and, when kernel 1 quantizes h, counts the unit on the (expert, h block)
// counter: the warp that completes a block quantizes it. Only one CTA barrier (x published).
__global__ void __launch_bounds__(kThreads, 2) moe_gate_up_units_kernel(const MoeParams p) {
  extern __shared__ uint4 smem[];
  __shared__ SlotTables st;
  wait_for_previous_kernel();  // a no-op unless launched programmatically (Tuning::gate_up_programmatic_launch)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool same_x = p.x_gate_q8k == p.x_up_q8k;
  uint8_t* xg = reinterpret_cast<uint8_t*>(smem);
  uint8_t* xu = same_x ? xg : xg + p.n_tokens * p.xg_stride;
  const int pair_words = p.gate_seg_words + p.up_seg_words;
  const int unit_words = p.rows_a * pair_words;
  uint4* const ring = reinterpret_cast<uint4*>(xg + p.n_tokens * (p.xg_stride + (same_x ? 0 : p.xu_stride))) +
                      warp * p.stages_a * unit_words;
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
      uint4* stage = ring + (it % p.stages_a) * unit_words;
      for (int j = 0; j < p.rows_a; ++j) {
        const int64_t row = row0 + j;
        stage_row_async(g + row * p.gate_row_bytes, p.gate_row_bytes, stage + j * pair_words, lane);
        stage_row_async(up + row * p.up_row_bytes, p.up_row_bytes, stage + j * pair_words + p.gate_seg_words, lane);
      }
    }
    __pipeline_commit();
  };
  for (int s = 0; s < p.stages_a; ++s) issue(s);
  allow_next_kernel();
  quantize_x<kWarps>(p, xg, xu, same_x, warp, lane);
  __syncthreads();  // x published; from here on every warp runs on its own
  const int h_block_rows = p.h_q8k ? kQK_K : kQK;
  const int h_blocks = p.n_ff / h_block_rows;
  const int lanes = lanes_per_row(p.n_embd / format_block_elems(p.gate_type));
  const int pairs = 32 / lanes / 2;  // gate/up row pairs per dot_rows call
  const bool by_rows = p.dots_by_rows && p.gate_type == p.up_type && pairs >= 1;
  for (int it = 0; unit_of_warp(warp, it) < n_units; ++it) {
    if (p.stages_a > 1) {
      __pipeline_wait_prior(1);  // unit it's group; it + 1's may still fly
    } else {
      __pipeline_wait_prior(0);
    }
    __syncwarp();
    const int u = unit_of_warp(warp, it);
    const int leader = st.leader[u / units_per_expert];
    const int e = st.chosen[leader];
    const int row0 = (u % units_per_expert) * p.rows_a;
    const uint4* stage = ring + (it % p.stages_a) * unit_words;
    const uint8_t* g_base = expert_tensor(p, 0, e);
    const uint8_t* u_base = expert_tensor(p, 1, e);
    for_each_slot_of(p, st, e, lane, [&](int slot) {
      gate_up_unit_h(p, lanes, pairs, by_rows, stage, pair_words, g_base, u_base, row0, p.rows_a, slot, xg, xu,
                     lane);
    });
    __syncwarp();                  // every lane is done with the buffer
    issue(it + p.stages_a);        // this warp's next unit flies meanwhile
    if (!p.k1_quantizes_h) continue;
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
      quantize_block(p.h_q8k, p.h + static_cast<int64_t>(slot) * p.n_ff, h_block, p.hq + static_cast<int64_t>(slot) * p.hq_stride, lane);
    });
    if (lane == 0) *counter = 0;  // the workspace is left zeroed for the next call
  }
}

// A whole row of h (n_ff floats, global memory written by kernel 1) quantized by one warp into
// dst (padded Q8_K or Q8_0 blocks), as quantize_block does block by block, but with the loads of
// up to kBatch blocks issued before any is reduced: one L2 round trip per batch instead of per
// block (moe_down_units_kernel with Tuning::down_quantizes_h).
__device__ void quantize_h_row(const MoeParams& p, const float* src, uint8_t* dst, int lane) {
  constexpr int kBatch = 4;
  if (p.h_q8k) {
    const int blocks = p.n_ff / kQK_K;
    for (int b0 = 0; b0 < blocks; b0 += kBatch) {
      float v[kBatch][8];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        float4 lo = make_float4(0.0f, 0.0f, 0.0f, 0.0f), hi = lo;
        if (b0 + i < blocks) {
          const float4* s = reinterpret_cast<const float4*>(src + (b0 + i) * kQK_K + 8 * lane);
          lo = __ldcg(s);
          hi = __ldcg(s + 1);
        }
        v[i][0] = lo.x, v[i][1] = lo.y, v[i][2] = lo.z, v[i][3] = lo.w;
        v[i][4] = hi.x, v[i][5] = hi.y, v[i][6] = hi.z, v[i][7] = hi.w;
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i)
        if (b0 + i < blocks)
          quantize_detail::quantize_q8_k_warp(v[i], *reinterpret_cast<BlockQ8_K*>(dst + (b0 + i) * kQ8KStride + kQ8KOffset), lane);
    }
    return;
  }
  const int blocks = p.n_ff / kQK;
  for (int b0 = 0; b0 < blocks; b0 += 4 * kBatch) {
    float v[4 * kBatch];
#pragma unroll
    for (int i = 0; i < 4 * kBatch; ++i) v[i] = b0 + i < blocks ? __ldcg(src + (b0 + i) * kQK + lane) : 0.0f;
#pragma unroll
    for (int i = 0; i < 4 * kBatch; ++i)
      if (b0 + i < blocks)
        quantize_detail::quantize_q8_0_llama_warp(v[i], *reinterpret_cast<BlockQ8_0*>(dst + (b0 + i) * kQ80Stride + kQ80Offset), lane);
  }
}

// Kernel 2, warp-unit form (Tuning::down_warp_units): unit = (leader d, rows_b rows of n_embd);
// the warp stages the rows (stages_b units in flight; issued before waiting for kernel 1), then
// per token routed to the expert copies its quantized h into its own shared buffer (L2 reads
// with __ldcg, as moe_down_kernel), dots, writes the unweighted row; the unit completing a row
// chunk over all the experts (count_b) adds the weighted sums of those rows in top-k order.
__global__ void __launch_bounds__(kThreads, 2) moe_down_units_kernel(const MoeParams p) {
  extern __shared__ uint4 smem[];
  __shared__ SlotTables st;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int R = p.rows_b;
  const int unit_words = R * p.down_seg_words;
  const int act_words = p.hq_stride / 16;
  uint4* const act = smem + warp * (p.stages_b * unit_words + act_words);
  uint4* const ring = act + act_words;
  const int n_leaders = find_leaders<kWarps>(p, st);
  const int chunks = p.n_embd / R;  // R divides n_embd (host)
  const int n_units = n_leaders * chunks;
  auto issue = [&](int it) {
    const int u = unit_of_warp(warp, it);
    if (u < n_units) {
      const uint8_t* w = expert_tensor(p, 2, st.chosen[st.leader[u / chunks]]);
      const int64_t r0 = static_cast<int64_t>(u % chunks) * R;
      uint4* stage = ring + (it % p.stages_b) * unit_words;
      for (int j = 0; j < R; ++j)
        stage_row_async(w + (r0 + j) * p.down_row_bytes, p.down_row_bytes, stage + j * p.down_seg_words, lane);
    }
    __pipeline_commit();
  };
  for (int s = 0; s < p.stages_b; ++s) issue(s);  // the weights do not depend on kernel 1
  allow_next_kernel();  // the next kernel may launch now; it still waits for this grid's completion
  wait_for_previous_kernel();
  const int lanes = lanes_per_row(p.n_ff / format_block_elems(p.down_type));
  const int per_call = p.dots_by_rows ? 32 / lanes : 1;
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
    if (p.stages_b > 1) {
      __pipeline_wait_prior(1);
    } else {
      __pipeline_wait_prior(0);
    }
    __syncwarp();
    const int u = unit_of_warp(warp, it);
    const int e = st.chosen[st.leader[u / chunks]];
    const int chunk = u % chunks;
    const int r0 = chunk * R;
    const uint4* stage = ring + (it % p.stages_b) * unit_words;
    const uint8_t* d_base = expert_tensor(p, 2, e);
    for_each_slot_of(p, st, e, lane, [&](int slot) {
      if (p.k1_quantizes_h) {
        const uint4* src = reinterpret_cast<const uint4*>(p.hq + static_cast<int64_t>(slot) * p.hq_stride);
        for (int i = lane; i < act_words; i += 32) act[i] = __ldcg(src + i);
      } else {
        quantize_h_row(p, p.h + static_cast<int64_t>(slot) * p.n_ff, reinterpret_cast<uint8_t*>(act), lane);
      }
      __syncwarp();
      float* y_row = slot_output_row(p, slot) + r0;
      for (int j0 = 0; p.dots_by_rows && j0 < R; j0 += per_call) {
        const int nr = min(per_call, R - j0);
        auto row_of = [&](int r) {
          return staged(stage + (j0 + r) * p.down_seg_words, d_base + static_cast<int64_t>(r0 + j0 + r) * p.down_row_bytes);
        };
        const float y = dot_rows(p.down_type, row_of, [&](int) { return ht; }, nr, p.n_ff, lane, p.vec_loads);
        if (lane % lanes == 0 && lane / lanes < nr) y_row[j0 + lane / lanes] = y;
      }
      for (int j = 0; !p.dots_by_rows && j < R; ++j) {
        const uint8_t* row = staged(stage + j * p.down_seg_words, d_base + static_cast<int64_t>(r0 + j) * p.down_row_bytes);
        const float y = dot_staged(p.down_type, row, p.n_ff, ht, lane, p.vec_loads);
        if (lane == 0) y_row[j] = y;
      }
      __syncwarp();  // act is rewritten for the next slot
    });
    issue(it + p.stages_b);
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

// Words one staged row occupies: up to 15 bytes before it (rows start at any byte), the last
// word rounded up, and a spare word for load_16_unaligned's over-read (as matvec.cu).
int seg_words(int64_t row_bytes) { return static_cast<int>((row_bytes + 15 + 15) / 16 + 1); }

// Activation row bytes in shared memory / the workspace (moe_fused_workspace.h).
static_assert(kQ8KStride == kMoeActStrideQ8K && kQ80Stride == kMoeActStrideQ80,
              "moe_fused_workspace.h sizes activations with the padded strides of moe_fused_dots.cuh");
int act_stride(TensorType act, int64_t n) { return static_cast<int>(moe_fused_act_stride(act, n)); }

// The fields of MoeParams that follow from the weights and the call's shape (every form's
// launcher and moe_fused_staged_applies): the formats, sizes, weight addresses and layouts. The
// call's own pointers (routing, x, outputs, workspace) are the caller's to set.
void fill_moe_params(MoeParams& p, const MoeLayerWeights& w, int n_tokens, int k) {
  const TensorType xg_act = dot_activation_type(w.gate_type), xu_act = dot_activation_type(w.up_type);
  const TensorType h_act = dot_activation_type(w.down_type);
  p.gate_type = static_cast<int>(w.gate_type);
  p.up_type = static_cast<int>(w.up_type);
  p.down_type = static_cast<int>(w.down_type);
  p.x_gate_q8k = xg_act == TensorType::Q8_K;
  p.x_up_q8k = xu_act == TensorType::Q8_K;
  p.h_q8k = h_act == TensorType::Q8_K;
  p.vec_loads = w.tuning.vector_loads;
  p.n_embd = static_cast<int>(w.n_embd);
  p.n_ff = static_cast<int>(w.n_ff);
  p.n_expert = static_cast<int>(w.n_expert);
  p.n_tokens = n_tokens;
  p.k = k;
  p.n_slots = n_tokens * k;
  p.slots = w.slots;
  p.gate_base = static_cast<const uint8_t*>(w.gate);
  p.up_base = static_cast<const uint8_t*>(w.up);
  p.down_base = static_cast<const uint8_t*>(w.down);
  p.gate_row_bytes = static_cast<int64_t>(row_bytes(w.gate_type, w.n_embd));
  p.up_row_bytes = static_cast<int64_t>(row_bytes(w.up_type, w.n_embd));
  p.down_row_bytes = static_cast<int64_t>(row_bytes(w.down_type, w.n_ff));
  p.gate_expert_bytes = p.gate_row_bytes * w.n_ff;
  p.up_expert_bytes = p.up_row_bytes * w.n_ff;
  p.down_expert_bytes = p.down_row_bytes * w.n_embd;
  p.xg_stride = act_stride(xg_act, w.n_embd);
  p.xu_stride = act_stride(xu_act, w.n_embd);
  p.hq_stride = act_stride(h_act, w.n_ff);
  p.gate_seg_words = seg_words(p.gate_row_bytes);
  p.up_seg_words = seg_words(p.up_row_bytes);
  p.down_seg_words = seg_words(p.down_row_bytes);
}

// moe_fused_workspace.h's layout (the CUDA backend and the coordinator size it from there).
static_assert(kMaxSlots == kMoeMaxTokens * kMoeMaxTopK, "the counters cover every slot of a call");
MoeWorkspaceLayout workspace_layout(const MoeLayerWeights& w, int64_t slots) {
  return moe_fused_workspace_layout(w.down_type, w.n_embd, w.n_ff, slots);
}

std::string where(const MoeLayerWeights& w) {
  return " (gate " + std::string(type_name(w.gate_type)) + ", up " + std::string(type_name(w.up_type)) + ", down " +
         std::string(type_name(w.down_type)) + ", n_embd=" + std::to_string(w.n_embd) + ", n_ff=" +
         std::to_string(w.n_ff) + ", n_expert=" + std::to_string(w.n_expert) + ")";
}

// One kernel's launch: weight rows per warp (the CTA tile is kWarps times that), row tiles, CTAs
// per tile (groups: each serves experts g, g + groups, ...) and dynamic shared memory.
struct KernelPlan {
  int rows_per_warp = 0, tiles = 0, groups = 0;
  int64_t smem = 0;
};

// Decode is latency-bound: every CTA waits for the routing, then its weight rows, then computes,
// so the grid should be one wave (2 CTAs of 512 threads per SM, the register limit) with as many
// rows per warp in flight as that takes. Takes the smallest rows-per-warp whose tiles x experts fit
// one wave; failing that (many tokens, many experts) the largest that keeps 2 CTAs per SM, with
// each CTA serving several experts (the next expert's rows prefetched while it computes).
// fixed_smem: the activations; row_words: 16-byte words of one warp row; tile_divides: a number
// the tile must divide (0: none). rows_per_warp 0: nothing fits.
// min_rows_per_warp: the rows one dot_rows call fills its lanes with (fewer leave lanes idle);
// smaller counts are taken only when nothing from it up fits.
KernelPlan plan_kernel(int64_t rows, int64_t fixed_smem, int64_t row_words, int min_rows_per_warp, int max_rows_per_warp,
                       int tile_divides, int n_slots, int64_t n_expert, const MoeDeviceInfo& dev) {
  const int64_t static_smem = static_cast<int64_t>(sizeof(SlotTables)) + 1024;  // + the per-CTA reserve
  const int64_t experts = std::min<int64_t>(n_slots, n_expert);
  KernelPlan best;
  for (int r = 1; r <= max_rows_per_warp; r *= 2) {
    if (tile_divides != 0 && tile_divides % (kWarps * r) != 0) break;
    const int64_t smem = fixed_smem + int64_t{kWarps} * r * row_words * 16;
    if (smem + static_cast<int64_t>(sizeof(SlotTables)) > dev.smem_optin) break;
    if (r < min_rows_per_warp) continue;
    const int per_sm = static_cast<int>(std::min<int64_t>(2, dev.smem_per_sm / (smem + static_smem)));
    if (per_sm < 1) break;
    KernelPlan plan;
    plan.rows_per_warp = r;
    plan.tiles = static_cast<int>((rows + kWarps * r - 1) / (kWarps * r));
    const int64_t resident = int64_t{dev.sms} * per_sm;
    plan.groups = static_cast<int>(std::clamp<int64_t>(resident / plan.tiles, 1, n_slots));
    plan.smem = smem;
    if (best.rows_per_warp == 0 || per_sm == 2) best = plan;
    if (per_sm == 2 && plan.tiles * experts <= resident) return plan;
  }
  return best;
}

}  // namespace

void moe_fused_check(const MoeLayerWeights& w) {
  const TensorType types[3] = {w.gate_type, w.up_type, w.down_type};
  for (TensorType t : types)
    if (!matvec_supported(t))
      throw std::invalid_argument("moe_fused: no CUDA kernel for expert weight type " + std::string(type_name(t)) + where(w));
  if (w.n_embd <= 0 || w.n_ff <= 0 || w.n_expert <= 0 || w.n_expert > (int64_t{1} << 24) || w.n_embd > (1 << 20) ||
      w.n_ff > (1 << 20))
    throw std::invalid_argument("moe_fused: n_embd, n_ff and n_expert must be positive (and not huge)" + where(w));
  for (int i = 0; i < 2; ++i)
    if (w.n_embd % type_traits(types[i]).block_elems != 0)
      throw std::invalid_argument("moe_fused: n_embd must be a multiple of the gate/up block size " +
                                  std::to_string(type_traits(types[i]).block_elems) + where(w));
  // The h activation block (32 or 256) must hold whole row tiles of kernel 1: true whenever n_ff
  // is a multiple of down's block size, which down's rows need anyway.
  if (w.n_ff % type_traits(w.down_type).block_elems != 0 ||
      w.n_ff % type_traits(dot_activation_type(w.down_type)).block_elems != 0)
    throw std::invalid_argument("moe_fused: n_ff must be a multiple of the down block size " +
                                std::to_string(type_traits(w.down_type).block_elems) + where(w));
  if (w.slots == nullptr && (w.gate == nullptr || w.up == nullptr || w.down == nullptr))
    throw std::invalid_argument("moe_fused: give either a slot table or all three expert tensors" + where(w));
  const uintptr_t mis = reinterpret_cast<uintptr_t>(w.gate) | reinterpret_cast<uintptr_t>(w.up) |
                        reinterpret_cast<uintptr_t>(w.down) | reinterpret_cast<uintptr_t>(w.slots);
  if (mis % 16 != 0) throw std::invalid_argument("moe_fused: expert tensors must be 16-byte aligned" + where(w));
}

bool moe_fused_staged_applies(const MoeLayerWeights& w, int n_tokens, int k) {
  moe_fused_check(w);
  if (w.tuning.staged == MoeLayerWeights::Tuning::Staged::kOff || w.dots != MoeLayerWeights::Dots::kRows ||
      n_tokens < 1 || k < 1 || k > kMoeMaxTopK)
    return false;
  StagedParams sp{};
  fill_moe_params(sp, w, n_tokens, k);
  sp.only_where_faster = w.tuning.staged == MoeLayerWeights::Tuning::Staged::kWhereFaster;
  return moe_staged_plan(sp);
}

size_t moe_fused_workspace_bytes(const MoeLayerWeights& w, int max_tokens, int k) {
  moe_fused_check(w);
  if (max_tokens < 1 || max_tokens > kMoeMaxTokens || k < 1 || k > kMoeMaxTopK)
    throw std::invalid_argument("moe_fused_workspace_bytes: max_tokens " + std::to_string(max_tokens) + " not in 1.." +
                                std::to_string(kMoeMaxTokens) + " or k " + std::to_string(k) + " not in 1.." +
                                std::to_string(kMoeMaxTopK) + where(w));
  return workspace_layout(w, static_cast<int64_t>(max_tokens) * k).total;
}

void moe_fused_workspace_init(void* workspace, size_t bytes, cudaStream_t stream) {
  if (workspace == nullptr && bytes != 0) throw std::invalid_argument("moe_fused_workspace_init: null workspace");
  if (bytes != 0) CUDA_CHECK(cudaMemsetAsync(workspace, 0, bytes, stream));
}

void moe_fused(const MoeLayerWeights& w, const float* x, const MoeRouting& routing, const MoeOutputs& out,
               void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  moe_fused_check(w);
  const int n = routing.n_tokens, k = routing.k;
  if (n < 1 || n > kMoeMaxTokens || k < 1 || k > kMoeMaxTopK)
    throw std::invalid_argument("moe_fused: n_tokens " + std::to_string(n) + " not in 1.." + std::to_string(kMoeMaxTokens) +
                                " or k " + std::to_string(k) + " not in 1.." + std::to_string(kMoeMaxTopK) + where(w));
  if (routing.chosen == nullptr || routing.weight == nullptr || x == nullptr)
    throw std::invalid_argument("moe_fused: null routing or activations" + where(w));
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0)
    throw std::invalid_argument("moe_fused: x must be 16-byte aligned" + where(w));
  if (out.sum == nullptr && out.slot_rows == nullptr)
    throw std::invalid_argument("moe_fused: no output asked for (sum and slot_rows both null)" + where(w));
  const int n_slots = n * k;
  const MoeWorkspaceLayout l = workspace_layout(w, n_slots);
  if (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % 256 != 0 || workspace_bytes < l.total)
    throw std::invalid_argument("moe_fused: the workspace must be 256-byte aligned and hold " + std::to_string(l.total) +
                                " bytes for " + std::to_string(n) + " tokens of top-" + std::to_string(k) + ", got " +
                                std::to_string(workspace_bytes) + where(w));

  const TensorType xg_act = dot_activation_type(w.gate_type), xu_act = dot_activation_type(w.up_type);
  const TensorType h_act = dot_activation_type(w.down_type);
  MoeParams p{};
  fill_moe_params(p, w, n, k);
  // Tokens per pass: an expert serves at most n tokens when a token's ids are distinct (top-k);
  // repeated ids only add passes.
  p.pass_tokens = n;
  p.chosen = routing.chosen;
  p.weight = routing.weight;
  p.x = x;
  p.sum = out.sum;
  p.sum_accumulate = out.sum_accumulate;
  p.slot_rows = out.slot_rows;
  p.slot_row_of = out.slot_row_of;
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  p.count_a = reinterpret_cast<int*>(ws + l.count_a);
  p.count_b = reinterpret_cast<int*>(ws + l.count_b);
  p.h = reinterpret_cast<float*>(ws + l.h);
  p.hq = ws + l.hq;
  p.slot_out = reinterpret_cast<float*>(ws + l.slot_out);
  p.dots_by_rows = w.dots == MoeLayerWeights::Dots::kRows;
  p.stages_a = w.tuning.gate_up_stages == 2 ? 2 : 1;

  const MoeDeviceInfo dev = moe_device_info();
  const MoeLayerWeights::Tuning& tune = w.tuning;
  // The staged decode form (moe_staged.cu) where it is asked for and its planner takes the call;
  // otherwise the kernels below.
  if (tune.staged != MoeLayerWeights::Tuning::Staged::kOff && p.dots_by_rows) {
    StagedParams sp{};
    static_cast<MoeParams&>(sp) = p;
    sp.only_where_faster = tune.staged == MoeLayerWeights::Tuning::Staged::kWhereFaster;
    sp.k1_whole_sm = tune.staged_k1_whole_sm;
    sp.bulk = tune.staged_bulk_copies && dev.cc_major >= 9;
    const bool staged_pdl = dev.cc_major >= 9 && programmatic_launch_enabled();
    if (moe_staged_launch(sp, staged_pdl && tune.programmatic_launch, staged_pdl && tune.gate_up_programmatic_launch,
                          stream))
      return;
  }
  // The down kernel's form: per row tile (moe_down_tile_kernel) when every slot's rows of a tile
  // fit in shared memory (kPerRowTile), and under kAuto only when its grid is also one wave
  // (each CTA stages every chosen expert's rows, so a second wave would wait for a whole first
  // CTA's loads); else per expert.
  int tile_rows_d = 0;
  int64_t smem_d = 0;
  if (tune.down != MoeLayerWeights::Tuning::Down::kPerExpert && !tune.down_warp_units) {
    const int64_t leaders = std::min<int64_t>(n_slots, w.n_expert);
    const int64_t static_smem = static_cast<int64_t>(sizeof(SlotTables)) + int64_t{kMaxSlots} * 11;
    const int candidates[3] = {tune.down_tile_rows > 0 ? tune.down_tile_rows : 16, 8, 0};
    for (int r : candidates) {
      if (r <= 0 || r % 8 != 0) continue;
      const int64_t smem =
          int64_t{n_slots} * p.hq_stride + int64_t{n_slots} * r * 4 + leaders * r * p.down_seg_words * 16;
      if (smem + static_smem > dev.smem_optin) continue;
      const int64_t per_sm = std::min<int64_t>(2, dev.smem_per_sm / (smem + static_smem + 1024));
      const int64_t ctas = (w.n_embd + r - 1) / r;
      if (tune.down == MoeLayerWeights::Tuning::Down::kAuto && ctas > per_sm * dev.sms) continue;
      tile_rows_d = r;
      smem_d = smem;
      break;
    }
  }
  p.k1_quantizes_h = tile_rows_d == 0;
  p.tile_rows_d = tile_rows_d;
  // Kernel 1's tile must lie inside one activation block of h (32 or 256 rows) for its counter.
  // Rows per dot_rows call: 32 / lanes per row; kernel 1 pairs gate and up rows in one call.
  const int blocks_a = static_cast<int>(w.n_embd / type_traits(w.gate_type).block_elems);
  const int blocks_b = static_cast<int>(w.n_ff / type_traits(w.down_type).block_elems);
  const int rows_per_call_a = p.dots_by_rows ? 32 / lanes_per_row(blocks_a) : 1;
  const int rows_per_call_b = p.dots_by_rows ? 32 / lanes_per_row(blocks_b) : 1;
  auto plan_a_with = [&](int min_rows) {
    return plan_kernel(w.n_ff, int64_t{n} * (p.xg_stride + (xg_act == xu_act ? 0 : p.xu_stride)),
                       (p.gate_seg_words + p.up_seg_words) * p.stages_a, min_rows,
                       tune.gate_up_rows_per_warp > 0 && min_rows == tune.gate_up_rows_per_warp ? min_rows : 8,
                       static_cast<int>(type_traits(h_act).block_elems), n_slots, w.n_expert, dev);
  };
  auto plan_b_with = [&](int min_rows) {
    return plan_kernel(w.n_embd, int64_t{n} * p.hq_stride, p.down_seg_words, min_rows, 16, 0, n_slots, w.n_expert, dev);
  };
  KernelPlan plan_a;
  if (tune.gate_up_rows_per_warp > 0) plan_a = plan_a_with(tune.gate_up_rows_per_warp);
  if (plan_a.rows_per_warp == 0) plan_a = plan_a_with(std::max(1, rows_per_call_a / 2));
  if (plan_a.rows_per_warp == 0) plan_a = plan_a_with(1);
  KernelPlan plan_b = plan_b_with(std::min(16, rows_per_call_b));
  if (plan_b.rows_per_warp == 0) plan_b = plan_b_with(1);
  if (plan_a.rows_per_warp == 0 || plan_b.rows_per_warp == 0)
    throw std::invalid_argument("moe_fused: rows too long for the shared-memory staging (" + std::to_string(n) +
                                " tokens, device limit " + std::to_string(dev.smem_optin) + " bytes per CTA)" + where(w));
  // One expert per kernel-1 CTA (more CTAs than one wave holds) rather than some CTAs serving
  // two experts in turn while the rest of the grid idles.
  if (tune.gate_up_cta_per_expert) plan_a.groups = static_cast<int>(std::min<int64_t>(n_slots, w.n_expert));
  p.rows_a = plan_a.rows_per_warp;
  p.rows_b = plan_b.rows_per_warp;
  p.stages_b = 1;

  // Warp-unit forms: a grid of one wave (the CTAs per SM their shared memory allows, at most 2),
  // at most a CTA per unit; 0 where the buffers do not fit (the tiled kernel runs).
  const int64_t leaders_max = std::min<int64_t>(n_slots, w.n_expert);
  auto units_grid = [&](int64_t smem, int64_t max_units) -> int {
    const int64_t need = smem + static_cast<int64_t>(sizeof(SlotTables));
    if (need > dev.smem_optin) return 0;
    const int64_t per_sm = std::min<int64_t>(tune.units_ctas_per_sm == 1 ? 1 : 2, dev.smem_per_sm / (need + 1024));
    // Two CTAs (32 warps) per SM or the tiled kernel, unless one was asked for: every one-CTA
    // form measured slower than the tiled kernels (H200, 2026-11-30: 30B-A3B Q8_0's down units
    // at 128 KB per CTA 38.6 / 219 us at 1 / 8 tokens against 37.6 / 207 with the tiled down
    // kernel; two row buffers per warp, which halve the CTAs, 25.7 against 22.1 us at Q4_K).
    if (per_sm < (tune.units_ctas_per_sm == 1 ? 1 : 2)) return 0;
    // A whole wave even when fewer warps would hold the units: the units are dealt over the CTAs
    // first, so each SM gets its share (192 CTAs of 16 warps for 30B-A3B's 3072 gate/up units at
    // one token would again put two CTAs' work on 60 SMs and one on the rest).
    return static_cast<int>(std::clamp<int64_t>(max_units, 1, per_sm * dev.sms));
  };
  int grid_units_a = 0, grid_units_b = 0;
  int64_t smem_units_a = 0, smem_units_b = 0;
  if (tune.gate_up_warp_units) {
    // Pairs per unit: one dot_rows call's worth by default; they must divide the h block (the
    // unit's counter is per block).
    int pairs = tune.gate_up_rows_per_warp > 0 ? tune.gate_up_rows_per_warp : std::max(1, rows_per_call_a / 2);
    while (pairs > 1 && type_traits(h_act).block_elems % pairs != 0) pairs /= 2;
    for (int stages = p.stages_a; stages >= 1 && grid_units_a == 0; --stages) {
      const int64_t smem = int64_t{n} * (p.xg_stride + (xg_act == xu_act ? 0 : p.xu_stride)) +
                           int64_t{kWarps} * stages * pairs * (p.gate_seg_words + p.up_seg_words) * 16;
      grid_units_a = units_grid(smem, leaders_max * (w.n_ff / pairs));
      if (grid_units_a > 0) {
        smem_units_a = smem;
        p.rows_a = pairs;
        p.stages_a = stages;
      }
    }
  }
  if (tune.down_warp_units) {
    // Rows per unit: a dot_rows call's worth, at least 8 (the counters' granularity) and at most 32.
    const int first = static_cast<int>(std::clamp(p.dots_by_rows ? rows_per_call_b : 1, 8, 32));
    for (int r : {first, 8}) {
      for (int stages = std::clamp(tune.down_stages, 1, 2); stages >= 1 && grid_units_b == 0; --stages) {
        if (w.n_embd % r != 0) break;
        const int64_t smem = int64_t{kWarps} * (int64_t{stages} * r * p.down_seg_words * 16 + p.hq_stride);
        grid_units_b = units_grid(smem, leaders_max * (w.n_embd / r));
        if (grid_units_b > 0) {
          smem_units_b = smem;
          p.rows_b = r;
          p.stages_b = stages;
        }
      }
    }
  }
  // The warp-unit down kernel reads kernel 1's quantized h, or quantizes h itself per unit.
  if (grid_units_b > 0) p.k1_quantizes_h = !tune.down_quantizes_h;

  // Programmatic launches where the device has them (sm_90+) and launch.h's switch is on.
  const bool pdl = dev.cc_major >= 9 && programmatic_launch_enabled();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg_a{};
  cfg_a.blockDim = dim3(kThreads);
  cfg_a.stream = stream;
  cfg_a.attrs = attr;
  cfg_a.numAttrs = pdl && tune.gate_up_programmatic_launch ? 1 : 0;
  if (grid_units_a > 0) {
    ensure_dynamic_smem(reinterpret_cast<const void*>(moe_gate_up_units_kernel), dev.device, smem_units_a);
    cfg_a.gridDim = dim3(static_cast<unsigned>(grid_units_a));
    cfg_a.dynamicSmemBytes = static_cast<size_t>(smem_units_a);
    CUDA_CHECK(cudaLaunchKernelEx(&cfg_a, moe_gate_up_units_kernel, p));
  } else {
    ensure_dynamic_smem(reinterpret_cast<const void*>(moe_gate_up_kernel), dev.device, plan_a.smem);
    cfg_a.gridDim = dim3(static_cast<unsigned>(plan_a.tiles), static_cast<unsigned>(plan_a.groups));
    cfg_a.dynamicSmemBytes = static_cast<size_t>(plan_a.smem);
    CUDA_CHECK(cudaLaunchKernelEx(&cfg_a, moe_gate_up_kernel, p));
  }
  ensure_dynamic_smem(reinterpret_cast<const void*>(moe_down_kernel), dev.device, plan_b.smem);
  if (tile_rows_d > 0) ensure_dynamic_smem(reinterpret_cast<const void*>(moe_down_tile_kernel), dev.device, smem_d);
  // Kernel 2 as a programmatic dependent launch where the device has it (sm_90+): its CTAs start
  // as kernel 1's leave room, fetch their down rows, and wait for kernel 1 inside.
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(plan_b.tiles), static_cast<unsigned>(plan_b.groups));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(plan_b.smem);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl && tune.programmatic_launch ? 1 : 0;
  if (grid_units_b > 0) {
    ensure_dynamic_smem(reinterpret_cast<const void*>(moe_down_units_kernel), dev.device, smem_units_b);
    cfg.gridDim = dim3(static_cast<unsigned>(grid_units_b));
    cfg.dynamicSmemBytes = static_cast<size_t>(smem_units_b);
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, moe_down_units_kernel, p));
    return;
  }
  if (tile_rows_d > 0) {
    cfg.gridDim = dim3(static_cast<unsigned>((w.n_embd + tile_rows_d - 1) / tile_rows_d));
    cfg.dynamicSmemBytes = static_cast<size_t>(smem_d);
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, moe_down_tile_kernel, p));
    return;
  }
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, moe_down_kernel, p));
}

}  // namespace moraine::cuda
