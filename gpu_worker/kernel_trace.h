// gpu_worker --kernel-trace FILE: every kernel, memcpy and memset the process runs on the device,
// with its start and end on the GPU's clock, written as CSV (one row per activity) through CUPTI's
// activity API. It answers what ncu (kernels one at a time, serialised) and the Stats stages (host
// wall time) cannot: how long each kernel of a decode graph takes in the chain and how long the
// device idles between kernels and between steps. The H200 machine has no Nsight Systems.
//
// CUPTI is loaded with dlopen only when a trace is asked for (libcupti.so.13, then libcupti.so, from
// the library path or beside the CUDA runtime), so the gpu_worker needs no CUPTI to run. Rows:
//   kind,name,start_ns,end_ns,stream,graph_id,graph_node_id,grid,block
// kind is kernel, memcpy or memset; a memcpy's name is its direction and bytes ("HtoD 4"); grid
// and block are the launch's x*y*z (0 for copies); graph_id 0 outside graphs. Rows come in the
// order CUPTI hands its buffers over (sort by start_ns). bench/kernel-trace-summary reads them.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

namespace moraine::gpu_worker {

class KernelTrace {
 public:
  // Starts recording (call before the first CUDA work of interest). Throws std::runtime_error
  // naming what is missing (the file cannot be opened, no CUPTI library, a CUPTI call failed).
  // At most max_rows rows are written; later activities are counted as dropped.
  KernelTrace(const std::string& path, uint64_t max_rows);
  ~KernelTrace();   // flushes what CUPTI still holds and closes the file
  KernelTrace(const KernelTrace&) = delete;
  KernelTrace& operator=(const KernelTrace&) = delete;

  uint64_t rows() const;
  uint64_t dropped() const;

  struct State;   // CUPTI entry points, the file and the counters (kernel_trace.cpp)

 private:
  std::unique_ptr<State> s_;
};

}  // namespace moraine::gpu_worker
