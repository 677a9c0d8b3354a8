// Softmax top-k router on the GPU (kernels/cuda/router.h) against a host loop with the
// reference's procedure (moraine::reference::route_top_k: softmax, top-k by probability with
// ties to the lower id, weights renormalised over the k or not). Logits are drawn so that no two
// probabilities near the k-th are within 1e-4 of each other, so the choice is not a last-bit tie
// and must match exactly; weights within 16 ulp (device exp and the order of the softmax sum).
// Planted exact ties (equal logits) must go to the lower id.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/router.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

void check(int64_t n, int64_t ne, int64_t k, bool renorm, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(static_cast<size_t>(n * ne));
  for (int64_t t = 0; t < n; ++t) {
    float* lt = logits.data() + t * ne;
    for (;;) {  // redraw until the order is clear (except planted ties)
      for (int64_t e = 0; e < ne; ++e) lt[e] = normal(rng);
      if (t % 3 == 0) lt[ne - 1] = lt[0];  // an exact tie: expert 0 must win it
      std::vector<float> sorted(lt, lt + ne);
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      bool clear = true;
      for (int64_t i = 0; i + 1 < ne && i <= k; ++i)
        if (sorted[i] != sorted[i + 1] && sorted[i] - sorted[i + 1] < 1e-4f) clear = false;
      if (clear) break;
    }
  }
  std::vector<int32_t> want_id(static_cast<size_t>(n * k));
  std::vector<double> want_w(static_cast<size_t>(n * k));
  for (int64_t t = 0; t < n; ++t) {
    const float* lt = logits.data() + t * ne;
    const double mx = *std::max_element(lt, lt + ne);
    std::vector<double> p(ne);
    double sum = 0;
    for (int64_t e = 0; e < ne; ++e) sum += (p[e] = std::exp(lt[e] - mx));
    for (double& v : p) v /= sum;
    std::vector<int64_t> order(ne);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lt[a] > lt[b]; });
    double wsum = 0;
    for (int64_t s = 0; s < k; ++s) wsum += p[order[s]];
    for (int64_t s = 0; s < k; ++s) {
      want_id[t * k + s] = static_cast<int32_t>(order[s]);
      want_w[t * k + s] = renorm ? p[order[s]] / wsum : p[order[s]];
    }
  }
  cuda::DeviceBuffer<float> dl(logits.size()), dw(want_w.size());
  cuda::DeviceBuffer<int32_t> did(want_id.size());
  dl.upload(logits.data(), logits.size());
  dw.fill_bytes(0xff);
  did.fill_bytes(0xff);
  cuda::route_softmax_top_k(dl.get(), n, ne, k, renorm, did.get(), dw.get());
  std::vector<int32_t> got_id(want_id.size());
  std::vector<float> got_w(want_w.size());
  did.download(got_id.data(), got_id.size());
  dw.download(got_w.data(), got_w.size());
  for (size_t i = 0; i < got_id.size(); ++i) {
    ASSERT_EQ(got_id[i], want_id[i]) << "token " << i / k << " slot " << i % k;
    ASSERT_LE(std::fabs(got_w[i] - want_w[i]), 16 * std::ldexp(1.0, -24) * want_w[i] + 1e-38)
        << "token " << i / k << " slot " << i % k << ": got " << got_w[i] << ", exact " << want_w[i];
  }
}

TEST(CudaRouter, SoftmaxTopKMatchesHostLoop) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check(5, 128, 8, true, 1);     // qwen3moe-like
  check(3, 512, 10, false, 2);   // qwen3next-like, plain probabilities
  check(33, 37, 5, true, 3);     // odd expert count, many tokens
  check(2, 8, 8, true, 4);       // k = n_expert
}

// gpt-oss's router (route_top_k_softmax) against a host loop of reference::route_top_k_softmax's
// procedure in float: l = logit + bias, the k largest l (ties to the lower id), softmax over those
// k in slot order. Biased logits are redrawn until no two near the k-th are within 1e-4 (the
// choice must then match exactly; planted exact ties go to the lower id); weights within 16 ulp
// (device expf against std::exp, both on the same float differences).
void check_topk_softmax(int64_t n, int64_t ne, int64_t k, bool with_bias, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(static_cast<size_t>(n * ne)), bias(static_cast<size_t>(ne), 0.0f);
  if (with_bias)
    for (float& b : bias) b = normal(rng);
  for (int64_t t = 0; t < n; ++t) {
    float* lt = logits.data() + t * ne;
    for (;;) {
      for (int64_t e = 0; e < ne; ++e) lt[e] = normal(rng);
      if (t % 3 == 0) lt[ne - 1] = lt[0] + bias[0] - bias[ne - 1];   // biased tie, maybe (float rounding)
      std::vector<float> sorted(static_cast<size_t>(ne));
      for (int64_t e = 0; e < ne; ++e) sorted[e] = lt[e] + bias[e];
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      bool clear = true;
      for (int64_t i = 0; i + 1 < ne && i <= k; ++i)
        if (sorted[i] != sorted[i + 1] && sorted[i] - sorted[i + 1] < 1e-4f) clear = false;
      if (clear) break;
    }
  }
  std::vector<int32_t> want_id(static_cast<size_t>(n * k));
  std::vector<float> want_w(static_cast<size_t>(n * k));
  for (int64_t t = 0; t < n; ++t) {
    std::vector<float> l(static_cast<size_t>(ne));
    for (int64_t e = 0; e < ne; ++e) l[e] = logits[t * ne + e] + bias[e];
    std::vector<int64_t> order(ne);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return l[a] > l[b]; });
    float sum = 0.0f;
    for (int64_t s = 0; s < k; ++s) sum += (want_w[t * k + s] = std::exp(l[order[s]] - l[order[0]]));
    for (int64_t s = 0; s < k; ++s) {
      want_id[t * k + s] = static_cast<int32_t>(order[s]);
      want_w[t * k + s] /= sum;
    }
  }
  cuda::DeviceBuffer<float> dl(logits.size()), db(bias.size()), dw(want_w.size());
  cuda::DeviceBuffer<int32_t> did(want_id.size());
  dl.upload(logits.data(), logits.size());
  db.upload(bias.data(), bias.size());
  dw.fill_bytes(0xff);
  did.fill_bytes(0xff);
  cuda::route_top_k_softmax(dl.get(), with_bias ? db.get() : nullptr, n, ne, k, did.get(), dw.get());
  std::vector<int32_t> got_id(want_id.size());
  std::vector<float> got_w(want_w.size());
  did.download(got_id.data(), got_id.size());
  dw.download(got_w.data(), got_w.size());
  for (size_t i = 0; i < got_id.size(); ++i) {
    ASSERT_EQ(got_id[i], want_id[i]) << "token " << i / k << " slot " << i % k;
    ASSERT_LE(std::fabs(got_w[i] - want_w[i]), 16 * std::ldexp(1.0, -24) * want_w[i] + 1e-38)
        << "token " << i / k << " slot " << i % k << ": got " << got_w[i] << ", host " << want_w[i];
  }
}

TEST(CudaRouter, TopKSoftmaxMatchesHostLoop) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check_topk_softmax(5, 32, 4, true, 11);     // gpt-oss-20b
  check_topk_softmax(3, 128, 4, true, 12);    // gpt-oss-120b
  check_topk_softmax(33, 37, 5, false, 13);   // no bias, odd expert count, many tokens
  check_topk_softmax(2, 8, 8, true, 14);      // k = n_expert
  check_topk_softmax(4, 8, 2, true, 15);      // gpt-oss-tiny
}

TEST(CudaRouterArguments, RejectsBadK) {
  EXPECT_THROW(cuda::route_top_k_softmax(nullptr, nullptr, 1, 8, 9, nullptr, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::route_softmax_top_k(nullptr, 1, 8, 9, true, nullptr, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::route_softmax_top_k(nullptr, 1, 8, 0, true, nullptr, nullptr), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
