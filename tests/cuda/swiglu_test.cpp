// SwiGLU's elementwise step on the GPU (kernels/cuda/swiglu.h) against silu(g) * u with the
// reference's moraine::reference::silu. The device expf is within 2 ulp of the host's, which
// moves 1 + exp(-g) by at most 2 ulp and the result, after the division and product (each
// correctly rounded), by at most 4 ulp: 8 * 2^-24 * |ref| + FLT_MIN.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "common/reference/ops.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/swiglu.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

TEST(CudaSwiglu, MatchesReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  std::mt19937 rng(1);
  const size_t n = 3 * 768 + 5;
  std::vector<float> g = cuda_test::random_values(rng, n);
  const std::vector<float> u = cuda_test::random_values(rng, n);
  g[0] = 0.0f;
  g[1] = -80.0f;  // exp(-g) overflows towards inf: silu -> -0
  g[2] = 80.0f;
  cuda::DeviceBuffer<float> dg(n), du(n);
  dg.upload(g.data(), n);
  du.upload(u.data(), n);
  cuda::swiglu(dg.get(), du.get(), static_cast<int64_t>(n));
  std::vector<float> got(n);
  dg.download(got.data(), n);
  for (size_t i = 0; i < n; ++i) {
    const float want = reference::silu(g[i]) * u[i];
    const double tol = 8.0 * std::ldexp(1.0, -24) * std::fabs(want) + std::numeric_limits<float>::min();
    ASSERT_LE(std::fabs(double(got[i]) - want), tol) << "element " << i << " g=" << g[i] << ": got " << got[i]
                                                     << ", reference " << want;
  }
}

TEST(CudaSwigluArguments, RejectsNegativeCount) {
  EXPECT_THROW(cuda::swiglu(nullptr, nullptr, -1), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
