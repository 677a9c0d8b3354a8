#include "kernels/cuda/swiglu.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"

namespace moraine::cuda {
namespace {

__global__ void swiglu_kernel(float* __restrict__ g, const float* __restrict__ u, int64_t count) {
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const float x = g[i];
  g[i] = __fmul_rn(__fdiv_rn(x, __fadd_rn(1.0f, expf(-x))), u[i]);
}

}  // namespace

void swiglu(float* g, const float* u, int64_t count, cudaStream_t stream) {
  if (count < 0) throw std::invalid_argument("swiglu: negative count " + std::to_string(count));
  if (count == 0) return;
  constexpr int kThreads = 256;
  launch_kernel(swiglu_kernel, dim3(static_cast<unsigned>((count + kThreads - 1) / kThreads)), dim3(kThreads), 0, stream, g,
                u, count);
}

}  // namespace moraine::cuda
