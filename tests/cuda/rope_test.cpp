// NEOX RoPE on the GPU (kernels/cuda/rope.h) against moraine::reference::rope_neox, with partial
// rotary (n_rot < head_dim: the tail must stay untouched), heads strided inside a wider row, and
// positions far from zero. Tolerance: theta, cos and sin are double on both sides, so the float
// c and s agree unless a double differing in its last bit rounds across a float boundary (then
// by one float ulp, 2^-24 relative); the rotation is the same two products and one sum each
// rounded to nearest: one ulp in c or s moves the exact result by <= 2^-24 * (|x0| + |x1|), and the
// final rounding may then go the other way (one ulp of the result, <= 2^-23 * (|x0| + |x1|)), so
// |got - want| <= 2^-22 * (|x0| + |x1|). The device-position variant (rope_neox_at) must give
// rope_neox's very bits, directly and through a captured CUDA graph.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/reference/ops.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/rope.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

void check(int64_t rows, int64_t n_heads, int64_t hd, int64_t head_stride, int64_t n_rot, int64_t pos0, double base,
           uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t row_stride = n_heads * head_stride + 3;  // rows need not be packed
  const std::vector<float> x = cuda_test::random_values(rng, static_cast<size_t>(rows * row_stride));
  std::vector<float> want = x;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < n_heads; ++h) reference::rope_neox(want.data() + r * row_stride + h * head_stride, n_rot, pos0 + r, base);
  cuda::DeviceBuffer<float> dx(x.size());
  dx.upload(x.data(), x.size());
  cuda::rope_neox(dx.get(), rows, n_heads, row_stride, head_stride, n_rot, pos0, base);
  std::vector<float> got(x.size());
  dx.download(got.data(), got.size());
  const int64_t half = n_rot / 2;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < n_heads; ++h) {
      const int64_t o = r * row_stride + h * head_stride;
      for (int64_t i = 0; i < head_stride; ++i) {
        double tol = 0;
        if (i < n_rot) {
          const int64_t j = i < half ? i : i - half;
          tol = std::ldexp(std::fabs(x[o + j]) + std::fabs(x[o + j + half]), -22);
        }
        ASSERT_LE(std::fabs(double(got[o + i]) - want[o + i]), tol)
            << "row " << r << " head " << h << " dim " << i << ": got " << got[o + i] << ", reference " << want[o + i];
      }
    }
  }
  // The gaps between rows are left alone.
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = n_heads * head_stride; i < row_stride; ++i) ASSERT_EQ(got[r * row_stride + i], x[r * row_stride + i]);
}

TEST(CudaRope, MatchesReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check(5, 4, 128, 128, 128, 0, 1e6, 1);          // full rotary, qwen3moe-like
  check(3, 2, 256, 512, 64, 1000, 1e7, 2);        // partial rotary (qwen3next: 64 of 256), gate beside
  check(7, 3, 64, 64, 32, 123456, 10000.0, 3);    // far positions
}

// rope_neox_at (position from device memory, for CUDA graphs) gives the very bits of rope_neox at
// the same position, including through one captured graph replayed at several positions.
TEST(CudaRope, DevicePositionVariantBitIdentical) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  std::mt19937 rng(4);
  const int64_t rows = 3, n_heads = 4, hd = 256, n_rot = 64, row_stride = n_heads * hd;
  const std::vector<float> x = cuda_test::random_values(rng, static_cast<size_t>(rows * row_stride));
  cuda::DeviceBuffer<float> da(x.size()), db(x.size());
  cuda::DeviceBuffer<int32_t> dpos(1);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  cuda::rope_neox_at(db.get(), rows, n_heads, row_stride, hd, n_rot, dpos.get(), 1e7, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int32_t pos : {0, 1, 255, 4097, 262000}) {
    std::vector<float> want(x.size()), plain(x.size()), graphed(x.size());
    da.upload(x.data(), x.size());
    cuda::rope_neox(da.get(), rows, n_heads, row_stride, hd, n_rot, pos, 1e7);
    da.download(want.data(), want.size());
    dpos.upload(&pos, 1);
    db.upload(x.data(), x.size());
    cuda::rope_neox_at(db.get(), rows, n_heads, row_stride, hd, n_rot, dpos.get(), 1e7);
    db.download(plain.data(), plain.size());
    db.upload(x.data(), x.size());
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    db.download(graphed.data(), graphed.size());
    EXPECT_EQ(std::memcmp(plain.data(), want.data(), want.size() * 4), 0) << "rope_neox_at differs at pos " << pos;
    EXPECT_EQ(std::memcmp(graphed.data(), want.data(), want.size() * 4), 0) << "graph replay differs at pos " << pos;
    if (pos != 0) {
      EXPECT_NE(std::memcmp(want.data(), x.data(), x.size() * 4), 0) << "nothing rotated at pos " << pos;
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  // A negative device position cannot throw from a graph: the rotated dims turn NaN, the rest stays.
  const int32_t bad = -3;
  dpos.upload(&bad, 1);
  db.upload(x.data(), x.size());
  cuda::rope_neox_at(db.get(), rows, n_heads, row_stride, hd, n_rot, dpos.get(), 1e7);
  std::vector<float> got(x.size());
  db.download(got.data(), got.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (static_cast<int64_t>(i) % hd < n_rot) {
      ASSERT_TRUE(std::isnan(got[i])) << "element " << i;
    } else {
      ASSERT_EQ(got[i], x[i]) << "element " << i;
    }
  }
}

TEST(CudaRopeArguments, RejectsBadShape) {
  EXPECT_THROW(cuda::rope_neox(nullptr, 1, 1, 64, 64, 63, 0, 1e4), std::invalid_argument);   // odd n_rot
  EXPECT_THROW(cuda::rope_neox(nullptr, 1, 1, 64, 32, 64, 0, 1e4), std::invalid_argument);   // n_rot > stride
  EXPECT_THROW(cuda::rope_neox(nullptr, 1, 1, 64, 64, 64, -1, 1e4), std::invalid_argument);  // negative position
  EXPECT_THROW(cuda::rope_neox_at(nullptr, 1, 1, 64, 64, 64, nullptr, 1e4), std::invalid_argument);  // no position
  const int32_t* fake = reinterpret_cast<const int32_t*>(16);  // never dereferenced: the checks come first
  EXPECT_THROW(cuda::rope_neox_at(nullptr, 1, 1, 64, 64, 63, fake, 1e4), std::invalid_argument);  // odd n_rot
}

}  // namespace
}  // namespace moraine
