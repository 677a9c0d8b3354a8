// Fused routed-expert FFN (design and contract in moe_fused.h): the tiled kernels, the call's
// checks and the choice of form. Both tiled kernels share the slot bookkeeping: every CTA loads
// the step's routing into shared memory, lists the "leader" slots (first slot naming each present
// expert, ascending) and serves leaders g, g + G, ... where g is its blockIdx.y and G =
// gridDim.y, so each expert's rows are read once per step by one CTA per row tile, with no host
// round trip to learn which experts were chosen.
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
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/moe_fused_dots.cuh"
#include "kernels/cuda/moe_fused_internal.cuh"
#include "kernels/cuda/moe_staged.cuh"
#include "kernels/cuda/swiglu_clamped.cuh"

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

namespace {

using namespace matvec_detail;

// The slots naming expert e, ascending, into st.list.
__device__ int list_slots(const MoeParams& p, SlotTables& st, int e) {
  const int i = threadIdx.x;
  return cta_compact<kWarps>(i < p.n_slots && st.chosen[i] == e, st.list, st.warp_count);
}

// gpt-oss's h of one row (index r = e * n_ff + row into the biases): reference::biased_expert's
// g + bg, u + bu (one rounded add each), then the clamped SwiGLU or plain silu(g) * u.
__device__ __forceinline__ float oss_h(const MoeParams& p, float g, float u, int64_t r) {
  if (p.gate_bias != nullptr) g = __fadd_rn(g, p.gate_bias[r]);
  if (p.up_bias != nullptr) u = __fadd_rn(u, p.up_bias[r]);
  if (p.clamped) return swiglu_clamped(g, u, p.alpha, p.limit);
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

// Kernel 1: h[slot][r] = silu(gate_e[r] . x_t) * (up_e[r] . x_t) for the rows r of this CTA's
// tile, for every slot (t, s) of each expert e this CTA serves; then the last CTA to finish a
// whole activation block of h (of one expert) quantizes it for down.
// kOss (gpt-oss): gate and up get expert e's biases, h is the clamped SwiGLU (swiglu_clamped.cuh).
template <int kExtra, bool kOss = false>  // dot_rows' extra case sets (moe_fused_dots.cuh)
__global__ void __launch_bounds__(kThreads, 2) moe_gate_up_kernel(const MoeParams p) {
  extern __shared__ uint4 smem[];
  __shared__ SlotTables st;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tile_rows = kWarps * p.rows_a;
  const int row0 = blockIdx.x * tile_rows + warp * p.rows_a;  // this warp's rows: row0 .. row0 + rows_a - 1
  const int h_block_rows = p.h_q8k ? kQK_K : kQK;
  const int h_block = blockIdx.x * tile_rows / h_block_rows;  // a tile lies in one block (host check)
  const int tiles_per_h_block = h_block_rows / tile_rows;
  const int h_blocks = p.n_ff / h_block_rows;
  const GateUpSmem sm = gate_up_smem(p, smem, warp);
  const bool same_x = sm.same_x;
  uint8_t* const xg = sm.xg;
  uint8_t* const xu = sm.xu;
  const int pair_words = sm.pair_words;
  uint4* const stage = sm.stage;
  auto issue_rows = [&](int d) {  // this warp's rows of leader d's expert, in flight
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
  if (blockIdx.y < n_leaders) issue_rows(blockIdx.y);
  allow_next_kernel();
  quantize_x<kWarps>(p, xg, xu, same_x, warp, lane);  // while the first rows are in flight
  for (int d = blockIdx.y; d < n_leaders; d += gridDim.y) {
    const int leader = st.leader[d];
    const int e = st.chosen[leader];
    const int count = list_slots(p, st, e);  // CTA barrier: also publishes x the first time
    __pipeline_wait_prior(0);
    __syncwarp();
    const uint8_t* g_base = expert_tensor(p, 0, e);
    const uint8_t* u_base = expert_tensor(p, 1, e);
    const int valid_rows = min(p.rows_a, p.n_ff - row0);
    // Gate and up of one format: row pairs (gate j, up j) in adjacent lane groups of one
    // dot_rows call, so u reaches g's lanes with one shuffle (dot_rows' header says why); else
    // dot_staged per row (formats that differ, rows of more than 16 blocks).
    const int lanes = lanes_per_row(p.n_embd / format_block_elems(p.gate_type));
    const int pairs = 32 / lanes / 2;
    const bool by_rows = p.gate_type == p.up_type && pairs >= 1;
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
        const float v = dot_rows<kExtra>(p.gate_type, row_of, [&](int) { return xt; }, 2 * np, p.n_embd, lane);
        const float u = __shfl_down_sync(0xffffffffu, v, lanes);  // up j, from the next group
        const int c = lane / lanes;
        if (lane % lanes == 0 && c % 2 == 0 && c / 2 < np) {
          if constexpr (kOss) {
            const int64_t r = static_cast<int64_t>(e) * p.n_ff + row0 + j0 + c / 2;
            p.h[static_cast<int64_t>(slot) * p.n_ff + row0 + j0 + c / 2] = oss_h(p, v, u, r);
          } else {
            // reference::silu(g) * u, with the reference's operations and rounding (expf aside).
            const float h = __fmul_rn(__fdiv_rn(v, __fadd_rn(1.0f, expf(-v))), u);
            p.h[static_cast<int64_t>(slot) * p.n_ff + row0 + j0 + c / 2] = h;
          }
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
        const float g = dot_staged<kExtra != 0>(p.gate_type, gate_row, p.n_embd, xg + t * p.xg_stride, lane);
        const float u = dot_staged<kExtra != 0>(p.up_type, up_row, p.n_embd, xu + t * p.xu_stride, lane);
        if constexpr (kOss) {
          const float h = oss_h(p, g, u, static_cast<int64_t>(e) * p.n_ff + row);
          if (lane == 0) p.h[static_cast<int64_t>(slot) * p.n_ff + row] = h;
        } else {
          // reference::silu(g) * u, with the reference's operations and rounding (expf aside).
          const float h = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
          if (lane == 0) p.h[static_cast<int64_t>(slot) * p.n_ff + row] = h;
        }
      }
    }
    __syncwarp();
    const int next = d + static_cast<int>(gridDim.y);
    if (next < n_leaders) issue_rows(next);  // the next expert's rows fly meanwhile
    // (The next list_slots' first barrier keeps st.list until every warp is done with it.)
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
        quantize_block(p.h_q8k, p.q81 & kQ81H, p.h + static_cast<int64_t>(slot) * p.n_ff, h_block,
                       p.hq + static_cast<int64_t>(slot) * p.hq_stride, lane);
      }
      if (threadIdx.x == 0) *counter = 0;  // the workspace is left zeroed for the next call
    }
    __syncthreads();  // st.list and st.flag are rewritten for the next expert
  }
}


// Kernel 2: y(slot)[r] = down_e[r] . hq(slot) for the rows r of this CTA's tile; then the last CTA
// of the tile adds sum[t][r] over the token's present slots in top-k order. kOss: y gets expert e's
// down bias (one rounded add) before it is written, as reference::biased_expert adds it.
template <bool kOss = false>
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
      const int per_call = 32 / lanes;
      for (int t = 0; t < nt; ++t) {
        for (int j0 = 0; j0 < valid_rows; j0 += per_call) {
          const int nr = min(per_call, valid_rows - j0);
          auto row_of = [&](int r) {
            return staged(stage + (j0 + r) * p.down_seg_words, d_base + (row0 + j0 + r) * p.down_row_bytes);
          };
          const uint8_t* ht = act + t * p.hq_stride;
          float y = dot_rows(p.down_type, row_of, [&](int) { return ht; }, nr, p.n_ff, lane);
          if constexpr (kOss) {
            if (p.down_bias != nullptr && lane % lanes == 0 && lane / lanes < nr)
              y = __fadd_rn(y, p.down_bias[static_cast<int64_t>(e) * p.n_embd + row0 + j0 + lane / lanes]);
          }
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

// Words one staged row occupies: up to 15 bytes before it (rows start at any byte), the last
// word rounded up, and a spare word for load_16_unaligned's over-read (as matvec.cu).
int seg_words(int64_t row_bytes) { return static_cast<int>((row_bytes + 15 + 15) / 16 + 1); }

// Activation row bytes in shared memory / the workspace (moe_fused_workspace.h).
static_assert(kQ8KStride == kMoeActStrideQ8K && kQ80Stride == kMoeActStrideQ80,
              "moe_fused_workspace.h sizes activations with the padded strides of moe_fused_dots.cuh");
int act_stride(TensorType act, int64_t n) { return static_cast<int>(moe_fused_act_stride(act, n)); }

// moe_fused_workspace.h's layout (the CUDA backend and the coordinator size it from there).
static_assert(kMaxSlots == kMoeMaxTokens * kMoeMaxTopK, "the counters cover every slot of a call");
MoeWorkspaceLayout workspace_layout(const MoeLayerWeights& w, int64_t slots) {
  return moe_fused_workspace_layout(w.down_type, w.n_embd, w.n_ff, slots);
}

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

std::string where(const MoeLayerWeights& w) {
  return " (gate " + std::string(type_name(w.gate_type)) + ", up " + std::string(type_name(w.up_type)) + ", down " +
         std::string(type_name(w.down_type)) + ", n_embd=" + std::to_string(w.n_embd) + ", n_ff=" +
         std::to_string(w.n_ff) + ", n_expert=" + std::to_string(w.n_expert) + ")";
}

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
  p.q81 = static_cast<uint8_t>((xg_act == TensorType::Q8_1 ? kQ81GateX : 0) | (xu_act == TensorType::Q8_1 ? kQ81UpX : 0) |
                               (h_act == TensorType::Q8_1 ? kQ81H : 0));
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
  p.gate_bias = w.gate_bias;
  p.up_bias = w.up_bias;
  p.down_bias = w.down_bias;
  p.clamped = w.swiglu_clamped;
  p.alpha = w.swiglu_alpha;
  p.limit = w.swiglu_limit;
}

// moe_fused's checks and the call's parameters but the launch shape.
MoeParams moe_call_params(const MoeLayerWeights& w, const float* x, const MoeRouting& routing, const MoeOutputs& out,
                          void* workspace, size_t workspace_bytes) {
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
  const MoeWorkspaceLayout l = workspace_layout(w, n * k);
  if (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % 256 != 0 || workspace_bytes < l.total)
    throw std::invalid_argument("moe_fused: the workspace must be 256-byte aligned and hold " + std::to_string(l.total) +
                                " bytes for " + std::to_string(n) + " tokens of top-" + std::to_string(k) + ", got " +
                                std::to_string(workspace_bytes) + where(w));
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
  return p;
}

TiledPlan plan_tiled(const MoeParams& p, const MoeLayerWeights& w, const MoeDeviceInfo& dev) {
  // Kernel 1's tile must lie inside one activation block of h (32 or 256 rows) for its counter.
  // Rows per dot_rows call: 32 / lanes per row; kernel 1 pairs gate and up rows in one call.
  const int n = p.n_tokens, n_slots = p.n_slots;
  const bool same_x = same_x_format(p);
  const int h_block = p.h_q8k ? kQK_K : kQK;
  const int rows_per_call_a = 32 / lanes_per_row(static_cast<int>(w.n_embd / type_traits(w.gate_type).block_elems));
  const int rows_per_call_b = 32 / lanes_per_row(static_cast<int>(w.n_ff / type_traits(w.down_type).block_elems));
  auto plan_a_with = [&](int min_rows) {
    return plan_kernel(w.n_ff, int64_t{n} * (p.xg_stride + (same_x ? 0 : p.xu_stride)), p.gate_seg_words + p.up_seg_words,
                       min_rows, 8, h_block, n_slots, w.n_expert, dev);
  };
  auto plan_b_with = [&](int min_rows) {
    return plan_kernel(w.n_embd, int64_t{n} * p.hq_stride, p.down_seg_words, min_rows, 16, 0, n_slots, w.n_expert, dev);
  };
  TiledPlan t;
  t.gate_up = plan_a_with(std::max(1, rows_per_call_a / 2));
  if (t.gate_up.rows_per_warp == 0) t.gate_up = plan_a_with(1);
  t.down = plan_b_with(std::min(16, rows_per_call_b));
  if (t.down.rows_per_warp == 0) t.down = plan_b_with(1);
  if (t.gate_up.rows_per_warp == 0 || t.down.rows_per_warp == 0)
    throw std::invalid_argument("moe_fused: rows too long for the shared-memory staging (" + std::to_string(n) +
                                " tokens, device limit " + std::to_string(dev.smem_optin) + " bytes per CTA)" + where(w));
  return t;
}

void launch_tiled_gate_up(const MoeParams& p, const KernelPlan& plan, const MoeDeviceInfo& dev, cudaStream_t stream) {
  // Gate/up rows of issue 26's and the IQ grid formats take the kernel built with their dot_rows
  // cases; those copies also have dot_staged's IQ cases, which an IQ up type needs (gate of
  // another format: dot_staged per row).
  const bool iq = is_iq_grid_format(p.gate_type) || is_iq_grid_format(p.up_type);
  const bool oss = p.gate_bias != nullptr || p.up_bias != nullptr || p.down_bias != nullptr || p.clamped;
  const auto kernel = oss                            ? moe_gate_up_kernel<0, true>   // moe_fused_check: no issue 26 / IQ
                      : is_issue26_format(p.gate_type) ? moe_gate_up_kernel<kRowsIssue26>
                      : iq                           ? moe_gate_up_kernel<kRowsIq>
                                                     : moe_gate_up_kernel<0>;
  ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), dev.device, plan.smem);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(plan.tiles), static_cast<unsigned>(plan.groups));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(plan.smem);
  cfg.stream = stream;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

void launch_tiled_down(const MoeParams& p, const KernelPlan& plan, const MoeDeviceInfo& dev, bool pdl,
                       cudaStream_t stream) {
  const bool oss = p.gate_bias != nullptr || p.up_bias != nullptr || p.down_bias != nullptr || p.clamped;
  const auto kernel = oss ? moe_down_kernel<true> : moe_down_kernel<false>;
  ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), dev.device, plan.smem);
  // A programmatic dependent launch where asked: its CTAs start as kernel 1's leave room, fetch
  // their down rows, and wait for kernel 1 inside.
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(plan.tiles), static_cast<unsigned>(plan.groups));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(plan.smem);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

}  // namespace moe_detail

using namespace moe_detail;

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
  if (w.oss() && (is_issue26_format(static_cast<int>(w.gate_type)) || is_iq_grid_format(static_cast<int>(w.gate_type)) ||
                  is_issue26_format(static_cast<int>(w.up_type)) || is_iq_grid_format(static_cast<int>(w.up_type))))
    throw std::invalid_argument("moe_fused: expert biases / clamped SwiGLU with issue 26's or IQ gate/up formats" + where(w));
  if (w.slots == nullptr && (w.gate == nullptr || w.up == nullptr || w.down == nullptr))
    throw std::invalid_argument("moe_fused: give either a slot table or all three expert tensors" + where(w));
  const uintptr_t mis = reinterpret_cast<uintptr_t>(w.gate) | reinterpret_cast<uintptr_t>(w.up) |
                        reinterpret_cast<uintptr_t>(w.down) | reinterpret_cast<uintptr_t>(w.slots);
  if (mis % 16 != 0) throw std::invalid_argument("moe_fused: expert tensors must be 16-byte aligned" + where(w));
}

bool moe_fused_staged_applies(const MoeLayerWeights& w, int n_tokens, int k) {
  moe_fused_check(w);
  // gpt-oss's biases and activation: the tiled kernels only (the staged form has no kOss build).
  if (w.form == MoeLayerWeights::Form::kTiled || w.oss() || n_tokens < 1 || k < 1 || k > kMoeMaxTopK) return false;
  StagedParams sp{};
  fill_moe_params(sp, w, n_tokens, k);
  sp.only_where_faster = w.form == MoeLayerWeights::Form::kBest;
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
  MoeParams p = moe_call_params(w, x, routing, out, workspace, workspace_bytes);
  const MoeDeviceInfo dev = moe_device_info();
  const bool pdl = w.programmatic_launch && dev.cc_major >= 9;
  // The staged form (moe_staged.cu) where the form asks for it and its planner takes the call;
  // otherwise the tiled kernels.
  if (w.form != MoeLayerWeights::Form::kTiled && !w.oss()) {
    StagedParams sp{};
    static_cast<MoeParams&>(sp) = p;
    sp.only_where_faster = w.form == MoeLayerWeights::Form::kBest;
    if (moe_staged_launch(sp, pdl, stream)) return;
  }
  const TiledPlan t = plan_tiled(p, w, dev);
  p.rows_a = t.gate_up.rows_per_warp;
  p.rows_b = t.down.rows_per_warp;
  launch_tiled_gate_up(p, t.gate_up, dev, stream);
  launch_tiled_down(p, t.down, dev, pdl, stream);
}

}  // namespace moraine::cuda
