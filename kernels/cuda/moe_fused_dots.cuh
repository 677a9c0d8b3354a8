// Device code of the fused MoE kernels shared by moe_fused.cu (the tiled kernels), moe_staged.cu
// (the staged form, MoeLayerWeights::Form) and the kernel bench's warp-unit form
// (tools/kernel_bench/moe_fused_units.cu): the call's parameters, the routing scans, the padded
// activation layout, the cp.async row staging, the per-row and several-rows dots, the warp
// quantizer of h and kernel 1's per-unit h rows. One copy, so every form adds the same per-block
// float terms in the same order for a given row length (the forms' outputs are bit-identical
// because they call exactly these).
#pragma once
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/formats/quant.h"
#include "kernels/cuda/matvec_formats.cuh"
#include "kernels/cuda/matvec_formats_iq.cuh"
#include "kernels/cuda/moe_fused.h"
#include "kernels/cuda/quantize_block.cuh"

namespace moraine::cuda::moe_detail {

using namespace matvec_detail;

// Everything the fused MoE kernels need of one call, by value (kernel parameter space): the tiled
// kernels (moe_fused.cu) read all of it; the staged kernels (moe_staged.cuh's StagedParams adds
// their own fields after these) the formats, sizes, weights, routing, x, outputs, h and layouts.
// moe_fused.cu's fill_moe_params sets what follows from the weights. Keep the field order: the
// parameter layout alone changes how ptxas schedules a kernel (0.2-0.35 us per layer when the
// staged form first shared the struct; docs/perf-log.md).
struct MoeParams {
  int gate_type, up_type, down_type;  // TensorType values
  bool x_gate_q8k, x_up_q8k, h_q8k;   // activation formats: Q8_K (true) or Q8_0
  uint8_t q81;  // kQ81GateX | kQ81UpX | kQ81H: that one is Q8_1 (Q4_1 / Q5_1), not Q8_0 (padding byte)
  int n_embd, n_ff, n_expert;
  int n_tokens, k, n_slots, pass_tokens;
  int rows_a, rows_b;  // weight rows per warp in kernel 1 / kernel 2 (the CTA tile is 16 times that)
  const MoeExpertSlot* slots;
  const uint8_t *gate_base, *up_base, *down_base;
  int64_t gate_expert_bytes, up_expert_bytes, down_expert_bytes;
  int64_t gate_row_bytes, up_row_bytes, down_row_bytes;
  const int32_t* chosen;
  const float* weight;
  const float* x;
  float* sum;
  bool sum_accumulate;  // MoeOutputs::sum_accumulate
  float* slot_rows;
  const int32_t* slot_row_of;
  // workspace
  float* h;  // F32 h [slot][n_ff]
  uint8_t* hq;
  int hq_stride;  // bytes per slot, a multiple of 16 with a spare word
  float* slot_out;
  int* count_a;  // [slots][n_ff / h block]
  int* count_b;  // [row tiles of n_embd] (sized for the smallest tile)
  // shared-memory layout (padded bytes per token of x for gate / up, 16-byte words per staged row:
  // moe_fused.cu's act_stride, seg_words)
  int xg_stride, xu_stride, gate_seg_words, up_seg_words, down_seg_words;
  // gpt-oss (MoeLayerWeights' biases and clamped SwiGLU; read only by the kernels built with kOss)
  const float* gate_bias;
  const float* up_bias;
  const float* down_bias;
  bool clamped;
  float alpha, limit;
};

// MoeParams::q81's bits.
constexpr uint8_t kQ81GateX = 1, kQ81UpX = 2, kQ81H = 4;

// Whether gate and up take the same activation format (then kernel 1 quantizes x once).
__host__ __device__ __forceinline__ bool same_x_format(const MoeParams& p) {
  return p.x_gate_q8k == p.x_up_q8k && ((p.q81 & kQ81GateX) != 0) == ((p.q81 & kQ81UpX) != 0);
}

// Whether expert e is on this GPU (ids outside 0..n_expert-1 count as absent).
__device__ __forceinline__ bool expert_present(const MoeParams& p, int e) {
  if (e < 0 || e >= p.n_expert) return false;
  return p.slots == nullptr || p.slots[e].gate != nullptr;
}

// kind: 0 gate, 1 up, 2 down.
__device__ __forceinline__ const uint8_t* expert_tensor(const MoeParams& p, int kind, int e) {
  if (p.slots != nullptr) {
    const MoeExpertSlot& s = p.slots[e];
    return static_cast<const uint8_t*>(kind == 0 ? s.gate : kind == 1 ? s.up : s.down);
  }
  const uint8_t* base = kind == 0 ? p.gate_base : kind == 1 ? p.up_base : p.down_base;
  const int64_t bytes = kind == 0 ? p.gate_expert_bytes : kind == 1 ? p.up_expert_bytes : p.down_expert_bytes;
  return base + static_cast<int64_t>(e) * bytes;
}

// Stable compaction over a CTA of kWarps warps: the thread ids with pred set, ascending, into
// out; returns how many. Every thread of the CTA must call it.
template <int kWarps>
__device__ int cta_compact(bool pred, int16_t* out, int* warp_count) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned ballot = __ballot_sync(0xffffffffu, pred);
  if (lane == 0) warp_count[warp] = __popc(ballot);
  __syncthreads();
  int before = 0, total = 0;
  for (int w = 0; w < kWarps; ++w) {
    const int c = warp_count[w];
    if (w < warp) before += c;
    total += c;
  }
  if (pred) out[before + __popc(ballot & ((1u << lane) - 1u))] = static_cast<int16_t>(threadIdx.x);
  __syncthreads();  // out is complete and warp_count free again
  return total;
}

// The routing into st.chosen (shared memory) and the leader slots (first slot naming each present
// expert, ascending: every form serves the experts in this order) into st.leader; returns how
// many. Tables: chosen[>= n_slots], leader[>= n_slots], warp_count[kWarps].
template <int kWarps, class Tables>
__device__ int find_leaders(const MoeParams& p, Tables& st) {
  const int i = threadIdx.x;
  if (i < p.n_slots) st.chosen[i] = p.chosen[i];
  __syncthreads();
  bool lead = false;
  if (i < p.n_slots) {
    const int e = st.chosen[i];
    lead = expert_present(p, e);
    for (int j = 0; j < i && lead; ++j) lead = st.chosen[j] != e;
  }
  return cta_compact<kWarps>(lead, st.leader, st.warp_count);
}

// The slots naming expert e, ascending, 32 at a time: fn(slot) in every lane of the warp (a
// warp's own scan of st.chosen, so the warp-unit and staged kernels need no CTA barrier per
// expert).
template <class Tables, class Fn>
__device__ __forceinline__ void for_each_slot_of(const MoeParams& p, const Tables& st, int e, int lane, Fn fn) {
  for (int c0 = 0; c0 < p.n_slots; c0 += 32) {
    unsigned m = __ballot_sync(0xffffffffu, c0 + lane < p.n_slots && st.chosen[c0 + lane] == e);
    while (m != 0) {
      const int slot = c0 + __ffs(m) - 1;
      m &= m - 1;
      fn(slot);
    }
  }
}

// sum[t][r] = acc, or sum[t][r] + acc as one rounded addition (MoeOutputs::sum_accumulate).
__device__ __forceinline__ void store_sum(const MoeParams& p, int t, int64_t r, float acc) {
  float* out = p.sum + static_cast<int64_t>(t) * p.n_embd + r;
  *out = p.sum_accumulate ? __fadd_rn(*out, acc) : acc;
}

// Activations (x for gate/up, h for down) in shared memory and the workspace are padded: Q8_K
// block b at b * kQ8KStride + kQ8KOffset, Q8_0 block b at b * kQ80Stride + kQ80Offset, so the
// quants (and Q8_K's sums) start on 16-byte boundaries (packed 292- and 34-byte blocks leave them
// 4- or 2-byte aligned) and the Q4_K and Q8_0 dots read them as 16-byte words; lanes on
// consecutive blocks then hit distinct banks (strides of 76 and 12 words).
constexpr int kQ8KStride = 304, kQ8KOffset = 12;
constexpr int kQ80Stride = 48, kQ80Offset = 14;
constexpr int kQ81Offset = 12;  // Q8_1 blocks (36 bytes) in Q8_0's 48-byte slots: quants at 16
static_assert(sizeof(BlockQ8_K) + kQ8KOffset <= kQ8KStride && (kQ8KOffset + 4) % 16 == 0 &&
                  (kQ8KOffset + 4 + kQK_K) % 16 == 0,
              "padded Q8_K layout: quants and sums 16-byte aligned");
static_assert(sizeof(BlockQ8_0) + kQ80Offset <= kQ80Stride && (kQ80Offset + 2) % 16 == 0,
              "padded Q8_0 layout: quants 16-byte aligned");
static_assert(sizeof(BlockQ8_1) + kQ81Offset <= kQ80Stride && (kQ81Offset + 4) % 16 == 0,
              "padded Q8_1 layout: quants 16-byte aligned");
template <class Act>
__device__ __forceinline__ const Act& act_block(const uint8_t* act, int b) {
  static_assert(sizeof(Act) == sizeof(BlockQ8_K) || sizeof(Act) == sizeof(BlockQ8_0) || sizeof(Act) == sizeof(BlockQ8_1),
                "Q8_K, Q8_0 or Q8_1 activations");
  if constexpr (sizeof(Act) == sizeof(BlockQ8_K)) {
    return *reinterpret_cast<const Act*>(act + b * kQ8KStride + kQ8KOffset);
  } else if constexpr (sizeof(Act) == sizeof(BlockQ8_1)) {
    return *reinterpret_cast<const Act*>(act + b * kQ80Stride + kQ81Offset);
  } else {
    return *reinterpret_cast<const Act*>(act + b * kQ80Stride + kQ80Offset);
  }
}

// Starts copying one row of row_bytes bytes from global into shared memory as aligned 16-byte
// words with cp.async (warp-cooperative; nothing passes through registers, so every row a warp
// needs is in flight at once); the row will start at staged(dst, row). The caller commits the
// group and waits (__pipeline_wait_prior), then __syncwarp()s before reading.
inline __device__ void stage_row_async(const uint8_t* row, int64_t row_bytes, uint4* dst, int lane) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(row);
  const uintptr_t first = start & ~uintptr_t{15};
  const int nwords = static_cast<int>((start + row_bytes - first + 15) / 16);
  const uint4* src = reinterpret_cast<const uint4*>(first);
  for (int i = lane; i < nwords; i += 32) __pipeline_memcpy_async(dst + i, src + i, 16);
}

// Where stage_row_async put the row that starts at global address `row`.
__device__ __forceinline__ const uint8_t* staged(const uint4* dst, const uint8_t* row) {
  return reinterpret_cast<const uint8_t*>(dst) + (reinterpret_cast<uintptr_t>(row) & 15);
}

// One Q8_0 block's integer dot against a padded Q8_0 activation block: FormatQ8_0::part's sum,
// with the activation quants as two 16-byte loads instead of two unaligned 16-byte reads (ten
// 4-byte loads and eight funnel shifts).
__device__ __forceinline__ int q8_0_block_isum_vec(const uint8_t* wb, const BlockQ8_0& a) {
  const uint4* aq = reinterpret_cast<const uint4*>(a.qs);
  int dot = 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int wq[4];
    load_16_unaligned(wb + 2 + 16 * h, wq);
    const uint4 av = aq[h];
    dot = __dp4a(wq[0], static_cast<int>(av.x), dot);
    dot = __dp4a(wq[1], static_cast<int>(av.y), dot);
    dot = __dp4a(wq[2], static_cast<int>(av.z), dot);
    dot = __dp4a(wq[3], static_cast<int>(av.w), dot);
  }
  return dot;
}

// dot(row, act) over nblocks blocks, both in shared memory: lanes take block parts round-robin
// (the matvec's per-block terms), the warp's result in every lane.
template <class F>
__device__ float dot_staged_format(const uint8_t* row, int nblocks, const uint8_t* act, int lane) {
  if constexpr (std::is_same_v<F, FormatQ8_0>) {  // one part per block: one block per lane
    float acc = 0.0f;
    for (int b = lane; b < nblocks; b += 32) {
      const uint8_t* wb = row + b * F::kBlockBytes;
      acc += F::term(wb, act_block<BlockQ8_0>(act, b), q8_0_block_isum_vec(wb, act_block<BlockQ8_0>(act, b)), 0);
    }
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    return acc;
  } else {
    const int units = nblocks * F::kParts;
    float acc = 0.0f;
    for (int u0 = 0; u0 < units; u0 += 32) {
      const int u = u0 + lane;
      const bool valid = u < units;
      const int b = u / F::kParts, part = u % F::kParts;
      if constexpr (term_per_part<F>()) {  // IQ4_XS: matvec.cu's per-part terms, in part order
        const float tp = valid ? F::part_term(row + b * F::kBlockBytes, act_block<typename F::Act>(act, b), part) : 0.0f;
#pragma unroll
        for (int j = 0; j < F::kParts; ++j) {
          const float tj = __shfl_sync(0xffffffffu, tp, lane - part + j);
          if (valid && part == 0) acc += tj;
        }
      } else {
        int isum = 0, msum = 0;
        if (valid) F::part(row + b * F::kBlockBytes, act_block<typename F::Act>(act, b), part, isum, msum);
#pragma unroll
        for (int off = 1; off < F::kParts; off *= 2) {
          isum += __shfl_xor_sync(0xffffffffu, isum, off);
          msum += __shfl_xor_sync(0xffffffffu, msum, off);
        }
        if (valid && part == 0) acc += F::term(row + b * F::kBlockBytes, act_block<typename F::Act>(act, b), isum, msum);
      }
    }
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    return acc;
  }
}

// Runtime format switch (warp-uniform): one kernel serves every format and mix of formats. The
// fallback of gate_up_unit_h (and of the tiled kernel 1) where a gate/up pair does not fit one
// dot_rows call: gate and up of different formats, or rows of more than 16 blocks. The IQ grid
// formats are a second switch (kIq): the tiled kernel 1's copy for the formats before them leaves
// it out, as for dot_rows' extra sets below (else their spills rise: 40 -> 48 bytes of stack).
__device__ __forceinline__ float dot_staged_iq(int type, const uint8_t* row, int n, const uint8_t* act, int lane) {
  switch (static_cast<TensorType>(type)) {
    case TensorType::IQ2_XXS:
      return dot_staged_format<FormatIQ2_XXS>(row, n / kQK_K, act, lane);
    case TensorType::IQ2_XS:
      return dot_staged_format<FormatIQ2_XS>(row, n / kQK_K, act, lane);
    case TensorType::IQ2_S:
      return dot_staged_format<FormatIQ2_S>(row, n / kQK_K, act, lane);
    case TensorType::IQ3_XXS:
      return dot_staged_format<FormatIQ3_XXS>(row, n / kQK_K, act, lane);
    case TensorType::IQ3_S:
      return dot_staged_format<FormatIQ3_S>(row, n / kQK_K, act, lane);
    case TensorType::IQ1_S:
      return dot_staged_format<FormatIQ1_S>(row, n / kQK_K, act, lane);
    case TensorType::IQ1_M:
      return dot_staged_format<FormatIQ1_M>(row, n / kQK_K, act, lane);
    default:
      return __int_as_float(0x7fc00000);  // unreachable: moe_fused_check refuses the type
  }
}

template <bool kIq = true>
inline __device__ float dot_staged(int type, const uint8_t* row, int n, const uint8_t* act, int lane) {
  switch (static_cast<TensorType>(type)) {
    case TensorType::Q8_0:
      return dot_staged_format<FormatQ8_0>(row, n / kQK, act, lane);
    case TensorType::MXFP4:
      return dot_staged_format<FormatMXFP4>(row, n / kQK, act, lane);
    case TensorType::Q2_K:
      return dot_staged_format<FormatQ2_K>(row, n / kQK_K, act, lane);
    case TensorType::Q3_K:
      return dot_staged_format<FormatQ3_K>(row, n / kQK_K, act, lane);
    case TensorType::Q4_K:
      return dot_staged_format<FormatQ45_K<false>>(row, n / kQK_K, act, lane);
    case TensorType::Q5_K:
      return dot_staged_format<FormatQ45_K<true>>(row, n / kQK_K, act, lane);
    case TensorType::Q6_K:
      return dot_staged_format<FormatQ6_K>(row, n / kQK_K, act, lane);
    // Issue 26 (matvec_formats_legacy.cuh)
    case TensorType::Q4_0:
      return dot_staged_format<FormatQ4_0>(row, n / kQK, act, lane);
    case TensorType::Q4_1:
      return dot_staged_format<FormatQ4_1>(row, n / kQK, act, lane);
    case TensorType::Q5_0:
      return dot_staged_format<FormatQ5_0>(row, n / kQK, act, lane);
    case TensorType::Q5_1:
      return dot_staged_format<FormatQ5_1>(row, n / kQK, act, lane);
    case TensorType::IQ4_NL:
      return dot_staged_format<FormatIQ4_NL>(row, n / kQK, act, lane);
    case TensorType::IQ4_XS:
      return dot_staged_format<FormatIQ4_XS>(row, n / kQK_K, act, lane);
    case TensorType::TQ1_0:
      return dot_staged_format<FormatTQ1_0>(row, n / kQK_K, act, lane);
    case TensorType::TQ2_0:
      return dot_staged_format<FormatTQ2_0>(row, n / kQK_K, act, lane);
    default:
      if constexpr (kIq) {
        return dot_staged_iq(type, row, n, act, lane);
      } else {
        return __int_as_float(0x7fc00000);  // unreachable: the kernel's launcher picks by format
      }
  }
}

// Several rows against one activation row, one weight block per lane at a time: the warp splits
// into groups of L lanes (L = nblocks rounded up to a power of two, at most 32), group r takes
// row r (r < nrows <= 32 / L) and lane b of a group takes blocks b, b + L, ... of it, adding all
// kParts parts of a block itself. Each block's integer sums and float term are the ones
// dot_staged_format forms (integer sums in another order, the same term expression), so only
// the order of the float additions differs. Why not dot_staged per row: it spends three shuffle
// levels per block and unit and reads each activation word once per row; here lanes of one
// block index share the activation word (a broadcast) across rows, the parts of a block unpack
// shared weight words once, and there are no per-block shuffles. row_of(r): row r in shared
// memory, act_of(r): its activation row (the down kernel's per-row-tile form dots each group
// against another slot's h). Returns, in every lane of group r, row r's dot (other lanes: 0).
__host__ __device__ constexpr int lanes_per_row(int nblocks) {
  int lanes = 1;
  while (lanes < nblocks && lanes < 32) lanes *= 2;
  return lanes;
}

// One Q4_K block against a padded Q8_K block (kQ8KStride) with 16-byte shared-memory loads: the
// integer sums FormatQ45_K<false>::part gives over the block's 8 parts (sub-block j: low nibbles
// of quant words 8*(j/2).. for even j, high nibbles for odd j; 6-bit scale and min as
// scale_min_k4), so term() sees the same isum and msum. Why: the generic part reads every weight
// and activation word with its own 4-byte load (~130 shared loads per block and lane); this takes
// 8 + 16 + 2 sixteen-byte loads and 3 four-byte ones. wb must be 16-byte aligned.
__device__ __forceinline__ void q4k_block_sums_vec(const uint8_t* wb, const BlockQ8_K& a, int& isum, int& msum) {
  const uint32_t* packed = reinterpret_cast<const uint32_t*>(wb + 4);
  const uint32_t s[3] = {packed[0], packed[1], packed[2]};
  auto byte = [&](int k) { return static_cast<int>((s[k / 4] >> (8 * (k % 4))) & 0xffu); };
  const uint4* qs = reinterpret_cast<const uint4*>(wb + 16);
  const uint4* aq = reinterpret_cast<const uint4*>(a.qs);
  const uint4* bs = reinterpret_cast<const uint4*>(a.bsums);
  const uint4 b0 = bs[0], b1 = bs[1];
  const uint32_t bw[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
  int is = 0, ms = 0;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const uint4 q0 = qs[2 * p], q1 = qs[2 * p + 1];
    const uint32_t qw[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int j = 2 * p + t;
      const uint4 a0 = aq[2 * j], a1 = aq[2 * j + 1];
      const uint32_t aw[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      int dot = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        dot = __dp4a(static_cast<int>((qw[i] >> (4 * t)) & 0x0f0f0f0fu), static_cast<int>(aw[i]), dot);
      int sc, m;
      if (j < 4) {
        sc = byte(j) & 63;
        m = byte(j + 4) & 63;
      } else {
        sc = (byte(j + 4) & 0x0f) | ((byte(j - 4) >> 6) << 4);
        m = (byte(j + 4) >> 4) | ((byte(j) >> 6) << 4);
      }
      is += sc * dot;
      ms += m * (static_cast<int>(static_cast<int16_t>(bw[j] & 0xffffu)) + (static_cast<int>(bw[j]) >> 16));
    }
  }
  isum = is;
  msum = ms;
}

// kBlocks > 0: nblocks is that constant (the per-shape kernels: the lane split and its divisions
// then fold away at compile time). kAligned: every row starts 16-byte aligned (FixedRows'
// kRowsAligned), so Q4_K takes its 16-byte form without a run-time check (which cost the
// per-shape staged down kernel a register spill).
template <class F, int kBlocks = 0, bool kAligned = false, class RowOf, class ActOf>
__device__ float dot_rows_format(RowOf row_of, ActOf act_of, int nrows, int nblocks, int lane) {
  if constexpr (kBlocks > 0) nblocks = kBlocks;
  const int lanes = lanes_per_row(nblocks);
  const int r = lane / lanes;
  float acc = 0.0f;
  if (r < nrows) {
    const uint8_t* row = row_of(r);
    const uint8_t* act = act_of(r);
    // The 16-byte forms: Q8_0 always (its weight reads are unaligned anyway), Q4_K where the rows
    // are whole 16-byte words (the contract aligns them).
    const bool aligned = (reinterpret_cast<uintptr_t>(row) & 15) == 0;
    for (int b = lane % lanes; b < nblocks; b += lanes) {
      const uint8_t* wb = row + b * F::kBlockBytes;
      if constexpr (std::is_same_v<F, FormatQ8_0>) {
        acc += F::term(wb, act_block<BlockQ8_0>(act, b), q8_0_block_isum_vec(wb, act_block<BlockQ8_0>(act, b)), 0);
      } else if constexpr (std::is_same_v<F, FormatQ45_K<false>> && kAligned) {
        int isum = 0, msum = 0;
        q4k_block_sums_vec(wb, act_block<BlockQ8_K>(act, b), isum, msum);
        acc += F::term(wb, act_block<typename F::Act>(act, b), isum, msum);
      } else {
        int isum = 0, msum = 0;
        if constexpr (std::is_same_v<F, FormatQ45_K<false>>) {
          if (aligned) {
            q4k_block_sums_vec(wb, act_block<BlockQ8_K>(act, b), isum, msum);
            acc += F::term(wb, act_block<typename F::Act>(act, b), isum, msum);
            continue;
          }
        }
        if constexpr (term_per_part<F>()) {  // IQ4_XS: the block's part terms in part order
#pragma unroll
          for (int part = 0; part < F::kParts; ++part) acc += F::part_term(wb, act_block<typename F::Act>(act, b), part);
        } else {
#pragma unroll
          for (int part = 0; part < F::kParts; ++part) {
            int is = 0, ms = 0;
            F::part(wb, act_block<typename F::Act>(act, b), part, is, ms);
            isum += is;
            msum += ms;
          }
          acc += F::term(wb, act_block<typename F::Act>(act, b), isum, msum);
        }
      }
    }
  }
  for (int off = lanes / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  return acc;
}

// dot_rows' extra case sets (its kExtra bits). Why: as more cases of dot_rows' first switch,
// issue 26's formats raised the tiled kernel 1's spills for every format (ptxas, sm_90: 40 -> 88
// bytes of stack), and the IQ grid formats did too; each set is a further switch compiled only
// where kExtra asks, and moe_fused.cu builds kernel 1 once per set, each format's gate/up rows
// taking the copy with its cases.
inline constexpr int kRowsIssue26 = 1, kRowsIq = 2, kRowsAllExtra = kRowsIssue26 | kRowsIq;

// The importance-matrix grid formats (matvec_formats_iq.cuh): dot_rows' kRowsIq set.
template <class RowOf, class ActOf>
__device__ __forceinline__ float dot_rows_iq(int type, RowOf row_of, ActOf act_of, int nrows, int n, int lane) {
  switch (static_cast<TensorType>(type)) {
    case TensorType::IQ2_XXS:
      return dot_rows_format<FormatIQ2_XXS>(row_of, act_of, nrows, n / kQK_K, lane);
    case TensorType::IQ2_XS:
      return dot_rows_format<FormatIQ2_XS>(row_of, act_of, nrows, n / kQK_K, lane);
    case TensorType::IQ2_S:
      return dot_rows_format<FormatIQ2_S>(row_of, act_of, nrows, n / kQK_K, lane);
    case TensorType::IQ3_XXS:
      return dot_rows_format<FormatIQ3_XXS>(row_of, act_of, nrows, n / kQK_K, lane);
    case TensorType::IQ3_S:
      return dot_rows_format<FormatIQ3_S>(row_of, act_of, nrows, n / kQK_K, lane);
    case TensorType::IQ1_S:
      return dot_rows_format<FormatIQ1_S>(row_of, act_of, nrows, n / kQK_K, lane);
    case TensorType::IQ1_M:
      return dot_rows_format<FormatIQ1_M>(row_of, act_of, nrows, n / kQK_K, lane);
    default:
      return __int_as_float(0x7fc00000);  // unreachable: moe_fused_check refuses the type
  }
}

// Issue 26's formats (matvec_formats_legacy.cuh): dot_rows' kRowsIssue26 set; with kThenIq its
// default goes on to the IQ set (dot_rows with every set, the down kernel's).
template <bool kThenIq, class RowOf, class ActOf>
__device__ __forceinline__ float dot_rows_issue26(int type, RowOf row_of, ActOf act_of, int nrows, int n, int lane) {
  switch (static_cast<TensorType>(type)) {
    case TensorType::Q4_0:
      return dot_rows_format<FormatQ4_0>(row_of, act_of, nrows, n / kQK, lane);
    case TensorType::Q4_1:
      return dot_rows_format<FormatQ4_1>(row_of, act_of, nrows, n / kQK, lane);
    case TensorType::Q5_0:
      return dot_rows_format<FormatQ5_0>(row_of, act_of, nrows, n / kQK, lane);
    case TensorType::Q5_1:
      return dot_rows_format<FormatQ5_1>(row_of, act_of, nrows, n / kQK, lane);
    case TensorType::IQ4_NL:
      return dot_rows_format<FormatIQ4_NL>(row_of, act_of, nrows, n / kQK, lane);
    case TensorType::IQ4_XS:
      return dot_rows_format<FormatIQ4_XS>(row_of, act_of, nrows, n / kQK_K, lane);
    case TensorType::TQ1_0:
      return dot_rows_format<FormatTQ1_0>(row_of, act_of, nrows, n / kQK_K, lane);
    case TensorType::TQ2_0:
      return dot_rows_format<FormatTQ2_0>(row_of, act_of, nrows, n / kQK_K, lane);
    default:
      if constexpr (kThenIq) {
        return dot_rows_iq(type, row_of, act_of, nrows, n, lane);
      } else {
        return __int_as_float(0x7fc00000);  // unreachable: the kernel's launcher picks by format
      }
  }
}

template <int kExtra = kRowsAllExtra, class RowOf, class ActOf>
__device__ float dot_rows(int type, RowOf row_of, ActOf act_of, int nrows, int n, int lane) {
  switch (static_cast<TensorType>(type)) {
    case TensorType::Q8_0:
      return dot_rows_format<FormatQ8_0>(row_of, act_of, nrows, n / kQK, lane);
    case TensorType::MXFP4:
      return dot_rows_format<FormatMXFP4>(row_of, act_of, nrows, n / kQK, lane);
    case TensorType::Q2_K:
      return dot_rows_format<FormatQ2_K>(row_of, act_of, nrows, n / kQK_K, lane);
    case TensorType::Q3_K:
      return dot_rows_format<FormatQ3_K>(row_of, act_of, nrows, n / kQK_K, lane);
    case TensorType::Q4_K:
      return dot_rows_format<FormatQ45_K<false>>(row_of, act_of, nrows, n / kQK_K, lane);
    case TensorType::Q5_K:
      return dot_rows_format<FormatQ45_K<true>>(row_of, act_of, nrows, n / kQK_K, lane);
    case TensorType::Q6_K:
      return dot_rows_format<FormatQ6_K>(row_of, act_of, nrows, n / kQK_K, lane);
    default:
      if constexpr ((kExtra & kRowsIssue26) != 0) {
        return dot_rows_issue26<(kExtra & kRowsIq) != 0>(type, row_of, act_of, nrows, n, lane);
      } else if constexpr ((kExtra & kRowsIq) != 0) {
        return dot_rows_iq(type, row_of, act_of, nrows, n, lane);
      } else {
        return __int_as_float(0x7fc00000);  // unreachable: the kernel's launcher picks by format
      }
  }
}

// Whether type (a TensorType value) is one of issue 26's formats (matvec_formats_legacy.cuh).
__host__ __device__ __forceinline__ bool is_issue26_format(int type) {
  switch (static_cast<TensorType>(type)) {
    case TensorType::Q4_0:
    case TensorType::Q4_1:
    case TensorType::Q5_0:
    case TensorType::Q5_1:
    case TensorType::IQ4_NL:
    case TensorType::IQ4_XS:
    case TensorType::TQ1_0:
    case TensorType::TQ2_0:
      return true;
    default:
      return false;
  }
}

// Whether type (a TensorType value) is one of the IQ grid formats (matvec_formats_iq.cuh).
__host__ __device__ __forceinline__ bool is_iq_grid_format(int type) {
  switch (static_cast<TensorType>(type)) {
    case TensorType::IQ2_XXS:
    case TensorType::IQ2_XS:
    case TensorType::IQ2_S:
    case TensorType::IQ3_XXS:
    case TensorType::IQ3_S:
    case TensorType::IQ1_S:
    case TensorType::IQ1_M:
      return true;
    default:
      return false;
  }
}

// Elements per weight block of a supported format (TensorType value).
__device__ __forceinline__ int format_block_elems(int type) {
  const TensorType t = static_cast<TensorType>(type);
  if (t == TensorType::Q4_0 || t == TensorType::Q4_1 || t == TensorType::Q5_0 || t == TensorType::Q5_1 ||
      t == TensorType::IQ4_NL)
    return kQK;  // issue 26's 32-element formats
  return t == TensorType::Q8_0 || t == TensorType::MXFP4 ? kQK : kQK_K;
}

// A weight format (a matvec_formats.cuh format) and a row length in blocks fixed at compile time:
// what the staged kernels are built for per shape (moe_staged.cu).
template <class F, int kBlocks>
struct FixedRows {
  using Format = F;
  static constexpr int kRowBlocks = kBlocks;
  static constexpr int kRowBytes = kBlocks * F::kBlockBytes;
  // Every row starts 16-byte aligned (the tensors do: moe_fused.h's contract), so a staged row
  // sits at the start of its shared-memory segment (staged()'s offset is 0).
  static constexpr bool kRowsAligned = kRowBytes % 16 == 0;
};

// Whether Shape (a FixedRows, or void: run-time shapes) has 16-byte aligned rows.
template <class Shape>
__host__ __device__ constexpr bool fixed_rows_aligned() {
  if constexpr (std::is_void_v<Shape>) {
    return false;
  } else {
    return Shape::kRowsAligned;
  }
}

// dot_rows for rows of a FixedRows shape, or, with Shape = void, the format chosen at run time
// from `type`: the same dot_rows_format either way, so the same bits. Why: the staged kernels
// built per shape carry no seven-way switch (its inlined code overflowed the instruction cache:
// ncu "no instruction" 2.0 of 12.5 cycles per issued instruction in kernel 1) and no divisions
// by the run-time lane split.
template <class Shape, class RowOf, class ActOf>
__device__ __forceinline__ float dot_rows_as(int type, RowOf row_of, ActOf act_of, int nrows, int n, int lane) {
  if constexpr (std::is_void_v<Shape>) {
    return dot_rows(type, row_of, act_of, nrows, n, lane);
  } else {
    return dot_rows_format<typename Shape::Format, Shape::kRowBlocks, Shape::kRowsAligned>(row_of, act_of, nrows,
                                                                                          Shape::kRowBlocks, lane);
  }
}

// A 32-element block into padded slot `slot` (dst + b * kQ80Stride): Q8_0, or with q81 Q8_1
// (the activations of Q4_1 / Q5_1: the same quants, and s), both with llama.cpp's x86 rule.
__device__ __forceinline__ void quantize_q8_0_or_1_llama(bool q81, float v, uint8_t* slot, int lane) {
  if (q81) {
    quantize_detail::quantize_q8_1_llama_warp(v, *reinterpret_cast<BlockQ8_1*>(slot + kQ81Offset), lane);
  } else {
    quantize_detail::quantize_q8_0_llama_warp(v, *reinterpret_cast<BlockQ8_0*>(slot + kQ80Offset), lane);
  }
}

// Block b of a float row (src, global memory written by this launch or an earlier one) quantized
// by one warp into dst (Q8_K, Q8_0 or with q81 Q8_1 block b), as reference::pack_activations does:
// Q8_0 / Q8_1 with llama.cpp's x86 rule, Q8_K with the reference rule (the x86 one differs only in
// the sign of an all-zero block's scale, which no dot sees).
inline __device__ void quantize_block(bool q8k, bool q81, const float* src, int b, uint8_t* dst, int lane) {
  if (q8k) {
    const float4* s = reinterpret_cast<const float4*>(src + b * kQK_K + 8 * lane);
    const float4 lo = __ldcg(s), hi = __ldcg(s + 1);
    const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    quantize_detail::quantize_q8_k_warp(v, *reinterpret_cast<BlockQ8_K*>(dst + b * kQ8KStride + kQ8KOffset), lane);
  } else {
    quantize_q8_0_or_1_llama(q81, __ldcg(src + b * kQK + lane), dst + b * kQ80Stride, lane);
  }
}

// The staged down kernel, which owns a slice of output rows: rows row_base .. row_base + rows_here - 1 of every leader's down matrix
// put in flight with cp.async into stage [leader d][R][down_seg_words], warp w taking rows w,
// w + kWarps, ... of every leader. The caller commits the group. Why by leader, then row: one
// (leader, row) pair per step with a division each took a third of the staged down kernel's
// instructions (ncu, 30B-A3B Q4_K, 1 token: 1.5 M of 4.6 M), and that kernel issues them beside
// kernel 1 on its SM. Which warp copies a row changes nothing in the data.
template <int kWarps, class Tables>
__device__ __forceinline__ void stage_down_slice(const MoeParams& p, const Tables& st, int n_leaders, int row_base,
                                                 int rows_here, int R, uint4* stage, int warp, int lane) {
  for (int d = 0; d < n_leaders; ++d) {
    const uint8_t* w = expert_tensor(p, 2, st.chosen[st.leader[d]]);
    for (int j = warp; j < rows_here; j += kWarps)
      stage_row_async(w + static_cast<int64_t>(row_base + j) * p.down_row_bytes, p.down_row_bytes,
                      stage + (d * R + j) * p.down_seg_words, lane);
  }
}

// Kernel 1's x of every token quantized into shared memory as the scalar reference's
// pack_activations does: for gate at xg, and for up at xu unless same_x (gate and up take the
// same activation format; xu == xg then). The CTA's kWarps warps take the blocks round-robin.
template <int kWarps>
__device__ __forceinline__ void quantize_x(const MoeParams& p, uint8_t* xg, uint8_t* xu, bool same_x, int warp,
                                           int lane) {
  const int bg = p.n_embd / (p.x_gate_q8k ? kQK_K : kQK);
  for (int u = warp; u < p.n_tokens * bg; u += kWarps)
    quantize_block(p.x_gate_q8k, p.q81 & kQ81GateX, p.x + static_cast<int64_t>(u / bg) * p.n_embd, u % bg,
                   xg + (u / bg) * p.xg_stride, lane);
  if (!same_x) {
    const int bu = p.n_embd / (p.x_up_q8k ? kQK_K : kQK);
    for (int u = warp; u < p.n_tokens * bu; u += kWarps)
      quantize_block(p.x_up_q8k, p.q81 & kQ81UpX, p.x + static_cast<int64_t>(u / bu) * p.n_embd, u % bu,
                     xu + (u / bu) * p.xu_stride, lane);
  }
}

// One warp's unit of kernel 1 for one slot: h[slot][row0 + j] = silu(gate_j . x_t) * (up_j . x_t)
// for the n_pairs gate/up row pairs staged at `stage` (gate row j at j * pair_words, up row j
// after it, pair_words = gate_seg_words + up_seg_words; g_base / u_base: the expert's tensors, for
// the rows' alignment), t the slot's token. The staged kernel 1 and the bench's warp-unit kernel 1
// call this.
// How it dots (every kernel 1 alike, so the same bits): with by_rows, gate row j and up row j in
// adjacent groups of `lanes` lanes of one dot_rows call, `pairs` pairs a call (the kernels set
// lanes = lanes_per_row(blocks of a gate row), pairs = 32 / lanes / 2, and by_rows where the
// gate and up formats agree and a pair fits), so u reaches g's lanes with one shuffle; else
// dot_staged per row. n_pairs by reference: the kernels pass their parameter field, read where it
// is used (as the kernels' own loops did: the same code). Shape: the gate/up rows' FixedRows when
// the caller was built for them (then by_rows holds and lanes / pairs follow from it), else void;
// with aligned FixedRows the unit is staged as its n_pairs gate rows back to back, then its up
// rows (moe_staged.cu's kernel 1 copies it so), not in pair_words segments.
template <class Shape = void>
__device__ __forceinline__ void gate_up_unit_h(const MoeParams& p, int lanes, int pairs, bool by_rows,
                                               const uint4* stage, int pair_words, const uint8_t* g_base,
                                               const uint8_t* u_base, int row0, const int& n_pairs, int slot,
                                               const uint8_t* xg, const uint8_t* xu, int lane) {
  if constexpr (!std::is_void_v<Shape>) {
    lanes = lanes_per_row(Shape::kRowBlocks);
    pairs = 32 / lanes / 2;
    by_rows = true;
  }
  const int t = slot / p.k;
  float* h_row = p.h + static_cast<int64_t>(slot) * p.n_ff + row0;
  for (int j0 = 0; by_rows && j0 < n_pairs; j0 += pairs) {
    const int np = min(pairs, n_pairs - j0);
    auto row_of = [&](int c) {
      const int j = j0 + c / 2;
      const int64_t row = row0 + j;
      if constexpr (fixed_rows_aligned<Shape>()) {  // the unit's gate rows, then its up rows, unpadded
        constexpr int kRowWords = Shape::kRowBytes / 16;
        return reinterpret_cast<const uint8_t*>(stage + (c % 2 == 0 ? 0 : n_pairs * kRowWords) + j * kRowWords);
      } else {
        return c % 2 == 0 ? staged(stage + j * pair_words, g_base + row * p.gate_row_bytes)
                          : staged(stage + j * pair_words + p.gate_seg_words, u_base + row * p.up_row_bytes);
      }
    };
    const uint8_t* xt = xg + t * p.xg_stride;
    const float v = dot_rows_as<Shape>(p.gate_type, row_of, [&](int) { return xt; }, 2 * np, p.n_embd, lane);
    const float uv = __shfl_down_sync(0xffffffffu, v, lanes);  // up j, from the next group
    const int c = lane / lanes;
    // reference::silu(g) * u, with the reference's operations and rounding (expf aside).
    if (lane % lanes == 0 && c % 2 == 0 && c / 2 < np)
      h_row[j0 + c / 2] = __fmul_rn(__fdiv_rn(v, __fadd_rn(1.0f, expf(-v))), uv);
  }
  if constexpr (std::is_void_v<Shape>) {  // else by_rows (the contract above)
    for (int j = 0; !by_rows && j < n_pairs; ++j) {
      const int64_t row = row0 + j;
      const uint8_t* gate_row = staged(stage + j * pair_words, g_base + row * p.gate_row_bytes);
      const uint8_t* up_row = staged(stage + j * pair_words + p.gate_seg_words, u_base + row * p.up_row_bytes);
      const float g = dot_staged(p.gate_type, gate_row, p.n_embd, xg + t * p.xg_stride, lane);
      const float uv = dot_staged(p.up_type, up_row, p.n_embd, xu + t * p.xu_stride, lane);
      if (lane == 0) h_row[j] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), uv);
    }
  }

}


}  // namespace moraine::cuda::moe_detail
