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

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/matvec_formats.cuh"

namespace moraine::cuda {
namespace {

using namespace matvec_detail;

constexpr int kRowsPerCta = 4;

template <class F>
__global__ void __launch_bounds__(32 * kRowsPerCta)
    matvec_kernel(const uint8_t* __restrict__ w, int rows, int nblocks, const uint8_t* __restrict__ act,
                  float* __restrict__ y, int64_t w_stride, int64_t act_stride, int64_t out_stride,
                  const int32_t* __restrict__ ids, int stage_words) {
  extern __shared__ uint4 stage[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * kRowsPerCta + warp;
  if (row >= rows) return;  // uniform per warp; no CTA-wide barrier below
  const int e = blockIdx.y;
  const int64_t mat = ids != nullptr ? ids[e] : e;
  const int64_t row_bytes = static_cast<int64_t>(nblocks) * F::kBlockBytes;
  const uintptr_t start = reinterpret_cast<uintptr_t>(w + mat * w_stride + row * row_bytes);
  const uintptr_t first = start & ~uintptr_t{15};
  const int nwords = static_cast<int>((start + row_bytes - first + 15) / 16);
  uint4* mine = stage + warp * stage_words;
  const uint4* src = reinterpret_cast<const uint4*>(first);
#pragma unroll 4
  for (int i = lane; i < nwords; i += 32) mine[i] = __ldg(src + i);
  __syncwarp();

  const uint8_t* row_bytes_smem = reinterpret_cast<const uint8_t*>(mine) + (start - first);
  const auto* a = reinterpret_cast<const typename F::Act*>(act + e * act_stride);
  const int units = nblocks * F::kParts;
  float acc = 0.0f;
  for (int u0 = 0; u0 < units; u0 += 32) {
    const int u = u0 + lane;
    const bool valid = u < units;
    const int b = u / F::kParts, part = u % F::kParts;
    int isum = 0, msum = 0;
    if (valid) F::part(row_bytes_smem + b * F::kBlockBytes, a[b], part, isum, msum);
#pragma unroll
    for (int off = 1; off < F::kParts; off *= 2) {  // exact integer sums over one block's lanes
      isum += __shfl_xor_sync(0xffffffffu, isum, off);
      msum += __shfl_xor_sync(0xffffffffu, msum, off);
    }
    if (valid && part == 0) acc += F::term(row_bytes_smem + b * F::kBlockBytes, a[b], isum, msum);
  }
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) y[e * out_stride + row] = acc;
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
  if (reinterpret_cast<uintptr_t>(w) % 16 != 0 || batch.weight_stride_bytes % 16 != 0)
    throw std::invalid_argument("matvec: weights and the weight stride must be 16-byte aligned" + where(t, rows, n));
  if (reinterpret_cast<uintptr_t>(act) % 4 != 0 || batch.act_stride_bytes % 4 != 0)
    throw std::invalid_argument("matvec: activations and their stride must be 4-byte aligned" + where(t, rows, n));
  const int64_t nblocks = n / elems;
  const int64_t row_bytes = nblocks * F::kBlockBytes;
  // Up to 15 bytes of the first word precede the row (MXFP4 rows start at any byte), the last
  // word is rounded up, and one spare word covers load_16_unaligned's over-read.
  const int64_t stage_words = (row_bytes + 15 + 15) / 16 + 1;
  const int64_t smem = stage_words * 16 * kRowsPerCta;
  int device = 0, smem_optin = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (smem > smem_optin)
    throw std::invalid_argument("matvec: a row of " + std::to_string(row_bytes) + " bytes needs " +
                                std::to_string(smem) + " bytes of shared memory per CTA, more than the device's " +
                                std::to_string(smem_optin) + where(t, rows, n));
  if (smem > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(matvec_kernel<F>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerCta - 1) / kRowsPerCta), static_cast<unsigned>(batch.count));
  matvec_kernel<F><<<grid, 32 * kRowsPerCta, static_cast<size_t>(smem), stream>>>(
      static_cast<const uint8_t*>(w), static_cast<int>(rows), static_cast<int>(nblocks),
      static_cast<const uint8_t*>(act), y, batch.weight_stride_bytes, batch.act_stride_bytes, batch.out_stride,
      batch.expert_ids, static_cast<int>(stage_words));
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool matvec_supported(TensorType weight) {
  switch (weight) {
    case TensorType::Q8_0:
    case TensorType::Q4_K:
    case TensorType::Q5_K:
    case TensorType::Q6_K:
    case TensorType::MXFP4:
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
    default:
      throw std::invalid_argument("matvec: no CUDA kernel for weight type " + std::string(type_name(weight)) +
                                  " (supported: q8_0, q4_k, q5_k, q6_k, mxfp4)");
  }
}

void matvec_quantized(TensorType weight, const void* w, int64_t rows, int64_t n, const void* act, float* y,
                      cudaStream_t stream) {
  MatvecBatch one;
  matvec_quantized_batched(weight, w, rows, n, act, y, one, stream);
}

}  // namespace moraine::cuda
