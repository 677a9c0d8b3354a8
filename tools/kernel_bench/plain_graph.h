// The plain side of a comparison with programmatic dependent launch (kernels/cuda/launch.h), for
// the benches and tests that measure or check both: production launches with the PDL attribute
// wherever the device has it, and a captured graph's kernel-to-kernel edges are then
// programmatic. make_edges_full turns each into a full dependency: the graph a device without
// PDL captures from the same launches (the kernels' wait_for_prior_grids is a no-op there).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/cuda/cuda_check.h"

namespace moraine::kernel_bench {

// Every programmatic edge of `graph` replaced by a full (default) one; returns how many.
inline int64_t make_edges_full(cudaGraph_t graph) {
  size_t n = 0;
  CUDA_CHECK(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &n));
  std::vector<cudaGraphNode_t> from(n), to(n);
  std::vector<cudaGraphEdgeData> data(n);
  CUDA_CHECK(cudaGraphGetEdges(graph, from.data(), to.data(), data.data(), &n));
  std::vector<cudaGraphNode_t> pf, pt;
  std::vector<cudaGraphEdgeData> pd;
  for (size_t i = 0; i < n; ++i) {
    if (data[i].type != cudaGraphDependencyTypeProgrammatic) continue;
    pf.push_back(from[i]);
    pt.push_back(to[i]);
    pd.push_back(data[i]);
  }
  if (pf.empty()) return 0;
  CUDA_CHECK(cudaGraphRemoveDependencies(graph, pf.data(), pt.data(), pd.data(), pf.size()));
  CUDA_CHECK(cudaGraphAddDependencies(graph, pf.data(), pt.data(), nullptr, pf.size()));
  return static_cast<int64_t>(pf.size());
}

// enqueue(stream) captured on a stream of its own, its edges made full, launched once and waited
// for: plain launches of production's kernels (e.g. for a profiler that takes them one by one).
template <class Enqueue>
void run_plain(Enqueue&& enqueue) {
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  enqueue(s);
  CUDA_CHECK(cudaStreamEndCapture(s, &g));
  make_edges_full(g);
  cudaGraphExec_t ge;
  CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  CUDA_CHECK(cudaGraphLaunch(ge, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  CUDA_CHECK(cudaGraphExecDestroy(ge));
  CUDA_CHECK(cudaGraphDestroy(g));
  CUDA_CHECK(cudaStreamDestroy(s));
}

}  // namespace moraine::kernel_bench
