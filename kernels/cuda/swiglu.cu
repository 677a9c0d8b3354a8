#include "kernels/cuda/swiglu.h"
#include "kernels/cuda/swiglu_clamped.cuh"

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

__global__ void swiglu_experts_kernel(float* __restrict__ g, const float* __restrict__ u, int64_t count, int64_t ff,
                                      const int32_t* __restrict__ expert_of_row, const float* __restrict__ gate_bias,
                                      const float* __restrict__ up_bias, bool clamped, float alpha, float limit) {
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const int64_t b = static_cast<int64_t>(expert_of_row[i / ff]) * ff + i % ff;
  float x = g[i], y = u[i];
  if (gate_bias != nullptr) x = __fadd_rn(x, gate_bias[b]);
  if (up_bias != nullptr) y = __fadd_rn(y, up_bias[b]);
  g[i] = clamped ? swiglu_clamped(x, y, alpha, limit) : __fmul_rn(__fdiv_rn(x, __fadd_rn(1.0f, expf(-x))), y);
}

__global__ void add_expert_bias_kernel(float* __restrict__ y, int64_t count, int64_t d,
                                       const int32_t* __restrict__ expert_of_row, const float* __restrict__ bias) {
  wait_for_prior_grids();
  allow_dependent_grids();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) y[i] = __fadd_rn(y[i], bias[static_cast<int64_t>(expert_of_row[i / d]) * d + i % d]);
}

}  // namespace

void swiglu_experts(float* g, const float* u, int64_t rows, int64_t n_ff, const int32_t* expert_of_row,
                    const float* gate_bias, const float* up_bias, bool clamped, float alpha, float limit,
                    cudaStream_t stream) {
  if (rows < 0 || n_ff <= 0 || expert_of_row == nullptr)
    throw std::invalid_argument("swiglu_experts: rows " + std::to_string(rows) + ", n_ff " + std::to_string(n_ff) +
                                " (need rows >= 0, n_ff > 0 and the rows' experts)");
  const int64_t count = rows * n_ff;
  if (count == 0) return;
  constexpr int kThreads = 256;
  launch_kernel(swiglu_experts_kernel, dim3(static_cast<unsigned>((count + kThreads - 1) / kThreads)), dim3(kThreads), 0,
                stream, g, u, count, n_ff, expert_of_row, gate_bias, up_bias, clamped, alpha, limit);
}

void add_expert_bias(float* y, int64_t rows, int64_t d, const int32_t* expert_of_row, const float* bias,
                     cudaStream_t stream) {
  if (rows < 0 || d <= 0 || expert_of_row == nullptr || bias == nullptr)
    throw std::invalid_argument("add_expert_bias: rows " + std::to_string(rows) + ", d " + std::to_string(d) +
                                " (need rows >= 0, d > 0, the rows' experts and a bias)");
  const int64_t count = rows * d;
  if (count == 0) return;
  constexpr int kThreads = 256;
  launch_kernel(add_expert_bias_kernel, dim3(static_cast<unsigned>((count + kThreads - 1) / kThreads)), dim3(kThreads), 0,
                stream, y, count, d, expert_of_row, bias);
}

void swiglu(float* g, const float* u, int64_t count, cudaStream_t stream) {
  if (count < 0) throw std::invalid_argument("swiglu: negative count " + std::to_string(count));
  if (count == 0) return;
  constexpr int kThreads = 256;
  launch_kernel(swiglu_kernel, dim3(static_cast<unsigned>((count + kThreads - 1) / kThreads)), dim3(kThreads), 0, stream, g,
                u, count);
}

}  // namespace moraine::cuda
