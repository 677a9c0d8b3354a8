#include "kernels/cuda/host_handoff.h"

#include <algorithm>
#include <stdexcept>
#include <string>

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

struct Spans {
  HostSpan s[kMaxHostSpans];
  int n;
};

// 4-byte words, consecutive per warp: the stores to host memory coalesce into 128-byte writes
// (posted over PCIe: no round trip each). One CTA: a decode step's spans are a few KB per row.
__global__ void publish_kernel(Spans spans, uint64_t* flag, const uint64_t* seq_dev) {
  for (int i = 0; i < spans.n; ++i) {
    const auto* src = static_cast<const uint32_t*>(spans.s[i].src);
    auto* dst = static_cast<volatile uint32_t*>(spans.s[i].dst);
    const size_t words = spans.s[i].bytes / 4;
    for (size_t w = threadIdx.x; w < words; w += blockDim.x) dst[w] = src[w];
  }
  __threadfence_system();   // this thread's stores reach the host before the barrier releases thread 0
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint64_t seq = *seq_dev;
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(seq) : "memory");
  }
}

// Every CTA polls the flag (thread 0, acquire at system scope), then copies its share of the
// spans with loads that bypass the caches (the host wrote them after the device last looked).
__global__ void fetch_kernel(const uint64_t* flag, const uint64_t* seq_dev, uint64_t timeout_ns, int32_t* error_dev,
                             Spans spans) {
  __shared__ int timed_out;
  if (threadIdx.x == 0) {
    const uint64_t seq = *seq_dev;
    const uint64_t start = global_ns();
    timed_out = 0;
    while (load_acquire_sys(flag) < seq) {
      if (global_ns() - start > timeout_ns) {
        *error_dev = 1;
        timed_out = 1;
        break;
      }
      __nanosleep(100);
    }
  }
  __syncthreads();
  if (timed_out) return;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (int i = 0; i < spans.n; ++i) {
    const auto* src = static_cast<const uint32_t*>(spans.s[i].src);
    auto* dst = static_cast<uint32_t*>(spans.s[i].dst);
    const size_t words = spans.s[i].bytes / 4;
    for (size_t w = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; w < words; w += stride) dst[w] = __ldcv(src + w);
  }
}

Spans to_spans(const HostSpan* spans, int n_spans, const char* what) {
  if (n_spans < 0 || n_spans > kMaxHostSpans) throw std::invalid_argument(std::string(what) + ": at most 3 spans");
  Spans s{};
  s.n = n_spans;
  for (int i = 0; i < n_spans; ++i) {
    const HostSpan& h = spans[i];
    if (h.bytes % 4 != 0 || reinterpret_cast<uintptr_t>(h.dst) % 4 != 0 || reinterpret_cast<uintptr_t>(h.src) % 4 != 0)
      throw std::invalid_argument(std::string(what) + ": span " + std::to_string(i) + " is not in whole 4-byte words");
    s.s[i] = h;
  }
  return s;
}

}  // namespace

void publish_to_host(const HostSpan* spans, int n_spans, uint64_t* flag, const uint64_t* seq_dev, cudaStream_t stream) {
  publish_kernel<<<1, 512, 0, stream>>>(to_spans(spans, n_spans, "publish_to_host"), flag, seq_dev);
  CUDA_CHECK(cudaGetLastError());
}

void fetch_from_host(const uint64_t* flag, const uint64_t* seq_dev, uint64_t timeout_ns, int32_t* error_dev,
                     const HostSpan* spans, int n_spans, cudaStream_t stream) {
  const Spans s = to_spans(spans, n_spans, "fetch_from_host");
  size_t words = 0;
  for (int i = 0; i < s.n; ++i) words = std::max(words, s.s[i].bytes / 4);
  // Reads from host memory are round trips over PCIe: many CTAs keep many in flight (64 KB per
  // decoded row of 8 slots). At least one CTA, so a wait with nothing to copy still waits.
  const int ctas = static_cast<int>(std::clamp<size_t>((words + 1023) / 1024, 1, 64));
  fetch_kernel<<<ctas, 256, 0, stream>>>(flag, seq_dev, timeout_ns, error_dev, s);
  CUDA_CHECK(cudaGetLastError());
}

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
