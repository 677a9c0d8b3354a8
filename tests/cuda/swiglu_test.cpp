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

// The routed experts' activation of the per-expert (prefill) path, swiglu_experts: rows of n_ff of
// scattered experts, gpt-oss's biases and clamped SwiGLU against reference::biased_expert's steps
// (g + bg, u + bu, min / clamp at 7, g sigmoid(1.702 g) (u + 1)); the same 8 ulp as above for the
// expf, plus one more product rounded on both sides: 10 ulp. Plain SwiGLU with biases, and the down
// bias (add_expert_bias, one rounded add: exact).
TEST(CudaSwiglu, ExpertsBiasesAndClampMatchReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  std::mt19937 rng(2);
  const int64_t rows = 37, ff = 96, n_expert = 5, d = 64;
  const std::vector<float> g = cuda_test::normal_values(rng, static_cast<size_t>(rows * ff), 6.0f);
  const std::vector<float> u = cuda_test::normal_values(rng, static_cast<size_t>(rows * ff), 6.0f);
  const std::vector<float> bg = cuda_test::normal_values(rng, static_cast<size_t>(n_expert * ff), 3.0f);
  const std::vector<float> bu = cuda_test::normal_values(rng, static_cast<size_t>(n_expert * ff), 3.0f);
  const std::vector<float> y = cuda_test::normal_values(rng, static_cast<size_t>(rows * d), 1.0f);
  const std::vector<float> bd = cuda_test::normal_values(rng, static_cast<size_t>(n_expert * d), 1.0f);
  std::vector<int32_t> expert(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) expert[r] = static_cast<int32_t>((r * 7 + 3) % n_expert);
  cuda::DeviceBuffer<float> dg(g.size()), du(u.size()), dbg(bg.size()), dbu(bu.size()), dy(y.size()), dbd(bd.size());
  cuda::DeviceBuffer<int32_t> de(expert.size());
  du.upload(u.data(), u.size());
  dbg.upload(bg.data(), bg.size());
  dbu.upload(bu.data(), bu.size());
  dbd.upload(bd.data(), bd.size());
  de.upload(expert.data(), expert.size());
  for (const bool clamped : {true, false}) {
    dg.upload(g.data(), g.size());
    cuda::swiglu_experts(dg.get(), du.get(), rows, ff, de.get(), dbg.get(), dbu.get(), clamped, 1.702f, 7.0f);
    std::vector<float> got(g.size());
    dg.download(got.data(), got.size());
    int clipped = 0;
    for (int64_t i = 0; i < rows * ff; ++i) {
      const int64_t b = expert[i / ff] * ff + i % ff;
      float gi = g[i] + bg[b], ui = u[i] + bu[b];
      float want;
      if (clamped) {
        clipped += gi > 7.0f || std::fabs(ui) > 7.0f;
        gi = std::fmin(gi, 7.0f);
        ui = std::fmax(-7.0f, std::fmin(ui, 7.0f));
        want = gi * reference::sigmoid(1.702f * gi) * (ui + 1.0f);
      } else {
        want = reference::silu(gi) * ui;
      }
      const double tol = 10.0 * std::ldexp(1.0, -24) * std::fabs(want) + std::numeric_limits<float>::min();
      ASSERT_LE(std::fabs(double(got[i]) - want), tol) << (clamped ? "clamped" : "plain") << " element " << i << ": got "
                                                       << got[i] << ", reference " << want;
    }
    if (clamped) EXPECT_GT(clipped, rows * ff / 10) << "the inputs hardly reach the clamp";
  }
  dy.upload(y.data(), y.size());
  cuda::add_expert_bias(dy.get(), rows, d, de.get(), dbd.get());
  std::vector<float> got(y.size());
  dy.download(got.data(), got.size());
  for (int64_t i = 0; i < rows * d; ++i) ASSERT_EQ(got[i], y[i] + bd[expert[i / d] * d + i % d]) << "element " << i;
}

TEST(CudaSwigluArguments, RejectsNegativeCount) {
  EXPECT_THROW(cuda::swiglu(nullptr, nullptr, -1), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
