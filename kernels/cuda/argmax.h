// Greedy decode's token on the device: the argmax of each logits row, by the coordinator's rule
// (common/sampling/sampler.h sampling::argmax): the first index holding the largest value; a NaN
// never wins; a row whose element 0 is NaN answers 0 (nothing compares greater than it in the
// host's scan); +0 and -0 are equal (the first of them wins a tie). Only the ids cross to the host
// instead of a 151,936-float row (607 KB) per decode step.
//
// Memory contract (device): logits [rows][n] floats, out [rows] int32. scratch: argmax_scratch_bytes
// (rows) bytes, zeroed once before the first call (cudaMemset); every call leaves it zeroed
// again, so calls on one stream (and in captured graphs) can share it, concurrent calls cannot.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moraine::cuda {

size_t argmax_scratch_bytes(int64_t rows);

// nonfinite (optional, [rows] int32, device or mapped host memory): each row's first non-finite
// logit as index * 2 + 1 for a NaN, index * 2 for an infinity, -1 when the row is finite: what
// moraine-bench's logit check (the coordinator's check_finite) names, without the row crossing.
// Without it (nullptr) the kernel does not look for non-finite logits at all (a second kernel
// instantiation; calls of either kind may share one scratch).
// Throws std::invalid_argument for rows < 1, n < 1 or n >= 2^31 (2^30 with nonfinite).
void argmax_rows(const float* logits, int64_t rows, int64_t n, int32_t* out, void* scratch,
                 cudaStream_t stream = nullptr, int32_t* nonfinite = nullptr);

}  // namespace moraine::cuda
