// Device helpers of the fused MoE kernels shared by moe_fused.cu (the tiled and warp-unit
// kernels) and moe_staged.cu (the staged variant, MoeLayerWeights::Tuning::staged): the padded
// activation layout, the cp.async row staging, the per-row and several-rows dots and the warp
// quantizer of h. One copy, so every form adds the same per-block float terms in the same order
// for a given row length (the staged variant's output is bit-identical to the default's because
// it calls exactly these).
#pragma once
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/formats/quant.h"
#include "kernels/cuda/matvec_formats.cuh"
#include "kernels/cuda/quantize_block.cuh"

namespace moraine::cuda::moe_detail {

using namespace matvec_detail;

// Activations (x for gate/up, h for down) in shared memory and the workspace are padded: Q8_K
// block b at b * kQ8KStride + kQ8KOffset, Q8_0 block b at b * kQ80Stride + kQ80Offset, so the
// quants (and Q8_K's sums) start on 16-byte boundaries (packed 292- and 34-byte blocks leave them
// 4- or 2-byte aligned) and the Q4_K and Q8_0 dots read them as 16-byte words; lanes on
// consecutive blocks then hit distinct banks (strides of 76 and 12 words).
constexpr int kQ8KStride = 304, kQ8KOffset = 12;
constexpr int kQ80Stride = 48, kQ80Offset = 14;
static_assert(sizeof(BlockQ8_K) + kQ8KOffset <= kQ8KStride && (kQ8KOffset + 4) % 16 == 0 &&
                  (kQ8KOffset + 4 + kQK_K) % 16 == 0,
              "padded Q8_K layout: quants and sums 16-byte aligned");
static_assert(sizeof(BlockQ8_0) + kQ80Offset <= kQ80Stride && (kQ80Offset + 2) % 16 == 0,
              "padded Q8_0 layout: quants 16-byte aligned");
template <class Act>
__device__ __forceinline__ const Act& act_block(const uint8_t* act, int b) {
  static_assert(sizeof(Act) == sizeof(BlockQ8_K) || sizeof(Act) == sizeof(BlockQ8_0), "Q8_K or Q8_0 activations");
  if constexpr (sizeof(Act) == sizeof(BlockQ8_K)) {
    return *reinterpret_cast<const Act*>(act + b * kQ8KStride + kQ8KOffset);
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
__device__ float dot_staged_format(const uint8_t* row, int nblocks, const uint8_t* act, int lane, bool vec) {
  if constexpr (std::is_same_v<F, FormatQ8_0>) {  // one part per block: one block per lane
    if (vec) {
      float acc = 0.0f;
      for (int b = lane; b < nblocks; b += 32) {
        const uint8_t* wb = row + b * F::kBlockBytes;
        acc += F::term(wb, act_block<BlockQ8_0>(act, b), q8_0_block_isum_vec(wb, act_block<BlockQ8_0>(act, b)), 0);
      }
      for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
      return acc;
    }
  }
  const int units = nblocks * F::kParts;
  float acc = 0.0f;
  for (int u0 = 0; u0 < units; u0 += 32) {
    const int u = u0 + lane;
    const bool valid = u < units;
    const int b = u / F::kParts, part = u % F::kParts;
    int isum = 0, msum = 0;
    if (valid) F::part(row + b * F::kBlockBytes, act_block<typename F::Act>(act, b), part, isum, msum);
#pragma unroll
    for (int off = 1; off < F::kParts; off *= 2) {
      isum += __shfl_xor_sync(0xffffffffu, isum, off);
      msum += __shfl_xor_sync(0xffffffffu, msum, off);
    }
    if (valid && part == 0) acc += F::term(row + b * F::kBlockBytes, act_block<typename F::Act>(act, b), isum, msum);
  }
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  return acc;
}

// Runtime format switch (warp-uniform): one kernel serves every format and mix of formats.
inline __device__ float dot_staged(int type, const uint8_t* row, int n, const uint8_t* act, int lane, bool vec) {
  switch (static_cast<TensorType>(type)) {
    case TensorType::Q8_0:
      return dot_staged_format<FormatQ8_0>(row, n / kQK, act, lane, vec);
    case TensorType::MXFP4:
      return dot_staged_format<FormatMXFP4>(row, n / kQK, act, lane, vec);
    case TensorType::Q2_K:
      return dot_staged_format<FormatQ2_K>(row, n / kQK_K, act, lane, vec);
    case TensorType::Q3_K:
      return dot_staged_format<FormatQ3_K>(row, n / kQK_K, act, lane, vec);
    case TensorType::Q4_K:
      return dot_staged_format<FormatQ45_K<false>>(row, n / kQK_K, act, lane, vec);
    case TensorType::Q5_K:
      return dot_staged_format<FormatQ45_K<true>>(row, n / kQK_K, act, lane, vec);
    case TensorType::Q6_K:
      return dot_staged_format<FormatQ6_K>(row, n / kQK_K, act, lane, vec);
    default:
      return __int_as_float(0x7fc00000);  // unreachable: moe_fused_check refuses the type
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
__device__ __forceinline__ int lanes_per_row(int nblocks) {
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

template <class F, class RowOf, class ActOf>
__device__ float dot_rows_format(RowOf row_of, ActOf act_of, int nrows, int nblocks, int lane, bool vec) {
  const int lanes = lanes_per_row(nblocks);
  const int r = lane / lanes;
  float acc = 0.0f;
  if (r < nrows) {
    const uint8_t* row = row_of(r);
    const uint8_t* act = act_of(r);
    // Q4_K rows are whole 16-byte words (the contract aligns them); Q8_0's weight reads are unaligned anyway.
    vec = vec && (std::is_same_v<F, FormatQ8_0> || (reinterpret_cast<uintptr_t>(row) & 15) == 0);
    for (int b = lane % lanes; b < nblocks; b += lanes) {
      const uint8_t* wb = row + b * F::kBlockBytes;
      int isum = 0, msum = 0;
      if constexpr (std::is_same_v<F, FormatQ45_K<false>>) {
        if (vec) {
          q4k_block_sums_vec(wb, act_block<BlockQ8_K>(act, b), isum, msum);
          acc += F::term(wb, act_block<typename F::Act>(act, b), isum, msum);
          continue;
        }
      }
      if constexpr (std::is_same_v<F, FormatQ8_0>) {
        if (vec) {
          acc += F::term(wb, act_block<BlockQ8_0>(act, b), q8_0_block_isum_vec(wb, act_block<BlockQ8_0>(act, b)), 0);
          continue;
        }
      }
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
  for (int off = lanes / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  return acc;
}

// vec: the Q4_K dot's 16-byte loads (q4k_block_sums_vec; Params::vec_q4k).
template <class RowOf, class ActOf>
__device__ float dot_rows(int type, RowOf row_of, ActOf act_of, int nrows, int n, int lane, bool vec) {
  switch (static_cast<TensorType>(type)) {
    case TensorType::Q8_0:
      return dot_rows_format<FormatQ8_0>(row_of, act_of, nrows, n / kQK, lane, vec);
    case TensorType::MXFP4:
      return dot_rows_format<FormatMXFP4>(row_of, act_of, nrows, n / kQK, lane, vec);
    case TensorType::Q2_K:
      return dot_rows_format<FormatQ2_K>(row_of, act_of, nrows, n / kQK_K, lane, vec);
    case TensorType::Q3_K:
      return dot_rows_format<FormatQ3_K>(row_of, act_of, nrows, n / kQK_K, lane, vec);
    case TensorType::Q4_K:
      return dot_rows_format<FormatQ45_K<false>>(row_of, act_of, nrows, n / kQK_K, lane, vec);
    case TensorType::Q5_K:
      return dot_rows_format<FormatQ45_K<true>>(row_of, act_of, nrows, n / kQK_K, lane, vec);
    case TensorType::Q6_K:
      return dot_rows_format<FormatQ6_K>(row_of, act_of, nrows, n / kQK_K, lane, vec);
    default:
      return __int_as_float(0x7fc00000);  // unreachable: moe_fused_check refuses the type
  }
}

// Elements per weight block of a supported format (TensorType value).
__device__ __forceinline__ int format_block_elems(int type) {
  const TensorType t = static_cast<TensorType>(type);
  return t == TensorType::Q8_0 || t == TensorType::MXFP4 ? kQK : kQK_K;
}

// Block b of a float row (src, global memory written by this launch or an earlier one) quantized
// by one warp into dst (Q8_K or Q8_0 block b), as reference::pack_activations does: Q8_0 with
// llama.cpp's x86 rule, Q8_K with the reference rule (the x86 one differs only in the sign of an
// all-zero block's scale, which no dot sees).
inline __device__ void quantize_block(bool q8k, const float* src, int b, uint8_t* dst, int lane) {
  if (q8k) {
    const float4* s = reinterpret_cast<const float4*>(src + b * kQK_K + 8 * lane);
    const float4 lo = __ldcg(s), hi = __ldcg(s + 1);
    const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    quantize_detail::quantize_q8_k_warp(v, *reinterpret_cast<BlockQ8_K*>(dst + b * kQ8KStride + kQ8KOffset), lane);
  } else {
    quantize_detail::quantize_q8_0_llama_warp(__ldcg(src + b * kQK + lane),
                                              *reinterpret_cast<BlockQ8_0*>(dst + b * kQ80Stride + kQ80Offset), lane);
  }
}


}  // namespace moraine::cuda::moe_detail
