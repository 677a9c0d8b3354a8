// kv_store_at (kernels/cuda/kv_store.h): new rows land at the device position, bit for bit, and
// nothing else in the cache changes; through one captured CUDA graph replayed at several
// positions; and a device position outside the cache writes nothing.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/kv_store.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

TEST(CudaKvStore, CopiesRowsToDevicePositionThroughAGraph) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  std::mt19937 rng(1);
  const int64_t rows = 3, row_floats = 4 * 128 + 5, max_pos = 700;  // odd row width on purpose
  const std::vector<float> cache0 = cuda_test::random_values(rng, static_cast<size_t>(max_pos * row_floats));
  cuda::DeviceBuffer<float> dsrc(static_cast<size_t>(rows * row_floats)), dcache(cache0.size());
  cuda::DeviceBuffer<int32_t> dpos(1);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  cuda::kv_store_at(dsrc.get(), dcache.get(), rows, row_floats, dpos.get(), max_pos, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int32_t pos : {0, 1, 255, 500, 697}) {
    for (bool graphed : {false, true}) {
      const std::vector<float> src = cuda_test::random_values(rng, static_cast<size_t>(rows * row_floats));
      dsrc.upload(src.data(), src.size());
      dcache.upload(cache0.data(), cache0.size());
      dpos.upload(&pos, 1);
      if (graphed) {
        // The uploads are pageable copies on the legacy stream, which may still be landing when
        // they return, and the non-blocking stream does not wait for them.
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      } else {
        cuda::kv_store_at(dsrc.get(), dcache.get(), rows, row_floats, dpos.get(), max_pos);
      }
      std::vector<float> got(cache0.size());
      dcache.download(got.data(), got.size());
      std::vector<float> want = cache0;
      std::memcpy(want.data() + pos * row_floats, src.data(), src.size() * 4);
      ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0)
          << "cache differs after a store at " << pos << (graphed ? " (graph)" : "");
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);

  // Past the end or negative: nothing written (compute-sanitizer shows no stray write).
  for (int32_t pos : {698, 1 << 30, -1}) {
    dcache.upload(cache0.data(), cache0.size());
    dpos.upload(&pos, 1);
    cuda::kv_store_at(dsrc.get(), dcache.get(), rows, row_floats, dpos.get(), max_pos);
    std::vector<float> got(cache0.size());
    dcache.download(got.data(), got.size());
    ASSERT_EQ(std::memcmp(got.data(), cache0.data(), got.size() * 4), 0) << "a store at " << pos << " wrote";
  }
}

TEST(CudaKvStoreArguments, RejectsBadCalls) {
  const int32_t* fake = reinterpret_cast<const int32_t*>(16);  // never dereferenced: the checks come first
  EXPECT_THROW(cuda::kv_store_at(nullptr, nullptr, 1, 64, nullptr, 10), std::invalid_argument);  // no position
  EXPECT_THROW(cuda::kv_store_at(nullptr, nullptr, 0, 64, fake, 10), std::invalid_argument);     // no rows
  EXPECT_THROW(cuda::kv_store_at(nullptr, nullptr, 11, 64, fake, 10), std::invalid_argument);    // rows > cache
}

}  // namespace
}  // namespace moraine
