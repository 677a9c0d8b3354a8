// Per-head RMSNorm on the GPU (kernels/cuda/head_rms_norm.h) against moraine::reference::rms_norm
// applied head by head, from a strided input (a q projection with a gate beside each head) into a
// packed output, and in place on a packed k. Tolerance as tests/cuda/rms_norm_test.cpp (both sum
// squares in double; at most 4 ulp after the float steps): 8 * 2^-24 * |ref| + FLT_MIN.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "common/reference/ops.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/head_rms_norm.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

void check(int64_t rows, int64_t n_heads, int64_t hd, int64_t head_stride, bool in_place, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t row_stride = n_heads * head_stride;
  const std::vector<float> x = cuda_test::random_values(rng, static_cast<size_t>(rows * row_stride));
  const std::vector<float> w = cuda_test::random_values(rng, static_cast<size_t>(hd));
  const float eps = 1e-6f;
  std::vector<float> want(static_cast<size_t>(rows * n_heads * hd));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < n_heads; ++h)
      reference::rms_norm(x.data() + r * row_stride + h * head_stride, w.data(), hd, eps, want.data() + (r * n_heads + h) * hd);
  cuda::DeviceBuffer<float> dx(x.size()), dw(w.size()), dout(want.size());
  dx.upload(x.data(), x.size());
  dw.upload(w.data(), w.size());
  dout.fill_bytes(0xff);
  float* out = in_place ? dx.get() : dout.get();
  cuda::head_rms_norm(dx.get(), row_stride, head_stride, dw.get(), out, rows, n_heads, hd, eps);
  std::vector<float> got(want.size());
  (in_place ? dx : dout).download(got.data(), got.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = 8.0 * std::ldexp(1.0, -24) * std::fabs(want[i]) + std::numeric_limits<float>::min();
    ASSERT_LE(std::fabs(double(got[i]) - want[i]), tol) << "element " << i << ": got " << got[i] << ", reference " << want[i];
  }
}

TEST(CudaHeadRmsNorm, MatchesReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check(5, 8, 128, 128, false, 1);
  check(3, 4, 256, 512, false, 2);  // q with its gate beside each head
  check(6, 2, 128, 128, true, 3);   // k in place
  check(2, 3, 40, 40, false, 4);    // head_dim not a multiple of 32
}

TEST(CudaHeadRmsNormArguments, RejectsBadShape) {
  float w = 1;
  EXPECT_THROW(cuda::head_rms_norm(nullptr, 64, 32, &w, nullptr, 1, 1, 64, 1e-6f), std::invalid_argument);
  EXPECT_THROW(cuda::head_rms_norm(nullptr, 64, 64, nullptr, nullptr, 1, 1, 64, 1e-6f), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
