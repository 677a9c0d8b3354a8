// NEOX RoPE on the GPU (kernels/cuda/rope.h) against moraine::reference::rope_neox, with partial
// rotary (n_rot < head_dim: the tail must stay untouched), heads strided inside a wider row, and
// positions far from zero. Tolerance: theta, cos and sin are double on both sides, so the float
// c and s agree unless a double differing in its last bit rounds across a float boundary (then
// by one float ulp, 2^-24 relative); the rotation is the same two products and one sum each
// rounded to nearest: one ulp in c or s moves the exact result by <= 2^-24 * (|x0| + |x1|), and the
// final rounding may then go the other way (one ulp of the result, <= 2^-23 * (|x0| + |x1|)), so
// |got - want| <= 2^-22 * (|x0| + |x1|).
#include <gtest/gtest.h>

#include <cmath>
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

TEST(CudaRopeArguments, RejectsBadShape) {
  EXPECT_THROW(cuda::rope_neox(nullptr, 1, 1, 64, 64, 63, 0, 1e4), std::invalid_argument);   // odd n_rot
  EXPECT_THROW(cuda::rope_neox(nullptr, 1, 1, 64, 32, 64, 0, 1e4), std::invalid_argument);   // n_rot > stride
  EXPECT_THROW(cuda::rope_neox(nullptr, 1, 1, 64, 64, 64, -1, 1e4), std::invalid_argument);  // negative position
}

}  // namespace
}  // namespace moraine
