// GPU activation quantization (kernels/cuda/quantize_activations.cu) must give exactly the
// bytes of the scalar reference quantize_row (common/formats/quant.h) for Q8_0, Q8_1 and Q8_K.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "common/formats/block_layouts.h"
#include "common/formats/quant.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/quantize_activations.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

void expect_same_bytes_as_reference(TensorType type, int64_t n, int64_t rows, uint32_t seed,
                                    bool with_zero_block) {
  std::mt19937 rng(seed);
  std::vector<float> x = cuda_test::random_values(rng, static_cast<size_t>(n * rows));
  if (with_zero_block) std::fill(x.begin() + 256, x.begin() + 512, 0.0f);  // the all-zero path
  // Ties of magnitude with opposite signs: the reference keeps the first one.
  x[5] = 1000.0f;
  x[9] = -1000.0f;
  const size_t bytes = row_bytes(type, n) * static_cast<size_t>(rows);
  std::vector<uint8_t> want(bytes);
  for (int64_t r = 0; r < rows; ++r)
    quantize_row(type, x.data() + r * n, want.data() + r * row_bytes(type, n), n);

  cuda::DeviceBuffer<float> dx(x.size());
  dx.upload(x.data(), x.size());
  cuda::DeviceBuffer<uint8_t> dq(bytes);
  dq.fill_bytes(0xa5);
  cuda::quantize_activations(type, dx.get(), dq.get(), n, rows);
  std::vector<uint8_t> got(bytes);
  dq.download(got.data(), bytes);

  const size_t block_bytes = type_traits(type).block_bytes;
  for (size_t b = 0; b < bytes / block_bytes; ++b) {
    ASSERT_EQ(0, std::memcmp(got.data() + b * block_bytes, want.data() + b * block_bytes, block_bytes))
        << type_name(type) << " block " << b << " of " << bytes / block_bytes << " differs (n=" << n
        << ", rows=" << rows << ")";
  }
}

TEST(CudaQuantizeActivations, Q8_0MatchesReferenceBytes) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  expect_same_bytes_as_reference(TensorType::Q8_0, 4096, 3, 11, false);
  expect_same_bytes_as_reference(TensorType::Q8_0, 96, 7, 12, true);
}

// Q8_1 (the activations of Q4_1 / Q5_1): Q8_0's quants plus s = fp16(d * sum q), in its bytes.
TEST(CudaQuantizeActivations, Q8_1MatchesReferenceBytes) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  expect_same_bytes_as_reference(TensorType::Q8_1, 4096, 3, 31, false);
  expect_same_bytes_as_reference(TensorType::Q8_1, 96, 7, 32, true);
}

TEST(CudaQuantizeActivations, Q8_KMatchesReferenceBytes) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  expect_same_bytes_as_reference(TensorType::Q8_K, 4096, 3, 21, false);
  expect_same_bytes_as_reference(TensorType::Q8_K, 768, 5, 22, true);
}

// Argument checks come before any CUDA call, so this runs without a device too.
TEST(CudaQuantizeActivations, RejectsBadArguments) {
  EXPECT_THROW(cuda::quantize_activations(TensorType::Q4_K, nullptr, nullptr, 256, 1), std::invalid_argument);
  EXPECT_THROW(cuda::quantize_activations(TensorType::Q8_K, nullptr, nullptr, 100, 1), std::invalid_argument);
  EXPECT_THROW(cuda::quantize_activations(TensorType::Q8_0, nullptr, nullptr, 64, 0), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
