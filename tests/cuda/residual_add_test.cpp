// Residual add on the GPU (kernels/cuda/residual_add.h): one correctly rounded float addition
// per element, so the result equals the host's x + y bit for bit.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/residual_add.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

TEST(CudaResidualAdd, BitIdenticalToHostAddition) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  std::mt19937 rng(1);
  const size_t n = 5 * 2048 + 17;
  const std::vector<float> x = cuda_test::random_values(rng, n), y = cuda_test::random_values(rng, n);
  std::vector<float> want(n);
  for (size_t i = 0; i < n; ++i) want[i] = x[i] + y[i];
  cuda::DeviceBuffer<float> dx(n), dy(n);
  dx.upload(x.data(), n);
  dy.upload(y.data(), n);
  cuda::residual_add(dx.get(), dy.get(), static_cast<int64_t>(n));
  std::vector<float> got(n);
  dx.download(got.data(), n);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), n * 4), 0);
}

TEST(CudaResidualAddArguments, RejectsNegativeCount) {
  EXPECT_THROW(cuda::residual_add(nullptr, nullptr, -1), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
