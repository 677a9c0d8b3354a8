#include "kernels/cuda/quantize_activations_llama.h"

#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "common/formats/block_layouts.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/quantize_activations.h"
#include "kernels/cuda/quantize_block.cuh"

namespace moraine::cuda {
namespace {

constexpr int kWarpsPerCta = 8;

// x86's cvtps_epi32 then saturating packs: nearest-even; out-of-range and NaN give INT_MIN, which
// the packs clamp to -128 (reached only when 127/amax overflows, amax below ~7e-37).
__device__ __forceinline__ int8_t to_int8_like_packs(float v) {
  const float r = rintf(v);
  if (isnan(r) || r >= 2147483648.0f || r < -2147483648.0f) return -128;
  const int i = static_cast<int>(r);
  return static_cast<int8_t>(i > 127 ? 127 : (i < -128 ? -128 : i));
}

// One warp per 32-element block, one element per lane.
__global__ void quantize_q8_0_llama_kernel(const float* __restrict__ x, BlockQ8_0* __restrict__ out,
                                           int64_t nblocks) {
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  if (b >= nblocks) return;
  const int lane = threadIdx.x % 32;
  const float v = x[b * kQK + lane];
  float amax = fabsf(v);
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
  out[b].qs[lane] = to_int8_like_packs(__fmul_rn(v, id));
  if (lane == 0) out[b].d = __half_as_ushort(__float2half_rn(__fdiv_rn(amax, 127.0f)));
}

// Q8_1: one warp per 32-element block (quantize_block.cuh's llama rule for Q8_1).
__global__ void quantize_q8_1_llama_kernel(const float* __restrict__ x, BlockQ8_1* __restrict__ out,
                                           int64_t nblocks) {
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  if (b >= nblocks) return;
  const int lane = threadIdx.x % 32;
  quantize_detail::quantize_q8_1_llama_warp(x[b * kQK + lane], out[b], lane);
}

}  // namespace

void quantize_activations_llama(TensorType act_type, const float* x, void* out, int64_t n, int64_t rows,
                                cudaStream_t stream) {
  if (act_type != TensorType::Q8_0 && act_type != TensorType::Q8_1)
    return quantize_activations(act_type, x, out, n, rows, stream);
  if (n <= 0 || rows <= 0 || n % kQK != 0)
    throw std::invalid_argument("quantize_activations_llama: n=" + std::to_string(n) + ", rows=" +
                                std::to_string(rows) + " (n must be a positive multiple of 32 for " +
                                std::string(type_name(act_type)) + ")");
  const int64_t nblocks = n / kQK * rows;
  const unsigned grid = static_cast<unsigned>((nblocks + kWarpsPerCta - 1) / kWarpsPerCta);
  if (act_type == TensorType::Q8_1) {
    launch_kernel(quantize_q8_1_llama_kernel, dim3(grid), dim3(32 * kWarpsPerCta), 0, stream, x,
                  static_cast<BlockQ8_1*>(out), nblocks);
    return;
  }
  launch_kernel(quantize_q8_0_llama_kernel, dim3(grid), dim3(32 * kWarpsPerCta), 0, stream, x,
                static_cast<BlockQ8_0*>(out), nblocks);
}

}  // namespace moraine::cuda
