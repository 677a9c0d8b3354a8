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

}  // namespace

void residual_add(float* x, const float* y, int64_t count, cudaStream_t stream) {
  if (count < 0) throw std::invalid_argument("residual_add: negative count " + std::to_string(count));
  if (count == 0) return;
  constexpr int kThreads = 256;
  launch_kernel(residual_add_kernel, dim3(static_cast<unsigned>((count + kThreads - 1) / kThreads)), dim3(kThreads), 0,
                stream, x, y, count);
}

}  // namespace moraine::cuda
