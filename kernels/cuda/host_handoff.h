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

#include "kernels/cuda/moe_fused.h"

namespace moraine::cuda {

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
// raised once they are visible to the host: one launch where a flag kernel needed a memcpy node
// per span before it (each a few us in a graph, serialized with the kernels).
void publish_to_host(const HostSpan* spans, int n_spans, uint64_t* flag, const uint64_t* seq_dev,
                     cudaStream_t stream = nullptr);

// The host's answer to one hand-off layer, read by the device itself from mapped host memory
// once the host raised `flag` (>= *seq_dev): map_host [nk] gives, for each routing slot, the row
// of rows_host ([nk][row_floats]) the cpu workers wrote for it, or -1 for a slot computed on the
// device; the map goes to map_dev and only the rows it names go to rows_dev (same row index).
// With `chosen` (device, [nk] expert ids) and `slots` (the layer's device expert table,
// [n_expert]), a step whose chosen experts are all on the device writes map_dev = -1 without
// waiting for the host (which has nothing to send for it). A timeout sets *error_dev = 1 and
// copies nothing (the step is void).
// Why: the copy of the whole [nk][row_floats] block it replaces ended well after the host's flag
// on every hand-off layer, though ~92% of the slots never cross at 12G with Zipf-1 routing
// (Qwen3-30B shape, 12G: decode 193 -> 261 tok/s; docs/perf-log.md).
struct ExpertRowFetch {
  const uint64_t* flag = nullptr;
  const uint64_t* seq_dev = nullptr;
  uint64_t timeout_ns = 0;
  int32_t* error_dev = nullptr;
  const int32_t* map_host = nullptr;   // mapped host memory (device-side address)
  const float* rows_host = nullptr;    // mapped host memory (device-side address)
  int32_t* map_dev = nullptr;
  float* rows_dev = nullptr;
  int nk = 0;
  int row_floats = 0;
  const int32_t* chosen = nullptr;     // optional (with slots): skip the wait when all are on the device
  const MoeExpertSlot* slots = nullptr;
  int n_expert = 0;
};
// Launched programmatically (launch.h): it polls and reads the host while the kernel before it
// still runs, and waits for the grids before it ahead of its first store and before it exits.
// Throws std::invalid_argument for nk < 1, row_floats < 1 or missing pointers.
void fetch_expert_rows(const ExpertRowFetch& f, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
