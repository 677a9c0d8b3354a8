// Staged decode form of the fused MoE (MoeLayerWeights::Tuning::staged; contract in moe_fused.h,
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
//     shared memory (the same warp quantizer as the default path: the same bytes), and one warp
//     per output row dots every slot's row and adds the weighted sums in top-k order.
// Why: the default path's time is per-warp dependent chains (cumoe3, moe_fused.h Tuning: halving
// the warps per SM costs ~3.5 us whatever else changes): rows, dot, h store, fence, atomic,
// quantize; then h copy, dot, y store, fence, atomic, sums. Here a warp's only chain is its
// rows' arrival, and the down rows arrive while kernel 1 runs.
// Bits: the same dot functions (moe_fused_dots.cuh) with the same row lengths, the same h
// expression, the same quantizer and the same sum order (acc = 0, then acc + w_s * y_s for
// s = 0..k-1 over present slots) as the default kernels, so the output is bit-identical
// (tests/cuda/moe_fused_test.cpp checks it).
#include <cuda_pipeline.h>

#include <algorithm>
#include <cstdint>

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

// Bulk copies (cp.async.bulk, the Tensor Memory Accelerator's plain form, sm_90+) completing on
// shared-memory mbarriers (StagedParams::bulk): one instruction per row instead of one 16-byte
// copy per lane and word. Below sm_90 these compile to nothing (the host never asks for them there).
__device__ __forceinline__ unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// The barrier's current phase completes once `bytes` more have landed (and its one arrival).
__device__ __forceinline__ void mbar_expect(uint64_t* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_addr(bar)) : "memory");
#endif
}

// Waits until the phase with this parity (0, 1, 0, ... per reuse) has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned done = 0;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(smem_addr(bar)), "r"(parity)
                 : "memory");
  } while (!done);
#endif
}

// The words stage_row_async would copy (the row's enclosing aligned 16-byte words), as one bulk
// copy counted on bar: the same shared-memory contents, so staged() finds the row as before.
__device__ __forceinline__ void bulk_stage_row(const uint8_t* row, int64_t row_bytes, uint4* dst, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uintptr_t start = reinterpret_cast<uintptr_t>(row);
  const uintptr_t first = start & ~uintptr_t{15};
  const unsigned bytes = static_cast<unsigned>((start + row_bytes - first + 15) / 16 * 16);
  mbar_expect(bar, bytes);
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_addr(dst)), "l"(first), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
#endif
}

// Orders this thread's earlier generic-proxy accesses of shared memory before later bulk copies
// into it (a ring buffer being refilled).
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

__global__ void __launch_bounds__(kSThreads, 2) moe_staged_gate_up_kernel(const StagedParams p) {
  extern __shared__ uint4 smem[];
  __shared__ StagedRouting rt;
  __shared__ uint64_t bars[kSWarps][kStagedMaxDepth];  // bulk copies: one per warp and ring slot
  wait_for_prior_grids();  // launch.h's contract (a no-op unless launched programmatically)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool same_x = p.x_gate_q8k == p.x_up_q8k;
  uint8_t* xg = reinterpret_cast<uint8_t*>(smem);
  uint8_t* xu = same_x ? xg : xg + p.n_tokens * p.xg_stride;
  const int pair_words = p.gate_seg_words + p.up_seg_words;
  const int unit_words = p.unit_pairs * pair_words;
  uint4* const ring = reinterpret_cast<uint4*>(xg + p.n_tokens * (p.xg_stride + (same_x ? 0 : p.xu_stride))) +
                      warp * p.warp_slots * unit_words;

  const int n_leaders = find_leaders<kSWarps>(p, rt);
  const int units_per_expert = p.n_ff / p.unit_pairs;
  const int64_t n_units = int64_t{n_leaders} * units_per_expert;
  const int64_t first = n_units * blockIdx.x / gridDim.x;
  const int64_t here = n_units * (blockIdx.x + 1) / gridDim.x - first;
  const int mine = here > warp ? static_cast<int>((here - warp + kSWarps - 1) / kSWarps) : 0;
  const int depth = p.warp_slots;  // groups in flight per warp (empty ones past `mine`)
  auto unit_at = [&](int m, int& e, int& row0) {
    const int64_t u = first + warp + int64_t{kSWarps} * m;
    e = rt.chosen[rt.leader[u / units_per_expert]];
    row0 = static_cast<int>(u % units_per_expert) * p.unit_pairs;
  };
  auto issue = [&](int m) {  // unit m's rows in flight as one commit group (empty past the last)
    if (m < mine) {
      int e, row0;
      unit_at(m, e, row0);
      const uint8_t* g = expert_tensor(p, 0, e);
      const uint8_t* u = expert_tensor(p, 1, e);
      uint4* stage = ring + (m % depth) * unit_words;
      if (p.bulk) {  // lane c copies row c: gate j = c / 2 (c even) or up j (c odd)
        uint64_t* bar = &bars[warp][m % depth];
        if (lane < 2 * p.unit_pairs) {
          fence_proxy_async();  // this warp's reads of a refilled slot came before (__syncwarp)
          const int j = lane / 2;
          const int64_t row = row0 + j;
          if (lane % 2 == 0) {
            bulk_stage_row(g + row * p.gate_row_bytes, p.gate_row_bytes, stage + j * pair_words, bar);
          } else {
            bulk_stage_row(u + row * p.up_row_bytes, p.up_row_bytes, stage + j * pair_words + p.gate_seg_words, bar);
          }
        }
        __syncwarp();  // every expect_tx before the phase's one arrival
        if (lane == 0) mbar_arrive(bar);
        return;
      }
      for (int j = 0; j < p.unit_pairs; ++j) {
        const int64_t row = row0 + j;
        stage_row_async(g + row * p.gate_row_bytes, p.gate_row_bytes, stage + j * pair_words, lane);
        stage_row_async(u + row * p.up_row_bytes, p.up_row_bytes, stage + j * pair_words + p.gate_seg_words, lane);
      }
    }
    if (!p.bulk) __pipeline_commit();
  };
  if (p.bulk) {
    if (lane < depth) mbar_init(&bars[warp][lane]);
    __syncwarp();
  }
  for (int m = 0; m < depth; ++m) issue(m);
  allow_dependent_grids();  // the down kernel's CTAs may start fetching their rows now
  quantize_x<kSWarps>(p, xg, xu, same_x, warp, lane);
  __syncthreads();  // x published; from here on every warp runs on its own
  // The default kernels' choice of dot (gate_up_unit_h).
  const int lanes = lanes_per_row(p.n_embd / format_block_elems(p.gate_type));
  const int pairs = 32 / lanes / 2;
  const bool by_rows = p.gate_type == p.up_type && pairs >= 1;
  for (int m = 0; m < mine; ++m) {
    if (p.bulk) {
      mbar_wait(&bars[warp][m % depth], static_cast<unsigned>(m / depth) & 1u);
    } else {
      wait_groups_pending(depth - 1);  // unit m's group (groups committed so far: depth + m)
    }
    __syncwarp();
    int e, row0;
    unit_at(m, e, row0);
    const uint4* stage = ring + (m % depth) * unit_words;
    const uint8_t* g_base = expert_tensor(p, 0, e);
    const uint8_t* u_base = expert_tensor(p, 1, e);
    for_each_slot_of(p, rt, e, lane, [&](int slot) {
      gate_up_unit_h(p, lanes, pairs, by_rows, stage, pair_words, g_base, u_base, row0, p.unit_pairs, slot, xg, xu,
                     lane);
    });
    __syncwarp();        // every lane is done with the buffer
    issue(m + depth);    // the unit that reuses it (if any)
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
      if (u < total)
        quantize_detail::quantize_q8_0_llama_warp(
            v[i], *reinterpret_cast<BlockQ8_0*>(act + (u / hb) * p.hq_stride + (u % hb) * kQ80Stride + kQ80Offset), lane);
    }
  }
}

__global__ void __launch_bounds__(kSThreads, 2) moe_staged_down_kernel(const StagedParams p) {
  extern __shared__ uint4 smem[];
  __shared__ StagedRouting rt;
  __shared__ int16_t leader_index[kStagedMaxSlots];  // by leader slot: its index in rt.leader
  __shared__ int16_t present_list[kStagedMaxSlots];  // present slots, ascending
  __shared__ int16_t slot_leader[kStagedMaxSlots];   // by present index: its expert's leader index
  __shared__ int16_t present_pos[kStagedMaxSlots];   // by slot: its present index, -1 when absent
  __shared__ uint8_t misalign[kStagedMaxSlots];      // by leader index: down tensor address mod 16
  __shared__ float weight[kStagedMaxSlots];
  __shared__ uint64_t rows_bar;  // bulk copies: every staged row
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (p.bulk && threadIdx.x == 0) mbar_init(&rows_bar);  // published by find_leaders' barriers
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
  if (p.bulk) {  // one thread per row
    for (int u = threadIdx.x; u < n_leaders * rows_here; u += kSThreads) {
      const int d = u / rows_here, j = u % rows_here;
      const uint8_t* w = expert_tensor(p, 2, rt.chosen[rt.leader[d]]);
      bulk_stage_row(w + static_cast<int64_t>(row_base + j) * p.down_row_bytes, p.down_row_bytes,
                     stage + (d * R + j) * p.down_seg_words, &rows_bar);
    }
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

  // (cta_compact's barriers: every row's expect_tx is in before the one arrival.)
  if (p.bulk && threadIdx.x == 0) mbar_arrive(&rows_bar);

  wait_for_prior_grids();  // kernel 1's h (and everything before it) complete and visible
  if (i < p.n_slots) weight[i] = p.weight[i];
  staged_quantize_h(p, present_list, n_present, act, warp, lane);
  if (p.bulk) {
    mbar_wait(&rows_bar, 0);
  } else {
    __pipeline_wait_prior(0);
  }
  __syncthreads();

  // One warp per output row: every present slot's dot (the default's dot_rows with the same row
  // length, rows of several experts in one call), then the weighted sum in top-k order.
  const int lanes = lanes_per_row(p.n_ff / format_block_elems(p.down_type));
  const int per_call = 32 / lanes;
  float* y = ybuf + warp * y_stride;
  for (int j = warp; j < rows_here; j += kSWarps) {
    const int64_t row = row_base + j;
    for (int q0 = 0; q0 < n_present; q0 += per_call) {
      const int nr = min(per_call, n_present - q0);
      auto row_of = [&](int c) {
        const int d = slot_leader[q0 + c];
        return reinterpret_cast<const uint8_t*>(stage + (d * R + j) * p.down_seg_words) +
               ((misalign[d] + row * p.down_row_bytes) & 15);
      };
      auto act_of = [&](int c) { return act + (q0 + c) * p.hq_stride; };
      const float v = dot_rows(p.down_type, row_of, act_of, nr, p.n_ff, lane, p.vec_loads);
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

struct StagedDevice : MoeDeviceInfo {
  int static_a = 0, static_b = 0;  // the kernels' static shared memory
};

StagedDevice staged_device() {
  thread_local StagedDevice info{{-1, 0, 0, 0, 0}};
  const MoeDeviceInfo dev = moe_device_info();
  if (dev.device != info.device) {
    static_cast<MoeDeviceInfo&>(info) = dev;
    cudaFuncAttributes a{}, b{};
    CUDA_CHECK(cudaFuncGetAttributes(&a, moe_staged_gate_up_kernel));
    CUDA_CHECK(cudaFuncGetAttributes(&b, moe_staged_down_kernel));
    info.static_a = static_cast<int>(a.sharedSizeBytes);
    info.static_b = static_cast<int>(b.sharedSizeBytes);
    // Both kernels' CTAs share an SM (kernel 2's fetch its rows beside kernel 1's): the SM must
    // run with its largest shared-memory carveout whichever kernel it starts with.
    for (const void* k : {reinterpret_cast<const void*>(moe_staged_gate_up_kernel),
                          reinterpret_cast<const void*>(moe_staged_down_kernel)})
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
  const bool same_x = p.x_gate_q8k == p.x_up_q8k;
  const int64_t x_bytes = int64_t{p.n_tokens} * (p.xg_stride + (same_x ? 0 : p.xu_stride));
  const int64_t unit_bytes = int64_t{p.unit_pairs} * (p.gate_seg_words + p.up_seg_words) * 16;
  return {x_bytes + int64_t{kSWarps} * p.warp_slots * unit_bytes,
          int64_t{p.n_slots} * p.hq_stride + int64_t{kSWarps} * y_stride * 4 +
              int64_t{p.max_leaders} * p.rows_per_cta * p.down_seg_words * 16};
}

}  // namespace

bool moe_staged_plan(StagedParams& p) {
  if (p.n_tokens < 1 || p.n_tokens > kStagedMaxTokens || p.n_slots > kStagedMaxSlots) return false;
  // Where this form is slower than the default kernels: Q8_0 experts. H200,
  // moraine-kernel-bench cuda --moe-only, graph, us per layer, default -> staged (2026-11-30 run
  // B, per-lane cp.async): Q8_0 at 1 token 38.1 -> 39.8 (Qwen3-30B-A3B) and 34.6 -> 34.7
  // (Qwen3-Next), against Q4_K 23.4 -> 20.8 / 38.4 -> 35.0 at 1 / 2 tokens (30B-A3B) and
  // 24.7 -> 20.3 / 35.3 -> 32.2 (Next). Decided by the gate format, as gpu_worker's cuda_backend
  // did before.
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
  const int64_t beside_b = p.k1_whole_sm ? dev.smem_per_sm : dev.smem_per_sm - kReserve - dev.static_b - smem_b;
  const int64_t room = std::min<int64_t>(beside_b - kReserve - dev.static_a, dev.smem_optin - dev.static_a) - x_bytes;
  const int64_t slots = std::min<int64_t>({per_warp, room / (int64_t{kSWarps} * unit_bytes), kStagedMaxDepth});
  if (slots < 1) return false;
  p.warp_slots = static_cast<int>(slots);
  return true;
}

bool moe_staged_launch(StagedParams p, bool pdl_down, bool pdl_gate_up, cudaStream_t stream) {
  if (!moe_staged_plan(p)) return false;
  const StagedDevice dev = staged_device();
  const StagedSmem smem = staged_smem(p);
  const int64_t smem_a = smem.a, smem_b = smem.b;
  ensure_dynamic_smem(reinterpret_cast<const void*>(moe_staged_gate_up_kernel), dev.device, smem_a);
  ensure_dynamic_smem(reinterpret_cast<const void*>(moe_staged_down_kernel), dev.device, smem_b);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.blockDim = dim3(kSThreads);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.gridDim = dim3(static_cast<unsigned>(dev.sms));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem_a);
  cfg.numAttrs = pdl_gate_up ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, moe_staged_gate_up_kernel, p));
  cfg.gridDim = dim3(static_cast<unsigned>((p.n_embd + p.rows_per_cta - 1) / p.rows_per_cta));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem_b);
  cfg.numAttrs = pdl_down ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, moe_staged_down_kernel, p));
  return true;
}

}  // namespace moraine::cuda::moe_detail
