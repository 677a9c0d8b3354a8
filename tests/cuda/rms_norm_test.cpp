// GPU RMSNorm (kernels/cuda/rms_norm.cu) against moraine::reference::rms_norm.
//
// Tolerance: both take the sum of squares in double (exact products, n additions each within
// 2^-53 relative), so the two sums differ by at most about n * 2^-53 relative and round to the
// same float mean or to a neighbour (1 ulp). The later float steps are the reference's, each
// correctly rounded, so one ulp in the mean moves 1/sqrt by at most 2 ulp and the output, after
// two more roundings, by at most 4 ulp: 8 * 2^-24 * |ref| (an ulp is up to 2^-23 relative), plus
// the smallest normal for denormal outputs.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/reference/ops.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/rms_norm.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

void check_rms_norm(int64_t n, int64_t rows, bool with_weight, bool in_place, uint32_t seed) {
  std::mt19937 rng(seed);
  const std::vector<float> x = cuda_test::random_values(rng, static_cast<size_t>(n * rows));
  const std::vector<float> w = cuda_test::random_values(rng, static_cast<size_t>(n));
  const float eps = 1e-6f;
  std::vector<float> want(x.size());
  for (int64_t r = 0; r < rows; ++r)
    reference::rms_norm(x.data() + r * n, with_weight ? w.data() : nullptr, n, eps, want.data() + r * n);

  cuda::DeviceBuffer<float> dx(x.size()), dw(w.size()), dout(x.size());
  dx.upload(x.data(), x.size());
  dw.upload(w.data(), w.size());
  dout.fill_bytes(0xff);  // NaN poison
  float* out = in_place ? dx.get() : dout.get();
  cuda::rms_norm(dx.get(), with_weight ? dw.get() : nullptr, out, n, rows, eps);
  std::vector<float> got(x.size());
  (in_place ? dx : dout).download(got.data(), got.size());

  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = 8.0 * std::ldexp(1.0, -24) * std::fabs(want[i]) + std::numeric_limits<float>::min();
    ASSERT_TRUE(std::fabs(static_cast<double>(got[i]) - want[i]) <= tol)
        << "n=" << n << " element " << i << ": got " << got[i] << ", reference " << want[i];
  }
}

TEST(CudaRmsNorm, MatchesReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check_rms_norm(4096, 3, true, false, 1);
  check_rms_norm(2047, 5, true, false, 2);  // odd length
  check_rms_norm(128, 33, false, false, 3);
  check_rms_norm(2048, 2, true, true, 4);   // out aliases x
}

TEST(CudaRmsNormArguments, RejectsBadShape) {
  EXPECT_THROW(cuda::rms_norm(nullptr, nullptr, nullptr, 0, 1, 1e-6f), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
