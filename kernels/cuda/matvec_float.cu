// One warp per output row; lanes stride the row, the activation row is staged once per CTA in
// shared memory, already rounded to the weight's type. Rows of whole 16-byte words that fit take
// matvec_float_staged_kernel (2 rows per CTA, each row copied whole into shared memory first);
// the others matvec_float_kernel (8 rows per CTA, coalesced 128-byte reads straight from global).
#include "kernels/cuda/matvec_float.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/matvec_float_row.cuh"

namespace moraine::cuda {
namespace {

using namespace matvec_float_detail;

constexpr int kRowsPerCta = 8;

template <TensorType T>
__global__ void __launch_bounds__(32 * kRowsPerCta)
    matvec_float_kernel(const uint8_t* __restrict__ w, int64_t rows, int64_t n, const float* __restrict__ x,
                        float* __restrict__ y, int64_t w_stride, int64_t act_stride, int64_t out_stride,
                        const int32_t* __restrict__ ids, size_t elem_bytes, bool accumulate) {
  extern __shared__ float xs[];
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int e = blockIdx.y;
  const float* xe = reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(x) + e * act_stride);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) xs[i] = round_activation<T>(xe[i]);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + warp;
  if (row >= rows) return;
  const int64_t mat = ids != nullptr ? ids[e] : e;
  const uint8_t* wr = w + mat * w_stride + row * n * static_cast<int64_t>(elem_bytes);
  const float acc = row_dot_warp<T>(wr, xs, n, lane);
  if (lane == 0) {
    float* out = y + e * out_stride + row;
    *out = accumulate ? __fadd_rn(*out, acc) : acc;  // residual_add's rounded addition
  }
}

// The same dot with each warp's weight row first copied whole into shared memory by
// asynchronous 16-byte copies (async_copy.cuh), issued before the activation staging: the row's
// bytes are all in flight at once, where row_dot_warp straight from global memory waits for
// about one 128-byte load per lane step. F32 router 128 x 2048 (1 MB) on the H200, ncu-timed:
// 6.8 -> 3.1 us (graph-replayed 6.5 -> 2.4; moraine-kernel-bench cuda --mixer-only). The dot itself is row_dot_warp on the shared copy: the same operations in the same
// order, so the same bits (and router_fused.cu's). Two rows per CTA, so a router's 128 rows
// spread over 64 SMs. For rows whose bytes are whole 16-byte words at 16-byte aligned starts.
constexpr int kStagedRowsPerCta = 2;

template <TensorType T>
__global__ void __launch_bounds__(32 * kStagedRowsPerCta)
    matvec_float_staged_kernel(const uint8_t* __restrict__ w, int64_t rows, int64_t n, const float* __restrict__ x,
                               float* __restrict__ y, int64_t w_stride, int64_t act_stride, int64_t out_stride,
                               const int32_t* __restrict__ ids, size_t elem_bytes, bool accumulate) {
  extern __shared__ uint4 staged_smem[];
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int e = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kStagedRowsPerCta + warp;
  const int64_t row_words = n * static_cast<int64_t>(elem_bytes) / 16;
  float* xs = reinterpret_cast<float*>(staged_smem);  // n floats, a multiple of 4
  uint4* mine = staged_smem + n / 4 + warp * row_words;
  if (row < rows) {
    const int64_t mat = ids != nullptr ? ids[e] : e;
    const uint4* src = reinterpret_cast<const uint4*>(w + mat * w_stride + row * row_words * 16);
    for (int64_t i = lane; i < row_words; i += 32) async_copy::copy_16(mine + i, src + i);
  }
  // The activations likewise (all in flight at once), then each thread rounds the words it
  // copied in place (its own copies are visible to it after wait_all).
  const float4* x4 = reinterpret_cast<const float4*>(reinterpret_cast<const uint8_t*>(x) + e * act_stride);
  for (int64_t j = threadIdx.x; j < n / 4; j += blockDim.x) async_copy::copy_16(xs + 4 * j, x4 + j);
  async_copy::wait_all();
  if constexpr (T != TensorType::F32) {
    for (int64_t j = threadIdx.x; j < n / 4; j += blockDim.x) {
#pragma unroll
      for (int c = 0; c < 4; ++c) xs[4 * j + c] = round_activation<T>(xs[4 * j + c]);
    }
  }
  __syncthreads();
  if (row >= rows) return;
  const float acc = row_dot_warp<T>(reinterpret_cast<const uint8_t*>(mine), xs, n, lane);
  if (lane == 0) {
    float* out = y + e * out_stride + row;
    *out = accumulate ? __fadd_rn(*out, acc) : acc;  // residual_add's rounded addition
  }
}

template <TensorType T>
void launch(const void* w, int64_t rows, int64_t n, const float* x, float* y, const MatvecBatch& b,
            cudaStream_t stream) {
  const size_t elem = type_traits(T).block_bytes;
  const size_t staged_smem = static_cast<size_t>(n) * (sizeof(float) + kStagedRowsPerCta * elem);
  const bool whole_words = reinterpret_cast<uintptr_t>(w) % 16 == 0 && (static_cast<size_t>(n) * elem) % 16 == 0 &&
                           b.weight_stride_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                           b.act_stride_bytes % 16 == 0;
  if (whole_words && staged_smem <= 48 * 1024) {  // F32 rows up to n = 4096
    const dim3 grid(static_cast<unsigned>((rows + kStagedRowsPerCta - 1) / kStagedRowsPerCta),
                    static_cast<unsigned>(b.count));
    launch_kernel(matvec_float_staged_kernel<T>, grid, dim3(32 * kStagedRowsPerCta), staged_smem, stream,
                  static_cast<const uint8_t*>(w), rows, n, x, y, b.weight_stride_bytes, b.act_stride_bytes, b.out_stride,
                  b.expert_ids, elem, b.accumulate);
    return;
  }
  const size_t smem = static_cast<size_t>(n) * sizeof(float);
  if (smem > 48 * 1024) {
    static thread_local size_t raised = 48 * 1024;
    if (smem > raised) {
      CUDA_CHECK(cudaFuncSetAttribute(matvec_float_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
      raised = smem;
    }
  }
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerCta - 1) / kRowsPerCta), static_cast<unsigned>(b.count));
  launch_kernel(matvec_float_kernel<T>, grid, dim3(32 * kRowsPerCta), smem, stream, static_cast<const uint8_t*>(w), rows, n,
                x, y, b.weight_stride_bytes, b.act_stride_bytes, b.out_stride, b.expert_ids, type_traits(T).block_bytes,
                b.accumulate);
}

}  // namespace

bool matvec_float_supported(TensorType weight) {
  return weight == TensorType::F32 || weight == TensorType::F16 || weight == TensorType::BF16;
}

void matvec_float_batched(TensorType weight, const void* w, int64_t rows, int64_t n, const float* x, float* y,
                          const MatvecBatch& batch, cudaStream_t stream) {
  const std::string where = " (weight " + std::string(type_name(weight)) + ", rows=" + std::to_string(rows) +
                            ", n=" + std::to_string(n) + ", batch " + std::to_string(batch.count) + ")";
  if (rows <= 0 || rows > (int64_t{1} << 30) || n <= 0 || n > 48 * 1024)
    throw std::invalid_argument("matvec_float: rows must be in 1..2^30 and n in 1..49152" + where);
  if (batch.count < 1 || batch.count > 65535)
    throw std::invalid_argument("matvec_float: batch count not in 1..65535" + where);
  if (batch.act_stride_bytes % 4 != 0)
    throw std::invalid_argument("matvec_float: activation stride must be a multiple of 4 bytes" + where);
  switch (weight) {
    case TensorType::F32: return launch<TensorType::F32>(w, rows, n, x, y, batch, stream);
    case TensorType::F16: return launch<TensorType::F16>(w, rows, n, x, y, batch, stream);
    case TensorType::BF16: return launch<TensorType::BF16>(w, rows, n, x, y, batch, stream);
    default:
      throw std::invalid_argument("matvec_float: weight type is not f32, f16 or bf16" + where);
  }
}

}  // namespace moraine::cuda
