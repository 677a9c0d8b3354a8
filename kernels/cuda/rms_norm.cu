#include "kernels/cuda/rms_norm.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/rms_norm_block.cuh"

namespace moraine::cuda {
namespace {

constexpr int kThreads = 256;

// One CTA per row. Products x*x are exact in double, as in the reference. out may alias x:
// each thread writes only elements it has just read, after the whole row was summed.
__global__ void __launch_bounds__(kThreads)
    rms_norm_kernel(const float* x, const float* __restrict__ w, float* out, int64_t n, float eps) {
  __shared__ double partial[kThreads / 32];
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const float* xr = x + blockIdx.x * n;
  float* orow = out + blockIdx.x * n;
  double ss = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const double v = xr[i];
    ss += v * v;
  }
  const float inv = rms_inverse<kThreads / 32>(ss, partial, n, eps);
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const float v = __fmul_rn(xr[i], inv);
    orow[i] = w != nullptr ? __fmul_rn(v, w[i]) : v;
  }
}

}  // namespace

void rms_norm(const float* x, const float* w, float* out, int64_t n, int64_t rows, float eps,
              cudaStream_t stream) {
  if (n <= 0 || rows <= 0 || rows > 0x7fffffff)
    throw std::invalid_argument("rms_norm: n=" + std::to_string(n) + ", rows=" + std::to_string(rows) +
                                " (both must be positive, rows below 2^31)");
  launch_kernel(rms_norm_kernel, dim3(static_cast<unsigned>(rows)), dim3(kThreads), 0, stream, x, w, out, n, eps);
}

}  // namespace moraine::cuda
