// Asynchronous 16-byte copies from global to shared memory (cp.async, compute capability 8.0+),
// for kernels that stage whole weight rows: a warp can put its entire row in flight at once
// without holding a register per word, so the bytes in flight per SM are bounded by shared
// memory rather than by registers (decode matvecs are latency-bound at a few MB per call).
// Below sm_80 the copy is a plain load and store (no target architecture of the project is
// there; the fallback only keeps other builds compiling).
#pragma once
#include <cuda_runtime.h>

namespace moraine::cuda::async_copy {

// dst (shared) and src (global) 16-byte aligned. The L2-only variant (.cg): the bytes are used
// once from shared memory, so caching them in L1 would only evict the activations.
__device__ __forceinline__ void copy_16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
#else
  *static_cast<uint4*>(dst) = __ldg(static_cast<const uint4*>(src));
#endif
}

// Waits for every copy this thread issued; the copies of other threads need a barrier after it
// (__syncwarp for a warp's own buffer, __syncthreads for a CTA-wide one).
__device__ __forceinline__ void wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

}  // namespace moraine::cuda::async_copy
