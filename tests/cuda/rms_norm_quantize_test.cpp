// rms_norm_quantize (kernels/cuda/rms_norm_quantize.h) against the unfused pair it replaces,
// rms_norm then quantize_activations_llama, byte for byte (memcmp of h and of the activation
// blocks), on fresh random rows: q8_0 and q8_K, with and without a weight, in place, 1/3/16 rows.
// And moe_combine_rms_norm_quantize against moe_combine_mixed, rms_norm, quantize (x, h and the
// blocks): with and without the shared expert and the cpu workers' rows, q8_0 / q8_K / norm only.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/moe_combine.h"
#include "kernels/cuda/quantize_activations_llama.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/cuda/rms_norm_quantize.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

void check(TensorType act, int64_t n, int64_t rows, bool weighted, bool in_place, uint32_t seed) {
  SCOPED_TRACE(std::string(type_name(act)) + " n=" + std::to_string(n) + " rows=" + std::to_string(rows) +
               (weighted ? " weighted" : " no weight") + (in_place ? " in place" : ""));
  std::mt19937 rng(seed);
  const size_t count = static_cast<size_t>(n * rows);
  const std::vector<float> x = cuda_test::random_values(rng, count);
  const std::vector<float> w = cuda_test::random_values(rng, static_cast<size_t>(n));
  const float eps = 1e-6f;
  const size_t act_bytes = row_bytes(act, n) * static_cast<size_t>(rows);
  cuda::DeviceBuffer<float> dx(count), dw(w.size()), dh_want(count), dh_got(count);
  cuda::DeviceBuffer<uint8_t> da_want(act_bytes), da_got(act_bytes);
  dw.upload(w.data(), w.size());
  const float* wp = weighted ? dw.get() : nullptr;

  // Unfused: rms_norm into h, quantize h.
  dx.upload(x.data(), count);
  dh_want.fill_bytes(0xa5);
  da_want.fill_bytes(0xa5);
  float* h_want = in_place ? dx.get() : dh_want.get();
  cuda::rms_norm(dx.get(), wp, h_want, n, rows, eps);
  cuda::quantize_activations_llama(act, h_want, da_want.get(), n, rows);
  std::vector<float> want_h(count);
  std::vector<uint8_t> want_a(act_bytes);
  (in_place ? dx : dh_want).download(want_h.data(), count);
  da_want.download(want_a.data(), act_bytes);

  // Fused, from the same input, into poisoned outputs.
  dx.upload(x.data(), count);
  dh_got.fill_bytes(0xa5);
  da_got.fill_bytes(0xa5);
  float* h_got = in_place ? dx.get() : dh_got.get();
  cuda::rms_norm_quantize(dx.get(), wp, h_got, act, da_got.get(), n, rows, eps);
  std::vector<float> got_h(count);
  std::vector<uint8_t> got_a(act_bytes);
  (in_place ? dx : dh_got).download(got_h.data(), count);
  da_got.download(got_a.data(), act_bytes);

  for (size_t i = 0; i < count; ++i)
    ASSERT_EQ(std::memcmp(&got_h[i], &want_h[i], 4), 0) << "h[" << i << "]: fused " << got_h[i] << ", unfused " << want_h[i];
  for (size_t i = 0; i < act_bytes; ++i)
    ASSERT_EQ(got_a[i], want_a[i]) << "activation byte " << i << " of " << act_bytes << " (block "
                                   << i / type_traits(act).block_bytes << ")";
}

TEST(CudaRmsNormQuantize, BitIdenticalToRmsNormThenQuantize) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  uint32_t seed = 1;
  for (TensorType act : {TensorType::Q8_0, TensorType::Q8_K})
    for (int64_t rows : {1, 3, 16}) {
      check(act, 2048, rows, true, false, seed++);   // Qwen3-30B-A3B hidden
      check(act, 768, rows, true, false, seed++);    // not a multiple of the 256-thread stride
      check(act, 2048, rows, false, false, seed++);  // no weight
      check(act, 4096, rows, true, true, seed++);    // in place (h aliases x)
    }
  check(TensorType::Q8_0, 32, 5, true, false, seed++);    // one block per row, 7 idle warps
  check(TensorType::Q8_K, 256, 5, true, false, seed++);
  check(TensorType::Q8_0, 5120, 2, true, false, seed++);
}

// Rows of zeros: a zero sum of squares and all-zero blocks (the quantizers' zero-scale paths).
TEST(CudaRmsNormQuantize, ZeroRowsBitIdentical) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  for (TensorType act : {TensorType::Q8_0, TensorType::Q8_K}) {
    const int64_t n = 512, rows = 2;
    const std::vector<float> zeros(static_cast<size_t>(n * rows), 0.0f);
    cuda::DeviceBuffer<float> dx(zeros.size()), dh1(zeros.size()), dh2(zeros.size());
    const size_t ab = row_bytes(act, n) * rows;
    cuda::DeviceBuffer<uint8_t> a1(ab), a2(ab);
    dx.upload(zeros.data(), zeros.size());
    for (auto* b : {&a1, &a2}) b->fill_bytes(0x5a);
    cuda::rms_norm(dx.get(), nullptr, dh1.get(), n, rows, 1e-6f);
    cuda::quantize_activations_llama(act, dh1.get(), a1.get(), n, rows);
    cuda::rms_norm_quantize(dx.get(), nullptr, dh2.get(), act, a2.get(), n, rows, 1e-6f);
    std::vector<uint8_t> b1(ab), b2(ab);
    a1.download(b1.data(), ab);
    a2.download(b2.data(), ab);
    EXPECT_EQ(std::memcmp(b1.data(), b2.data(), ab), 0) << type_name(act);
  }
}

struct CombineCase {
  TensorType act;  // F32: norm only (no activation output)
  int64_t n, k, d;
  bool shared, host_rows;
};

void check_combine(const CombineCase& c, uint32_t seed) {
  const bool quant = c.act != TensorType::F32;
  SCOPED_TRACE(std::string(quant ? type_name(c.act) : "norm only") + " n=" + std::to_string(c.n) + " k=" +
               std::to_string(c.k) + " d=" + std::to_string(c.d) + (c.shared ? " shared" : "") +
               (c.host_rows ? " host rows" : ""));
  std::mt19937 rng(seed);
  const int64_t slots_n = c.n * c.k;
  const std::vector<float> x = cuda_test::random_values(rng, static_cast<size_t>(c.n * c.d));
  const std::vector<float> slots = cuda_test::random_values(rng, static_cast<size_t>(slots_n * c.d));
  const std::vector<float> host = cuda_test::random_values(rng, static_cast<size_t>(slots_n * c.d));
  const std::vector<float> weight = cuda_test::normal_values(rng, static_cast<size_t>(slots_n), 0.3f);
  const std::vector<float> shared = cuda_test::random_values(rng, static_cast<size_t>(c.n * c.d));
  const std::vector<float> gate = cuda_test::normal_values(rng, static_cast<size_t>(c.n), 2.0f);
  const std::vector<float> norm_w = cuda_test::random_values(rng, static_cast<size_t>(c.d));
  std::vector<int32_t> host_of(static_cast<size_t>(slots_n));
  for (int64_t s = 0; s < slots_n; ++s) host_of[s] = s % 3 == 1 ? static_cast<int32_t>((s * 7) % slots_n) : -1;
  const auto dev = [](const auto& v) {
    cuda::DeviceBuffer<std::decay_t<decltype(v[0])>> b(v.size());
    b.upload(v.data(), v.size());
    return b;
  };
  auto dslots = dev(slots), dhost = dev(host), dweight = dev(weight), dshared = dev(shared), dgate = dev(gate),
       dnorm = dev(norm_w);
  auto dhost_of = dev(host_of);
  const float* hr = c.host_rows ? dhost.get() : nullptr;
  const int32_t* hof = c.host_rows ? dhost_of.get() : nullptr;
  const float* sh = c.shared ? dshared.get() : nullptr;
  const float* g = c.shared ? dgate.get() : nullptr;
  const size_t count = x.size(), ab = quant ? row_bytes(c.act, c.d) * static_cast<size_t>(c.n) : 1;
  const float eps = 1e-6f;

  cuda::DeviceBuffer<float> x1 = dev(x), h1(count);
  cuda::DeviceBuffer<uint8_t> a1(ab);
  h1.fill_bytes(0xa5);
  a1.fill_bytes(0xa5);
  cuda::moe_combine_mixed(x1.get(), dslots.get(), hr, hof, dweight.get(), sh, g, c.n, c.k, c.d);
  cuda::rms_norm(x1.get(), dnorm.get(), h1.get(), c.d, c.n, eps);
  if (quant) cuda::quantize_activations_llama(c.act, h1.get(), a1.get(), c.d, c.n);

  cuda::DeviceBuffer<float> x2 = dev(x), h2(count);
  cuda::DeviceBuffer<uint8_t> a2(ab);
  h2.fill_bytes(0xa5);
  a2.fill_bytes(0xa5);
  cuda::moe_combine_rms_norm_quantize(x2.get(), dslots.get(), hr, hof, dweight.get(), sh, g, c.n, c.k, c.d,
                                      dnorm.get(), h2.get(), c.act, quant ? a2.get() : nullptr, eps);

  std::vector<float> want_x(count), got_x(count), want_h(count), got_h(count);
  std::vector<uint8_t> want_a(ab), got_a(ab);
  x1.download(want_x.data(), count);
  x2.download(got_x.data(), count);
  h1.download(want_h.data(), count);
  h2.download(got_h.data(), count);
  a1.download(want_a.data(), ab);
  a2.download(got_a.data(), ab);
  for (size_t i = 0; i < count; ++i) {
    ASSERT_EQ(std::memcmp(&got_x[i], &want_x[i], 4), 0) << "x[" << i << "]: fused " << got_x[i] << ", unfused " << want_x[i];
    ASSERT_EQ(std::memcmp(&got_h[i], &want_h[i], 4), 0) << "h[" << i << "]: fused " << got_h[i] << ", unfused " << want_h[i];
  }
  ASSERT_EQ(std::memcmp(got_a.data(), want_a.data(), ab), 0) << "activation blocks";
}

TEST(CudaMoeCombineRmsNormQuantize, BitIdenticalToCombineThenNormThenQuantize) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  uint32_t seed = 50;
  for (int64_t n : {1, 3, 16}) {
    check_combine({TensorType::Q8_0, n, 8, 2048, false, false}, seed++);  // Qwen3-30B-A3B
    check_combine({TensorType::Q8_0, n, 8, 2048, true, true}, seed++);    // shared expert, cpu rows
    check_combine({TensorType::Q8_K, n, 10, 2048, true, false}, seed++);
    check_combine({TensorType::F32, n, 8, 2048, false, true}, seed++);  // norm only
  }
  check_combine({TensorType::Q8_0, 2, 4, 5120, true, false}, seed++);     // past the register cache
  check_combine({TensorType::F32, 2, 4, 1000, false, false}, seed++);   // norm only, any width
}

// Argument checks come before any CUDA call, so this runs without a device too.
TEST(CudaRmsNormQuantizeArguments, RejectsBadShapes) {
  float f = 0;
  EXPECT_THROW(cuda::rms_norm_quantize(&f, nullptr, &f, TensorType::Q4_K, &f, 256, 1, 1e-6f), std::invalid_argument);
  EXPECT_THROW(cuda::rms_norm_quantize(&f, nullptr, &f, TensorType::Q8_0, &f, 48, 1, 1e-6f), std::invalid_argument);
  EXPECT_THROW(cuda::rms_norm_quantize(&f, nullptr, &f, TensorType::Q8_K, &f, 128, 1, 1e-6f), std::invalid_argument);
  EXPECT_THROW(cuda::rms_norm_quantize(&f, nullptr, &f, TensorType::Q8_0, &f, 64, 0, 1e-6f), std::invalid_argument);
  EXPECT_THROW(cuda::rms_norm_quantize(&f, nullptr, nullptr, TensorType::Q8_0, &f, 64, 1, 1e-6f), std::invalid_argument);
  int32_t i = 0;
  EXPECT_THROW(cuda::moe_combine_rms_norm_quantize(&f, &f, &f, nullptr, &f, nullptr, nullptr, 1, 8, 64, &f, &f,
                                                   TensorType::Q8_0, &f, 1e-6f),
               std::invalid_argument);  // host rows without their index
  EXPECT_THROW(cuda::moe_combine_rms_norm_quantize(&f, &f, nullptr, nullptr, &f, &f, nullptr, 1, 8, 64, &f, &f,
                                                   TensorType::Q8_0, &f, 1e-6f),
               std::invalid_argument);  // shared expert without its gate
  EXPECT_THROW(cuda::moe_combine_rms_norm_quantize(&f, &f, &f, &i, &f, nullptr, nullptr, 1, 8, 48, &f, &f,
                                                   TensorType::Q8_0, &f, 1e-6f),
               std::invalid_argument);  // d not a multiple of 32
}

}  // namespace
}  // namespace moraine
