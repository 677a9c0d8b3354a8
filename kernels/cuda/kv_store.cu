#include "kernels/cuda/kv_store.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"

namespace moraine::cuda {
namespace {

// One thread per float of the new rows; the destination position is read on the device, so the
// same captured launch serves every step.
__global__ void kv_store_kernel(const float* __restrict__ src, float* __restrict__ cache, int64_t rows,
                                int64_t row_floats, const int32_t* __restrict__ pos0_dev, int64_t max_pos) {
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * row_floats) return;
  const int64_t pos0 = *pos0_dev;
  if (pos0 < 0 || pos0 + rows > max_pos) return;  // out of the cache: write nothing (see the header)
  cache[pos0 * row_floats + idx] = src[idx];
}

}  // namespace

void kv_store_at(const float* src, float* cache, int64_t rows, int64_t row_floats, const int32_t* pos0_dev,
                 int64_t max_pos, cudaStream_t stream) {
  if (rows <= 0 || row_floats <= 0 || max_pos < rows || pos0_dev == nullptr)
    throw std::invalid_argument("kv_store_at: rows=" + std::to_string(rows) + ", row_floats=" +
                                std::to_string(row_floats) + ", max_pos=" + std::to_string(max_pos) +
                                (pos0_dev == nullptr ? ", pos0_dev null" : "") +
                                " (need positive rows and row_floats, max_pos >= rows, a position pointer)");
  const int64_t total = rows * row_floats;
  constexpr int kThreads = 256;
  launch_kernel(kv_store_kernel, dim3(static_cast<unsigned>((total + kThreads - 1) / kThreads)), dim3(kThreads), 0, stream,
                src, cache, rows, row_floats, pos0_dev, max_pos);
}

}  // namespace moraine::cuda
