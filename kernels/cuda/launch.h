// Kernel launches with programmatic dependent launch (PDL, compute capability 9.0+), shared by
// the decode step's kernels. A decode layer is ~11 dependent kernels of a few microseconds each;
// between two plain launches in a graph the GPU drains the first grid, flushes its memory and
// only then launches the next (~1 us per edge). With the PDL attribute the next grid is launched
// as soon as every CTA of the running one has called allow_dependent_grids() (or exited), and its
// CTAs wait in wait_for_prior_grids() for the full completion and memory of the running grid:
// the launch latency overlaps the running kernel instead of following it.
//
// Contract for a kernel launched through launch_kernel: every thread calls wait_for_prior_grids()
// before it touches global memory a predecessor may write or read (simplest: first statement,
// before any early return). That makes completion transitive: a kernel that waited completes
// only after its predecessor completed, so a plain launch, a memcpy or an event after it still
// sees everything before it. allow_dependent_grids() may come anywhere (the dependent still
// waits for this grid's completion): it only decides how early the next launch starts.
// Memcpy, memset, host-function and event nodes keep full dependencies in a stream and in a
// captured graph; the relaxation is between two kernels only (tests/cuda/pdl_chain_test.cpp
// checks the captured edges and the bits).
// Always on where the device has it: a 30B decode layer's 11 small kernels 33.8 -> 31.8 us on the
// H200 (docs/perf-log.md). Tests and benches that compare with plain launches turn a captured
// graph's programmatic edges into full ones (tools/kernel_bench/plain_graph.h).
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "kernels/cuda/cuda_check.h"

namespace moraine::cuda {

// Whether the current device takes the PDL attribute: compute capability 9.0 or more (a
// detection, queried once per device, then cached).
bool programmatic_launch_supported();

// kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute when
// programmatic_launch_supported(), checked.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = programmatic_launch_supported() ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

#ifdef __CUDACC__
// Device side. Both are no-ops in a grid launched without the attribute, and compile to nothing
// below sm_90 (the griddepcontrol instructions do not exist there; the attribute is never set on
// such devices, so their launches serialise as plain ones).

// Blocks until every grid this one depends on programmatically has completed and its memory
// operations are visible.
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// This CTA no longer holds back the launch of the next grid in the stream.
__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
#endif  // __CUDACC__

}  // namespace moraine::cuda
