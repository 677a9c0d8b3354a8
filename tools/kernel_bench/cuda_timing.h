// Device time of a repeated call for the CUDA kernel benches: fn(i) (i counting calls) after two
// warm-up calls, repeated until at least min_ms of device time between two events on the legacy
// stream; the call count grows by the measured shortfall. Milliseconds per call.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/cuda_check.h"

namespace moraine::kernel_bench {

template <class Fn>
double ms_per_call(Fn&& fn, double min_ms) {
  for (int i = 0; i < 2; ++i) fn(i);
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  int calls = 2;
  double per = 0.0;
  for (;;) {
    CUDA_CHECK(cudaEventRecord(a));
    for (int i = 0; i < calls; ++i) fn(i);
    CUDA_CHECK(cudaEventRecord(b));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    per = ms / calls;
    if (ms >= min_ms || calls >= (1 << 20)) break;
    calls = static_cast<int>(std::min<double>(1 << 20, calls * std::max(2.0, 1.2 * min_ms / std::max<double>(ms, 1e-3))));
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return per;
}

}  // namespace moraine::kernel_bench
