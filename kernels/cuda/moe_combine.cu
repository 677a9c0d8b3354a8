#include "kernels/cuda/moe_combine.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"

namespace moraine::cuda {
namespace {

__global__ void moe_combine_kernel(float* __restrict__ x, const float* __restrict__ slots,
                                   const float* __restrict__ host_rows, const int32_t* __restrict__ host_row_of,
                                   const float* __restrict__ weight, const float* __restrict__ shared,
                                   const float* __restrict__ gate_logit, int64_t k, int64_t d) {
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t t = blockIdx.y;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= d) return;
  float acc = 0.0f;
  for (int64_t s = 0; s < k; ++s) {
    const int64_t slot = t * k + s;
    const int32_t alt = host_row_of != nullptr ? host_row_of[slot] : -1;
    const float y = alt >= 0 ? host_rows[alt * d + i] : slots[slot * d + i];
    acc = __fadd_rn(acc, __fmul_rn(weight[slot], y));
  }
  if (shared != nullptr && gate_logit != nullptr) {
    const float g = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-gate_logit[t])));
    acc = __fadd_rn(acc, __fmul_rn(g, shared[t * d + i]));
  } else if (shared != nullptr) {   // ungated (glm4moe): the reference's 1.0f * shared, exactly shared
    acc = __fadd_rn(acc, shared[t * d + i]);
  }
  x[t * d + i] = __fadd_rn(x[t * d + i], acc);
}

}  // namespace

void moe_combine(float* x, const float* slots, const float* weight, const float* shared, const float* gate_logit,
                 int64_t n, int64_t k, int64_t d, cudaStream_t stream) {
  moe_combine_mixed(x, slots, nullptr, nullptr, weight, shared, gate_logit, n, k, d, stream);
}

void moe_combine_mixed(float* x, const float* slots, const float* host_rows, const int32_t* host_row_of,
                       const float* weight, const float* shared, const float* gate_logit, int64_t n, int64_t k,
                       int64_t d, cudaStream_t stream) {
  if ((host_rows == nullptr) != (host_row_of == nullptr))
    throw std::invalid_argument("moe_combine_mixed: host_rows and host_row_of must be given together");
  if (n <= 0 || n > 65535 || k <= 0 || d <= 0 || (shared == nullptr && gate_logit != nullptr))
    throw std::invalid_argument("moe_combine: n=" + std::to_string(n) + ", k=" + std::to_string(k) + ", d=" +
                                std::to_string(d) + " (need n in 1..65535, k, d > 0, and no gate_logit without "
                                "shared)");
  constexpr int kThreads = 256;
  const dim3 grid(static_cast<unsigned>((d + kThreads - 1) / kThreads), static_cast<unsigned>(n));
  launch_kernel(moe_combine_kernel, grid, dim3(kThreads), 0, stream, x, slots, host_rows, host_row_of, weight, shared,
                gate_logit, k, d);
}

}  // namespace moraine::cuda
