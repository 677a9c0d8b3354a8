// One warp per output row, 8 rows per CTA; lanes stride the row (coalesced 128-byte reads of an
// F32 row), the activation row is staged once per CTA in shared memory, already rounded to the
// weight's type.
#include "kernels/cuda/matvec_float.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
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

template <TensorType T>
void launch(const void* w, int64_t rows, int64_t n, const float* x, float* y, const MatvecBatch& b,
            cudaStream_t stream) {
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
  matvec_float_kernel<T><<<grid, 32 * kRowsPerCta, smem, stream>>>(
      static_cast<const uint8_t*>(w), rows, n, x, y, b.weight_stride_bytes, b.act_stride_bytes, b.out_stride,
      b.expert_ids, type_traits(T).block_bytes, b.accumulate);
  CUDA_CHECK(cudaGetLastError());
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
