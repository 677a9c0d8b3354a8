// Scalar reference: quantize_q8_0 (common/formats/quant_legacy.cpp), quantize_q8_1
// (quant_legacy_extra.cpp) and quantize_q8_k (common/formats/kquant_quantize.cpp); the per-block code is shared with the fused MoE kernel
// (quantize_block.cuh). tests/cuda/quantize_activations_test.cpp checks the bytes.
#include "kernels/cuda/quantize_activations.h"

#include <stdexcept>
#include <string>

#include "common/formats/block_layouts.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/quantize_block.cuh"

namespace moraine::cuda {
namespace {

constexpr int kWarpsPerCta = 8;

// One warp per 32-element block, one element per lane.
__global__ void quantize_q8_0_kernel(const float* __restrict__ x, BlockQ8_0* __restrict__ out,
                                     int64_t nblocks) {
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  if (b >= nblocks) return;  // whole warps leave together: b is uniform per warp
  const int lane = threadIdx.x % 32;
  quantize_detail::quantize_q8_0_warp(x[b * kQK + lane], out[b], lane);
}

// Q8_1 (Q4_1 / Q5_1 activations): one warp per 32-element block, one element per lane.
__global__ void quantize_q8_1_kernel(const float* __restrict__ x, BlockQ8_1* __restrict__ out,
                                     int64_t nblocks) {
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  if (b >= nblocks) return;
  const int lane = threadIdx.x % 32;
  quantize_detail::quantize_q8_1_warp(x[b * kQK + lane], out[b], lane);
}

// One warp per 256-element block, 8 consecutive elements per lane.
__global__ void quantize_q8_k_kernel(const float* __restrict__ x, BlockQ8_K* __restrict__ out,
                                     int64_t nblocks) {
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  if (b >= nblocks) return;
  const int lane = threadIdx.x % 32;
  const float4* src = reinterpret_cast<const float4*>(x + b * kQK_K + 8 * lane);
  const float4 lo = src[0], hi = src[1];
  const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  quantize_detail::quantize_q8_k_warp(v, out[b], lane);
}

}  // namespace

void quantize_activations(TensorType act_type, const float* x, void* out, int64_t n,
                          int64_t rows, cudaStream_t stream) {
  if (act_type != TensorType::Q8_0 && act_type != TensorType::Q8_K && act_type != TensorType::Q8_1)
    throw std::invalid_argument("quantize_activations: activation type " +
                                std::string(type_name(act_type)) + " is not q8_0, q8_1 or q8_K");
  const int64_t block = act_type == TensorType::Q8_K ? kQK_K : kQK;
  if (n <= 0 || rows <= 0 || n % block != 0)
    throw std::invalid_argument("quantize_activations: n=" + std::to_string(n) + ", rows=" +
                                std::to_string(rows) + " (n must be a positive multiple of " +
                                std::to_string(block) + " for " + std::string(type_name(act_type)) + ")");
  const int64_t nblocks = n / block * rows;
  const unsigned grid = static_cast<unsigned>((nblocks + kWarpsPerCta - 1) / kWarpsPerCta);
  if (act_type == TensorType::Q8_1) {
    launch_kernel(quantize_q8_1_kernel, dim3(grid), dim3(32 * kWarpsPerCta), 0, stream, x, static_cast<BlockQ8_1*>(out),
                  nblocks);
  } else if (act_type == TensorType::Q8_0) {
    launch_kernel(quantize_q8_0_kernel, dim3(grid), dim3(32 * kWarpsPerCta), 0, stream, x, static_cast<BlockQ8_0*>(out),
                  nblocks);
  } else {
    launch_kernel(quantize_q8_k_kernel, dim3(grid), dim3(32 * kWarpsPerCta), 0, stream, x, static_cast<BlockQ8_K*>(out),
                  nblocks);
  }
}

}  // namespace moraine::cuda
