#include "kernels/cuda/host_handoff.h"

#include "kernels/cuda/cuda_check.h"

namespace moraine::cuda {
namespace {

__global__ void signal_host_kernel(uint64_t* flag, const uint64_t* seq_dev) {
  const uint64_t seq = *seq_dev;
  // Everything the stream wrote before this kernel (the routing copies) is complete: the kernel
  // starts only after them. The fence orders this thread's own earlier writes, none here, and
  // makes the store a system-scope release for the host's acquire load.
  __threadfence_system();
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(seq) : "memory");
}

__device__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void wait_host_kernel(const uint64_t* flag, const uint64_t* seq_dev, uint64_t timeout_ns,
                                 int32_t* error_dev) {
  const uint64_t seq = *seq_dev;
  const uint64_t start = global_ns();
  while (load_acquire_sys(flag) < seq) {
    if (global_ns() - start > timeout_ns) {
      *error_dev = 1;
      break;
    }
    __nanosleep(200);   // one PCIe read per ~0.5 us is enough: the host answers in tens of us
  }
  __threadfence_system();
}

}  // namespace

void signal_host(uint64_t* flag, const uint64_t* seq_dev, cudaStream_t stream) {
  signal_host_kernel<<<1, 1, 0, stream>>>(flag, seq_dev);
  CUDA_CHECK(cudaGetLastError());
}

void wait_host(const uint64_t* flag, const uint64_t* seq_dev, uint64_t timeout_ns, int32_t* error_dev,
               cudaStream_t stream) {
  wait_host_kernel<<<1, 1, 0, stream>>>(flag, seq_dev, timeout_ns, error_dev);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moraine::cuda
