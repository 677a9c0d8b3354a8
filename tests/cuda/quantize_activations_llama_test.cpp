// GPU activation quantization with llama.cpp's x86 rule (kernels/cuda/quantize_activations_llama.h)
// against the CPU executor's own quantizer (cpu::quantize_activation_row_llama_x86): the bytes
// must be identical, since the point of the rule is that both backends round every activation
// the same way. Inputs include exact ties (x * 127 / amax = k + 0.5), where the two rules differ.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "common/formats/tensor_type.h"
#include "kernels/cpu/vec_dot.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/quantize_activations_llama.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

void check(TensorType t, int64_t n, int64_t rows, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> x = cuda_test::random_values(rng, static_cast<size_t>(n * rows));
  // Plant ties: in some 32-blocks, amax 127 and a value 2.5 (x * 127 / amax = 2.5 exactly).
  for (size_t b = 0; b + 32 <= x.size(); b += 32 * 5) {
    for (size_t i = b; i < b + 32; ++i) x[i] = std::ldexp(x[i], -8) > 1.0f ? 1.0f : std::ldexp(x[i], -8);
    x[b] = 127.0f;
    x[b + 1] = 2.5f;
    x[b + 2] = -3.5f;
  }
  const size_t rb = row_bytes(t, n);
  std::vector<uint8_t> want(rb * static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) cpu::quantize_activation_row_llama_x86(t, x.data() + r * n, want.data() + r * rb, n);
  cuda::DeviceBuffer<float> dx(x.size());
  dx.upload(x.data(), x.size());
  cuda::DeviceBuffer<uint8_t> dout(want.size());
  dout.fill_bytes(0xff);
  cuda::quantize_activations_llama(t, dx.get(), dout.get(), n, rows);
  std::vector<uint8_t> got(want.size());
  dout.download(got.data(), got.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(got[i], want[i]) << type_name(t) << " n=" << n << ": first differing byte " << i;
}

TEST(CudaQuantizeActivationsLlama, BytesEqualTheCpuExecutors) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check(TensorType::Q8_0, 2048, 3, 1);
  check(TensorType::Q8_0, 96, 17, 2);
  check(TensorType::Q8_K, 2048, 3, 3);
  check(TensorType::Q8_K, 768, 5, 4);
  check(TensorType::Q8_1, 2048, 3, 5);  // Q4_1 / Q5_1 activations: Q8_0's quants and s
  check(TensorType::Q8_1, 96, 17, 6);
}

TEST(CudaQuantizeActivationsLlamaArguments, RejectsBadShape) {
  EXPECT_THROW(cuda::quantize_activations_llama(TensorType::Q8_0, nullptr, nullptr, 33, 1), std::invalid_argument);
  EXPECT_THROW(cuda::quantize_activations_llama(TensorType::F16, nullptr, nullptr, 32, 1), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
