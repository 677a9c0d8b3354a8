#include "kernels/cuda/residual_add.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"

namespace moraine::cuda {
namespace {

__global__ void residual_add_kernel(float* __restrict__ x, const float* __restrict__ y, int64_t count) {
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) x[i] = __fadd_rn(x[i], y[i]);
}

__global__ void residual_add_bias_kernel(float* __restrict__ x, const float* __restrict__ y,
                                         const float* __restrict__ bias, int64_t count, int64_t d) {
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) x[i] = __fadd_rn(x[i], __fadd_rn(y[i], bias[i % d]));
}

}  // namespace

void residual_add_bias(float* x, const float* y, const float* bias, int64_t rows, int64_t d, cudaStream_t stream) {
  if (rows < 0 || d <= 0 || bias == nullptr)
    throw std::invalid_argument("residual_add_bias: rows " + std::to_string(rows) + ", d " + std::to_string(d) +
                                " (need rows >= 0, d > 0 and a bias)");
  const int64_t count = rows * d;
  if (count == 0) return;
  constexpr int kThreads = 256;
  launch_kernel(residual_add_bias_kernel, dim3(static_cast<unsigned>((count + kThreads - 1) / kThreads)), dim3(kThreads),
                0, stream, x, y, bias, count, d);
}

void residual_add(float* x, const float* y, int64_t count, cudaStream_t stream) {
  if (count < 0) throw std::invalid_argument("residual_add: negative count " + std::to_string(count));
  if (count == 0) return;
  constexpr int kThreads = 256;
  launch_kernel(residual_add_kernel, dim3(static_cast<unsigned>((count + kThreads - 1) / kThreads)), dim3(kThreads), 0,
                stream, x, y, count);
}

}  // namespace moraine::cuda
