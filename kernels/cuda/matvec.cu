// Matrix-vector kernel shared by every weight format (per-format pieces in matvec_formats.cuh).
//
// One warp per row, 4 rows per CTA. The warp first copies its row into shared memory as aligned
// 16-byte words (coalesced, many loads in flight per lane, no alignment assumption on the block
// size: Q8_0 and Q6_K blocks are 34 and 210 bytes, so their rows start at arbitrary even
// offsets), then lanes take block parts round-robin from shared memory and dot them with dp4a
// against the q8 activations (small, reused by every row: served from L1/L2).
#include "kernels/cuda/matvec.h"

#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/matvec_formats.cuh"
#include "kernels/cuda/matvec_formats_iq.cuh"

namespace moraine::cuda {
namespace {

using namespace matvec_detail;

constexpr int kRowsPerCta = 4;

template <class F>
__global__ void __launch_bounds__(32 * kRowsPerCta)
    matvec_kernel(const uint8_t* __restrict__ w, int rows, int nblocks, const uint8_t* __restrict__ act,
                  float* __restrict__ y, int64_t w_stride, int64_t act_stride, int64_t out_stride,
                  const int32_t* __restrict__ ids, int act_words, int stage_words, bool accumulate,
                  bool weights_first) {
  extern __shared__ uint4 stage[];
  // PDL (launch.h): everything the previous kernel may write (ids, activations, y) is read after
  // the wait; with weights_first the weight row's copies go out before it.
  if (!weights_first) wait_for_prior_grids();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int e = blockIdx.y;
  const int row = blockIdx.x * kRowsPerCta + warp;
  const bool row_valid = row < rows;  // uniform per warp

  // The whole row goes in flight at once, as asynchronous copies straight into this warp's
  // shared-memory slice (async_copy.cuh), before the activations: no registers are held per
  // word, so every warp of a decode-sized matrix has its row in flight in the first wave.
  // The previous version moved the row through registers 2 KB per warp at a time (64 registers:
  // 8 CTAs per SM, so 5120 rows took two waves, and each further 2 KB chunk cost another HBM
  // round trip). Measured on the H200 (moraine-kernel-bench cuda --mixer-only, ncu-timed, old ->
  // new): Q8_0 5120 x 2048 9.0 -> 7.7 us (x16 tokens 66 -> 42), 2048 x 4096 6.9 -> 6.5 us (x16
  // 46 -> 32), LM head 151936 x 2048 125 -> 85 us (2.7 -> 3.9 TB/s).
  const int64_t mat = ids != nullptr ? ids[e] : e;
  const int64_t row_bytes = static_cast<int64_t>(nblocks) * F::kBlockBytes;
  const uintptr_t start = reinterpret_cast<uintptr_t>(w + mat * w_stride + static_cast<int64_t>(row) * row_bytes);
  const uintptr_t first = start & ~uintptr_t{15};
  const int nwords = row_valid ? static_cast<int>((start + row_bytes - first + 15) / 16) : 0;
  const uint4* src = reinterpret_cast<const uint4*>(first);
  uint4* mine = stage + act_words + warp * stage_words;
  for (int i = lane; i < nwords; i += 32) async_copy::copy_16(mine + i, src + i);
  if (weights_first) wait_for_prior_grids();
  allow_dependent_grids();

  // The activation row, once per CTA, into shared memory: lanes read blocks 34 or 292 bytes
  // apart, which from global memory costs one L1 wavefront per few lanes; from shared memory,
  // a few bank conflicts at most.
  const uintptr_t a_start = reinterpret_cast<uintptr_t>(act + e * act_stride);
  const uintptr_t a_first = a_start & ~uintptr_t{15};
  const int a_nwords = static_cast<int>((a_start + static_cast<uintptr_t>(nblocks) * sizeof(typename F::Act) - a_first + 15) / 16);
  for (int i = threadIdx.x; i < a_nwords; i += blockDim.x)
    async_copy::copy_16(stage + i, reinterpret_cast<const uint4*>(a_first) + i);
  async_copy::wait_all();
  __syncthreads();
  if (!row_valid) return;  // no CTA-wide barrier below
  const auto* a = reinterpret_cast<const typename F::Act*>(reinterpret_cast<const uint8_t*>(stage) + (a_start - a_first));
  const uint8_t* row_smem = reinterpret_cast<const uint8_t*>(mine) + (start - first);

  // Lane l takes block parts l, l + 32, ... of the row (a fixed assignment: the float sum of a
  // row does not depend on the batch or the launch). Aligned Q8_0 rows read block pairs instead
  // (matvec_formats.cuh: q8_0_dot_pairs) and hand each block's term to the same lane, so both
  // paths give the same bits (tests/cuda/matvec_test.cpp BlockPairPathEqualsPerBlockPath...).
  float acc = 0.0f;
  bool pairs = false;
  if constexpr (std::is_same_v<F, FormatQ8_0>) pairs = nblocks % 2 == 0 && ((start | a_start) & 3) == 0;
  if (pairs) acc = q8_0_dot_pairs(row_smem, reinterpret_cast<const uint8_t*>(a), nblocks, lane);
  const int units = pairs ? 0 : nblocks * F::kParts;
  for (int u0 = 0; u0 < units; u0 += 32) {
    const int u = u0 + lane;
    const bool valid = u < units;
    const int b = u / F::kParts, part = u % F::kParts;
    if constexpr (term_per_part<F>()) {
      // One float term per part (IQ4_XS): the block's terms go to its part-0 lane, which adds
      // them in part order, as the reference does.
      const float t = valid ? F::part_term(row_smem + b * F::kBlockBytes, a[b], part) : 0.0f;
      const int first = lane - part;
#pragma unroll
      for (int j = 0; j < F::kParts; ++j) {
        const float tj = __shfl_sync(0xffffffffu, t, first + j);
        if (valid && part == 0) acc += tj;
      }
    } else {
      int isum = 0, msum = 0;
      if (valid) F::part(row_smem + b * F::kBlockBytes, a[b], part, isum, msum);
#pragma unroll
      for (int off = 1; off < F::kParts; off *= 2) {  // exact integer sums over one block's lanes
        isum += __shfl_xor_sync(0xffffffffu, isum, off);
        msum += __shfl_xor_sync(0xffffffffu, msum, off);
      }
      if (valid && part == 0) acc += F::term(row_smem + b * F::kBlockBytes, a[b], isum, msum);
    }
  }
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) {
    float* out = y + e * out_stride + row;
    *out = accumulate ? __fadd_rn(*out, acc) : acc;  // residual_add's rounded addition
  }
}

// The current device and its opt-in shared-memory limit (the limit cached per thread).
struct DeviceLimit {
  int device, smem_optin;
};
DeviceLimit current_device_limit() {
  thread_local int cached_device = -1, cached_limit = 0;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  if (device != cached_device) {
    CUDA_CHECK(cudaDeviceGetAttribute(&cached_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    cached_device = device;
  }
  return {device, cached_limit};
}

std::string where(TensorType t, int64_t rows, int64_t n) {
  return " (weight " + std::string(type_name(t)) + ", rows=" + std::to_string(rows) + ", n=" + std::to_string(n) + ")";
}

template <class F>
void launch_format(TensorType t, const void* w, int64_t rows, int64_t n, const void* act, float* y,
                   const MatvecBatch& batch, cudaStream_t stream) {
  const int64_t elems = type_traits(t).block_elems;
  if (n <= 0 || n % elems != 0 || rows <= 0 || rows > (int64_t{1} << 30))
    throw std::invalid_argument("matvec: n must be a positive multiple of " + std::to_string(elems) +
                                " and rows in 1..2^30" + where(t, rows, n));
  if (batch.count < 1 || batch.count > 65535)
    throw std::invalid_argument("matvec: batch count " + std::to_string(batch.count) + " not in 1..65535" + where(t, rows, n));
  // Strides matter only for a batch. Whole-block weight strides keep Q4_K/Q5_K blocks (144, 176
  // bytes) 16-byte aligned, which their 4-byte shared-memory loads need; the activation blocks
  // keep their natural alignment in shared memory when their start and stride have it.
  const bool batched = batch.count > 1;
  constexpr int64_t kActAlign = alignof(typename F::Act);
  if (reinterpret_cast<uintptr_t>(w) % 16 != 0 ||
      (batched && batch.weight_stride_bytes % static_cast<int64_t>(F::kBlockBytes) != 0))
    throw std::invalid_argument("matvec: weights must be 16-byte aligned and the weight stride a whole number of blocks" +
                                where(t, rows, n));
  if (reinterpret_cast<uintptr_t>(act) % kActAlign != 0 || (batched && batch.act_stride_bytes % kActAlign != 0))
    throw std::invalid_argument("matvec: activations and their stride must be " + std::to_string(kActAlign) +
                                "-byte aligned" + where(t, rows, n));
  const int64_t nblocks = n / elems;
  const int64_t row_bytes = nblocks * F::kBlockBytes;
  // Up to 15 bytes of the first word precede the row (MXFP4 rows start at any byte), the last
  // word is rounded up, and one spare word covers load_16_unaligned's over-read.
  const int64_t stage_words = (row_bytes + 15 + 15) / 16 + 1;
  // The activation row likewise, in the same units (Act blocks pair one to one with weight blocks).
  const int64_t act_words = (nblocks * static_cast<int64_t>(sizeof(typename F::Act)) + 15 + 15) / 16 + 1;
  const int64_t smem = (act_words + stage_words * kRowsPerCta) * 16;
  const DeviceLimit limit = current_device_limit();
  const int smem_optin = limit.smem_optin;
  if (smem > smem_optin)
    throw std::invalid_argument("matvec: a row of " + std::to_string(row_bytes) + " bytes needs " +
                                std::to_string(smem) + " bytes of shared memory per CTA, more than the device's " +
                                std::to_string(smem_optin) + where(t, rows, n));
  // Raised once per kernel, device and size, not on every launch (host time per launch is what
  // small matrices are bound by).
  thread_local int raised_device = -1;
  thread_local int64_t smem_raised = 0;
  if (limit.device != raised_device) {
    raised_device = limit.device;
    smem_raised = 48 * 1024;
  }
  if (smem > smem_raised) {
    CUDA_CHECK(cudaFuncSetAttribute(matvec_kernel<F>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    smem_raised = smem;
  }
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerCta - 1) / kRowsPerCta), static_cast<unsigned>(batch.count));
  launch_kernel(matvec_kernel<F>, grid, dim3(32 * kRowsPerCta), static_cast<size_t>(smem), stream,
                static_cast<const uint8_t*>(w), static_cast<int>(rows), static_cast<int>(nblocks),
                static_cast<const uint8_t*>(act), y, batch.weight_stride_bytes, batch.act_stride_bytes, batch.out_stride,
                batch.expert_ids, static_cast<int>(act_words), static_cast<int>(stage_words), batch.accumulate,
                batch.expert_ids == nullptr && !batch.weights_from_previous_kernel);
}

}  // namespace

bool matvec_supported(TensorType weight) {
  switch (weight) {
    case TensorType::Q8_0:
    case TensorType::Q4_K:
    case TensorType::Q5_K:
    case TensorType::Q6_K:
    case TensorType::MXFP4:
    case TensorType::Q2_K:
    case TensorType::Q3_K:
      return true;
    // Issue 26 (matvec_formats_legacy.cuh)
    case TensorType::Q4_0:
    case TensorType::Q4_1:
    case TensorType::Q5_0:
    case TensorType::Q5_1:
    case TensorType::IQ4_NL:
    case TensorType::IQ4_XS:
    case TensorType::TQ1_0:
    case TensorType::TQ2_0:
    // The importance-matrix grid formats (matvec_formats_iq.cuh).
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

void matvec_quantized_batched(TensorType weight, const void* w, int64_t rows, int64_t n, const void* act,
                              float* y, const MatvecBatch& batch, cudaStream_t stream) {
  switch (weight) {
    case TensorType::Q8_0:
      return launch_format<FormatQ8_0>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::Q4_K:
      return launch_format<FormatQ45_K<false>>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::Q5_K:
      return launch_format<FormatQ45_K<true>>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::Q6_K:
      return launch_format<FormatQ6_K>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::MXFP4:
      return launch_format<FormatMXFP4>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::Q2_K:
      return launch_format<FormatQ2_K>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::Q3_K:
      return launch_format<FormatQ3_K>(weight, w, rows, n, act, y, batch, stream);
    // Issue 26 (matvec_formats_legacy.cuh)
    case TensorType::Q4_0:
      return launch_format<FormatQ4_0>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::Q4_1:
      return launch_format<FormatQ4_1>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::Q5_0:
      return launch_format<FormatQ5_0>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::Q5_1:
      return launch_format<FormatQ5_1>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::IQ4_NL:
      return launch_format<FormatIQ4_NL>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::IQ4_XS:
      return launch_format<FormatIQ4_XS>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::TQ1_0:
      return launch_format<FormatTQ1_0>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::TQ2_0:
      return launch_format<FormatTQ2_0>(weight, w, rows, n, act, y, batch, stream);
    // The importance-matrix grid formats (matvec_formats_iq.cuh).
    case TensorType::IQ2_XXS:
      return launch_format<FormatIQ2_XXS>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::IQ2_XS:
      return launch_format<FormatIQ2_XS>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::IQ2_S:
      return launch_format<FormatIQ2_S>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::IQ3_XXS:
      return launch_format<FormatIQ3_XXS>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::IQ3_S:
      return launch_format<FormatIQ3_S>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::IQ1_S:
      return launch_format<FormatIQ1_S>(weight, w, rows, n, act, y, batch, stream);
    case TensorType::IQ1_M:
      return launch_format<FormatIQ1_M>(weight, w, rows, n, act, y, batch, stream);
    default:
      throw std::invalid_argument("matvec: no CUDA kernel for weight type " + std::string(type_name(weight)) +
                                  " (supported: q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, mxfp4, q4_0, q4_1, q5_0, q5_1, "
                                  "iq4_nl, iq4_xs, tq1_0, tq2_0, iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s, iq1_s, iq1_m)");
  }
}

void matvec_quantized(TensorType weight, const void* w, int64_t rows, int64_t n, const void* act, float* y,
                      cudaStream_t stream) {
  MatvecBatch one;
  matvec_quantized_batched(weight, w, rows, n, act, y, one, stream);
}

}  // namespace moraine::cuda
