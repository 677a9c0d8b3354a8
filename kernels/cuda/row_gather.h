// Row copies by index on the device, for the expert path that is not fused (moe_fused.h): the
// rows of a step's tokens gathered per expert before the batched matvec, and the expert outputs
// scattered back to their slots. Exact copies.
//   gather_rows:  dst[r] = src[idx[r]]   for r < rows
//   scatter_rows: dst[idx[r]] = src[r]   for r < rows
// Memory contract (device pointers): rows of d floats, packed; idx [rows] int32 >= 0 and inside
// the indexed buffer (the caller builds them from an ExpertPlan it checked).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moraine::cuda {

void gather_rows(const float* src, const int32_t* idx, float* dst, int64_t rows, int64_t d,
                 cudaStream_t stream = nullptr);
void scatter_rows(const float* src, const int32_t* idx, float* dst, int64_t rows, int64_t d,
                  cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
