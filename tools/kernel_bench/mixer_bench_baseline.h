// The pre-change versions of the kernels mixer_bench.h measures (see mixer_bench_baseline.cu),
// launched plainly (no programmatic dependent launch) on the given stream.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/qk_norm_rope_store.h"

namespace moraine::kernel_bench::baseline {

void matvec_f32(const float* w, int64_t rows, int64_t n, const float* x, float* y, cudaStream_t stream);
void route(const float* logits, int64_t n, int64_t ne, int64_t k, bool renorm, int32_t* chosen, float* weight,
           cudaStream_t stream);
void qk_norm_rope_store(const cuda::QkNormRopeStoreArgs& a, cudaStream_t stream);

}  // namespace moraine::kernel_bench::baseline
