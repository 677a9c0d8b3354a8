// Sequence-number flags in mapped host memory, for a captured step that hands layers to the host
// and waits for the host's answer without returning to it (the GPU <-> CPU hand-off inside one
// CUDA graph): the device raises `routed` once a layer's routing and h are in host memory, the
// host computes the experts off the device and raises `ready`, the device waits for it and goes
// on. A step's sequence number is read from device memory (seq_dev), so one captured graph
// serves every step.
//
// Memory contract: flags live in host memory the device can address (cudaHostAlloc with
// cudaHostAllocMapped, or registered memory; pass the device-side pointer); seq_dev and
// error_dev are device memory. The host writes `ready` with release semantics after the data it
// guards; the device reads it with acquire semantics at system scope, so the copies that follow
// in the stream see that data.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moraine::cuda {

// flag = *seq_dev, visible to the host once every earlier operation of the stream finished.
void signal_host(uint64_t* flag, const uint64_t* seq_dev, cudaStream_t stream = nullptr);

// Returns (lets the stream go on) once *flag >= *seq_dev. After timeout_ns without that, sets
// *error_dev = 1 and returns anyway: a graph cannot throw, and a host that died must not leave
// the GPU spinning forever; the caller checks error_dev after the step.
void wait_host(const uint64_t* flag, const uint64_t* seq_dev, uint64_t timeout_ns, int32_t* error_dev,
               cudaStream_t stream = nullptr);

// One span of bytes between device memory and mapped host memory (the device-side address of
// host memory registered or allocated mapped: cudaHostGetDevicePointer). bytes: a multiple of 4,
// both addresses 4-byte aligned.
struct HostSpan {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};
inline constexpr int kMaxHostSpans = 3;

// The spans (device -> mapped host memory) written by the device itself, then flag = *seq_dev
// raised once they are visible to the host: one launch where signal_host needs a memcpy node per
// span before it (each a few us in a graph, serialized with the kernels).
void publish_to_host(const HostSpan* spans, int n_spans, uint64_t* flag, const uint64_t* seq_dev,
                     cudaStream_t stream = nullptr);

// wait_host, then the spans (mapped host memory -> device) read by the device itself: one launch
// where wait_host needs a memcpy node per span after it. A timeout sets *error_dev and copies
// nothing (the step is void).
void fetch_from_host(const uint64_t* flag, const uint64_t* seq_dev, uint64_t timeout_ns, int32_t* error_dev,
                     const HostSpan* spans, int n_spans, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
