#include "kernels/cuda/row_gather.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"

namespace moraine::cuda {
namespace {

// One CTA row per (row, 256-float chunk): rows are a few KB, so a 2-D grid keeps every copy
// coalesced without a loop.
template <bool kGather>
__global__ void row_copy_kernel(const float* __restrict__ src, const int32_t* __restrict__ idx,
                                float* __restrict__ dst, int64_t d) {
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t r = blockIdx.y;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= d) return;
  const int64_t j = idx[r];
  if (kGather) {
    dst[r * d + i] = src[j * d + i];
  } else {
    dst[j * d + i] = src[r * d + i];
  }
}

template <bool kGather>
void launch(const float* src, const int32_t* idx, float* dst, int64_t rows, int64_t d, cudaStream_t stream) {
  if (rows < 0 || rows > 65535 || d <= 0)
    throw std::invalid_argument(std::string(kGather ? "gather_rows" : "scatter_rows") + ": rows=" +
                                std::to_string(rows) + ", d=" + std::to_string(d) + " (need rows in 0..65535, d > 0)");
  if (rows == 0) return;
  constexpr int kThreads = 256;
  const dim3 grid(static_cast<unsigned>((d + kThreads - 1) / kThreads), static_cast<unsigned>(rows));
  launch_kernel(row_copy_kernel<kGather>, grid, dim3(kThreads), 0, stream, src, idx, dst, d);
}

}  // namespace

void gather_rows(const float* src, const int32_t* idx, float* dst, int64_t rows, int64_t d, cudaStream_t stream) {
  launch<true>(src, idx, dst, rows, d, stream);
}
void scatter_rows(const float* src, const int32_t* idx, float* dst, int64_t rows, int64_t d, cudaStream_t stream) {
  launch<false>(src, idx, dst, rows, d, stream);
}

}  // namespace moraine::cuda
