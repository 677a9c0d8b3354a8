#include "kernels/cuda/host_handoff.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"

namespace moraine::cuda {
namespace {

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

struct Spans {
  HostSpan s[kMaxHostSpans];
  int n;
};

// Consecutive per warp, 16-byte words where both ends allow (4-byte otherwise): the stores to
// host memory coalesce into 128-byte writes (posted over PCIe: no round trip each). One CTA: a
// decode step's spans are a few KB per row. Launched programmatically (launch.h): the launch
// overlaps the router kernel before it, whose outputs it waits for before reading them.
__global__ void publish_kernel(Spans spans, uint64_t* flag, const uint64_t* seq_dev) {
  wait_for_prior_grids();
  for (int i = 0; i < spans.n; ++i) {
    const size_t bytes = spans.s[i].bytes;
    if (bytes % 16 == 0 && reinterpret_cast<uintptr_t>(spans.s[i].src) % 16 == 0 &&
        reinterpret_cast<uintptr_t>(spans.s[i].dst) % 16 == 0) {
      const auto* src = static_cast<const uint4*>(spans.s[i].src);
      auto* dst = static_cast<uint4*>(spans.s[i].dst);   // ordered by the fence below, as the 4-byte path
      for (size_t w = threadIdx.x; w < bytes / 16; w += blockDim.x) dst[w] = src[w];
      continue;
    }
    const auto* src = static_cast<const uint32_t*>(spans.s[i].src);
    auto* dst = static_cast<volatile uint32_t*>(spans.s[i].dst);
    for (size_t w = threadIdx.x; w < bytes / 4; w += blockDim.x) dst[w] = src[w];
  }
  __threadfence_system();   // this thread's stores reach the host before the barrier releases thread 0
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint64_t seq = *seq_dev;
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(seq) : "memory");
  }
}

// One CTA per routing slot. Thread 0 decides whether the host has anything for this step (some
// chosen expert off the device), polls the flag if so (acquire, system scope), then reads the
// slot's map entry; the CTA copies the row it names with 16-byte loads that bypass the caches
// (the host wrote them after the device last looked), every load of a thread issued before its
// stores so the PCIe round trips overlap.
__device__ bool host_has_rows(const ExpertRowFetch& f) {
  if (f.chosen == nullptr || f.slots == nullptr) return true;
  for (int i = 0; i < f.nk; ++i) {
    const int e = f.chosen[i];
    if (e < 0 || e >= f.n_expert || f.slots[e].gate == nullptr) return true;
  }
  return false;
}

constexpr int kFetchThreads = 256;
constexpr int kFetchLoads = 4;   // 16-byte loads in flight per thread: 16 KB per CTA pass

__global__ void __launch_bounds__(kFetchThreads) fetch_expert_rows_kernel(ExpertRowFetch f) {
  __shared__ int row;   // -2: timed out, -1: nothing for this slot, else the row to copy
  if (threadIdx.x == 0) {
    int r = -1;
    if (host_has_rows(f)) {
      const uint64_t seq = *f.seq_dev;
      const uint64_t start = global_ns();
      while (load_acquire_sys(f.flag) < seq) {
        if (global_ns() - start > f.timeout_ns) {
          r = -2;
          break;
        }
        __nanosleep(100);
      }
      if (r != -2) r = __ldcv(f.map_host + blockIdx.x);
    }
    row = r;
  }
  __syncthreads();
  const int r = row;
  if (r == -2) {   // the step is void; nothing is stored but the error flag
    wait_for_prior_grids();
    if (threadIdx.x == 0 && blockIdx.x == 0) *f.error_dev = 1;
    return;
  }
  const float* src = f.rows_host + static_cast<size_t>(r < 0 ? 0 : r) * f.row_floats;
  float* dst = f.rows_dev + static_cast<size_t>(r < 0 ? 0 : r) * f.row_floats;
  const bool vec = f.row_floats % 4 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  const int n4 = vec ? f.row_floats / 4 : 0;
  uint4 v[kFetchLoads];
  // The first pass's loads before the wait for the grids before this one: they touch only host
  // memory, and the wait covers the stores into map_dev / rows_dev (read by the combine of the
  // layer before, which completed before those grids).
  const int first = kFetchLoads * kFetchThreads;
#pragma unroll
  for (int u = 0; u < kFetchLoads; ++u) {
    const int i = u * kFetchThreads + threadIdx.x;
    if (r >= 0 && i < n4) v[u] = __ldcv(reinterpret_cast<const uint4*>(src) + i);
  }
  wait_for_prior_grids();
  if (threadIdx.x == 0) f.map_dev[blockIdx.x] = r;
  if (r < 0) return;
  for (int base = 0; base < n4; base += first) {
    if (base > 0) {
#pragma unroll
      for (int u = 0; u < kFetchLoads; ++u) {
        const int i = base + u * kFetchThreads + threadIdx.x;
        if (i < n4) v[u] = __ldcv(reinterpret_cast<const uint4*>(src) + i);
      }
    }
#pragma unroll
    for (int u = 0; u < kFetchLoads; ++u) {
      const int i = base + u * kFetchThreads + threadIdx.x;
      if (i < n4) reinterpret_cast<uint4*>(dst)[i] = v[u];
    }
  }
  for (int i = 4 * n4 + threadIdx.x; i < f.row_floats; i += kFetchThreads) dst[i] = __ldcv(src + i);
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
  launch_kernel(publish_kernel, dim3(1), dim3(512), 0, stream, to_spans(spans, n_spans, "publish_to_host"), flag, seq_dev);
}

void fetch_expert_rows(const ExpertRowFetch& f, cudaStream_t stream) {
  if (f.nk < 1 || f.row_floats < 1)
    throw std::invalid_argument("fetch_expert_rows: " + std::to_string(f.nk) + " slots of " +
                                std::to_string(f.row_floats) + " floats");
  if (f.flag == nullptr || f.seq_dev == nullptr || f.error_dev == nullptr || f.map_host == nullptr ||
      f.rows_host == nullptr || f.map_dev == nullptr || f.rows_dev == nullptr || (f.chosen != nullptr && f.slots == nullptr))
    throw std::invalid_argument("fetch_expert_rows: a null pointer among the flag, sequence, error, map, rows or expert table");
  launch_kernel(fetch_expert_rows_kernel, dim3(static_cast<unsigned>(f.nk)), dim3(kFetchThreads), 0, stream, f);
}

}  // namespace moraine::cuda
