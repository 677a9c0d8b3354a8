// MoE combine on the GPU (kernels/cuda/moe_combine.h) against moraine::reference::moe_combine.
// Without a shared expert the float additions are the reference's, in its order, each rounded
// once: bit-identical. With a shared expert the gate logit is given (the reference dots h with
// the router itself; here the test passes that same dot, computed in the reference's order), and
// only the device exp in the sigmoid may differ (2 ulp of exp -> at most 4 ulp of the gate), so
// x is within 4 ulp of the gate times |shared| plus one ulp of the result. An ungated shared
// expert (glm4moe: no router row, no gate logit) is added as it is: bit-identical again.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/model/model.h"
#include "common/reference/moe_parts.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/moe_combine.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

enum class Shared { kNone, kGated, kUngated };

void check(int64_t n, int64_t k, int64_t d, Shared kind, uint32_t seed) {
  const bool with_shared = kind != Shared::kNone, gated = kind == Shared::kGated;
  std::mt19937 rng(seed);
  const std::vector<float> x = cuda_test::random_values(rng, static_cast<size_t>(n * d));
  const std::vector<float> slots = cuda_test::random_values(rng, static_cast<size_t>(n * k * d));
  std::uniform_real_distribution<float> w01(0.0f, 1.0f);
  std::vector<float> weight(static_cast<size_t>(n * k));
  for (float& w : weight) w = w01(rng);
  std::normal_distribution<float> small(0.0f, 0.05f);
  std::vector<float> h(static_cast<size_t>(n * d)), shared, router(static_cast<size_t>(d));
  for (float& v : h) v = small(rng);
  for (float& v : router) v = small(rng);
  if (with_shared) shared = cuda_test::random_values(rng, static_cast<size_t>(n * d));

  model::HParams hp;
  hp.n_embd = d;
  hp.n_expert_used = k;
  model::MoeWeights W;
  if (gated) W.shared_router = router;
  std::vector<const float*> rows(static_cast<size_t>(n * k));
  for (int64_t i = 0; i < n * k; ++i) rows[i] = slots.data() + i * d;
  std::vector<float> want = x;
  reference::moe_combine(hp, W, h.data(), n, weight.data(), rows.data(), with_shared ? shared.data() : nullptr,
                         want.data());
  std::vector<float> logit(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    float g = 0.0f;
    for (int64_t i = 0; i < d; ++i) g += h[t * d + i] * router[i];
    logit[t] = g;
  }

  cuda::DeviceBuffer<float> dx(x.size()), ds(slots.size()), dw(weight.size()), dsh(std::max<size_t>(shared.size(), 1)),
      dlog(logit.size());
  dx.upload(x.data(), x.size());
  ds.upload(slots.data(), slots.size());
  dw.upload(weight.data(), weight.size());
  if (with_shared) dsh.upload(shared.data(), shared.size());
  dlog.upload(logit.data(), logit.size());
  cuda::moe_combine(dx.get(), ds.get(), dw.get(), with_shared ? dsh.get() : nullptr, gated ? dlog.get() : nullptr,
                    n, k, d);
  std::vector<float> got(x.size());
  dx.download(got.data(), got.size());
  if (!gated) {
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0);
    return;
  }
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < d; ++i) {
      const size_t j = static_cast<size_t>(t * d + i);
      const double tol = 4 * std::ldexp(1.0, -24) * std::fabs(shared[j]) + std::ldexp(std::fabs(want[j]), -23);
      ASSERT_LE(std::fabs(double(got[j]) - want[j]), tol) << "token " << t << " element " << i;
    }
}

TEST(CudaMoeCombine, MatchesReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check(5, 8, 2048, Shared::kNone, 1);
  check(3, 10, 300, Shared::kGated, 2);
  check(1, 1, 64, Shared::kNone, 3);
  check(4, 8, 4096, Shared::kUngated, 4);   // GLM-4.5-Air's width and top-8
  check(3, 3, 64, Shared::kUngated, 5);
}

TEST(CudaMoeCombineArguments, RejectsAGateWithoutAShared) {
  float dummy = 0;
  EXPECT_THROW(cuda::moe_combine(nullptr, nullptr, nullptr, nullptr, &dummy, 1, 1, 1), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
