// gpu_worker --kernel-trace (gpu_worker/kernel_trace.h): a kernel launched on a stream and the same
// kernel inside a CUDA graph launched twice must come back as rows with the kernel's name, an end
// after the start, graph id 0 for the stream launch and one nonzero graph id shared by the two
// graph launches; the memcpy beside them as a memcpy row with its direction and size. Skips
// without a GPU (CUPTI records nothing without one).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gpu_worker/kernel_trace.h"
#include "kernels/cuda/rms_norm.h"
#include "tests/cuda/cuda_test_support.h"

namespace {

struct Row {
  std::string kind, name;
  unsigned long long start = 0, end = 0, graph = 0;
};

std::vector<Row> read_rows(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::string line;
  std::getline(in, line);   // header
  std::vector<Row> rows;
  while (std::getline(in, line)) {
    std::stringstream ss(line);
    std::string f[9];
    for (std::string& x : f) std::getline(ss, x, ',');
    rows.push_back({f[0], f[1], std::stoull(f[2]), std::stoull(f[3]), std::stoull(f[5])});
  }
  return rows;
}

TEST(KernelTrace, RecordsStreamAndGraphKernelsAndCopies) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const auto path = std::filesystem::temp_directory_path() / "moraine-kernel-trace-test.csv";
  {
    moraine::gpu_worker::KernelTrace trace(path.string(), 1000);
    float *x = nullptr, *y = nullptr;
    ASSERT_EQ(cudaMalloc(&x, 4096 * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&y, 4096 * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMemset(x, 0, 4096 * sizeof(float)), cudaSuccess);
    cudaStream_t s;
    ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
    moraine::cuda::rms_norm(x, nullptr, y, 2048, 2, 1e-6f, s);
    cudaGraph_t g;
    cudaGraphExec_t ge;
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    moraine::cuda::rms_norm(y, nullptr, x, 2048, 2, 1e-6f, s);
    ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&ge, g, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(ge, s), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(ge, s), cudaSuccess);
    std::vector<float> host(4096);
    ASSERT_EQ(cudaMemcpyAsync(host.data(), x, host.size() * sizeof(float), cudaMemcpyDeviceToHost, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaStreamDestroy(s);
    cudaFree(x);
    cudaFree(y);
  }   // the trace flushes and closes here
  const std::vector<Row> rows = read_rows(path);
  int stream_kernels = 0, graph_kernels = 0, copies = 0;
  std::set<unsigned long long> graphs;
  for (const Row& r : rows) {
    EXPECT_GE(r.end, r.start) << r.name;
    if (r.kind == "kernel" && r.name.find("rms_norm") != std::string::npos) {
      if (r.graph == 0) {
        ++stream_kernels;
      } else {
        ++graph_kernels;
        graphs.insert(r.graph);
      }
    }
    if (r.kind == "memcpy" && r.name == "DtoH 16384") ++copies;
  }
  EXPECT_EQ(stream_kernels, 1);
  EXPECT_EQ(graph_kernels, 2);
  EXPECT_EQ(graphs.size(), 1u);
  EXPECT_EQ(copies, 1);
  std::filesystem::remove(path);
}

TEST(KernelTrace, AnUnwritableFileIsAClearError) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  try {
    moraine::gpu_worker::KernelTrace trace("/nonexistent-dir/trace.csv", 10);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/trace.csv"), std::string::npos) << e.what();
  }
}

}  // namespace
