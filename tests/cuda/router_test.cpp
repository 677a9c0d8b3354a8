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

#include "common/model/model.h"
#include "common/reference/moe_parts.h"
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

// glm4moe / deepseek v3's sigmoid router (route_sigmoid_group_top_k) against the reference's
// (reference::route_layer, RouterKind::SigmoidGroupTopK, routed_scale included) on random logits.
// The reference's router is an F32 matrix over n_embd = n inputs whose row e holds expert e's
// logit of every token, fed one-hot rows (each dot is the logit exactly). Logits are redrawn until
// the group cut (the topk_group-th against the next group score) and the top k + 1 biased scores
// of the kept groups are clear by 1e-5 (the device sigmoid's expf moves a score by ~3e-7): the
// choice and its order must then match exactly; planted exact ties (expert ne - 1 a copy of
// expert 0, bias included) go to the lower id. Weights within 16 ulp.
struct SigmoidCase {
  int64_t n, ne, k, n_group, topk_group;
  bool renorm, with_bias;
  double scale;
};

bool sigmoid_choice_clear(const float* lt, const std::vector<float>& bias, const SigmoidCase& c) {
  constexpr float kGap = 1e-5f;
  std::vector<float> sel(static_cast<size_t>(c.ne));
  for (int64_t e = 0; e < c.ne; ++e) sel[e] = 1.0f / (1.0f + std::exp(-lt[e])) + (c.with_bias ? bias[e] : 0.0f);
  const int64_t per = c.ne / c.n_group;
  std::vector<char> kept(static_cast<size_t>(c.n_group), 1);
  if (c.n_group > 1) {
    std::vector<float> gs(static_cast<size_t>(c.n_group));
    for (int64_t g = 0; g < c.n_group; ++g) {
      std::vector<float> v(sel.begin() + g * per, sel.begin() + (g + 1) * per);
      std::sort(v.begin(), v.end(), std::greater<>());
      gs[g] = per > 1 ? v[0] + v[1] : v[0];
    }
    std::vector<int64_t> go(static_cast<size_t>(c.n_group));
    std::iota(go.begin(), go.end(), 0);
    std::stable_sort(go.begin(), go.end(), [&](int64_t a, int64_t b) { return gs[a] > gs[b]; });
    if (c.topk_group < c.n_group) {
      const float a = gs[go[c.topk_group - 1]], b = gs[go[c.topk_group]];
      if (a != b && a - b < kGap) return false;
    }
    for (int64_t r = c.topk_group; r < c.n_group; ++r) kept[go[r]] = 0;
  }
  std::vector<float> v;
  for (int64_t e = 0; e < c.ne; ++e)
    if (kept[e / per]) v.push_back(sel[e]);
  std::sort(v.begin(), v.end(), std::greater<>());
  for (int64_t i = 0; i < c.k && i + 1 < static_cast<int64_t>(v.size()); ++i)
    if (v[i] != v[i + 1] && v[i] - v[i + 1] < kGap) return false;
  return true;
}

void check_sigmoid(const SigmoidCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> bias(static_cast<size_t>(c.ne), 0.0f);
  if (c.with_bias)
    for (float& b : bias) b = 0.25f * normal(rng);
  bias[c.ne - 1] = bias[0];   // the planted ties' experts are tied after the bias too
  std::vector<float> logits(static_cast<size_t>(c.n * c.ne));
  for (int64_t t = 0; t < c.n; ++t) {
    float* lt = logits.data() + t * c.ne;
    do {
      for (int64_t e = 0; e < c.ne; ++e) lt[e] = normal(rng);
      if (t % 3 == 0) lt[c.ne - 1] = lt[0];
    } while (!sigmoid_choice_clear(lt, bias, c));
  }
  // The reference: router row e = expert e's logits of tokens 0..n-1, token t's input one-hot at t.
  model::HParams hp;
  hp.n_embd = c.n;
  hp.n_expert = c.ne;
  hp.n_expert_used = c.k;
  std::vector<float> rows(static_cast<size_t>(c.ne * c.n)), h(static_cast<size_t>(c.n * c.n), 0.0f);
  for (int64_t e = 0; e < c.ne; ++e)
    for (int64_t t = 0; t < c.n; ++t) rows[e * c.n + t] = logits[t * c.ne + e];
  for (int64_t t = 0; t < c.n; ++t) h[t * c.n + t] = 1.0f;
  model::MoeWeights W;
  W.router.type = TensorType::F32;
  W.router.n_cols = c.n;
  W.router.n_rows = c.ne;
  W.router.row_bytes = static_cast<size_t>(c.n) * sizeof(float);
  W.router.data = reinterpret_cast<const uint8_t*>(rows.data());
  if (c.with_bias) W.score_bias = bias;
  model::FfnPart part;
  part.router.kind = model::RouterKind::SigmoidGroupTopK;
  part.router.n_group = c.n_group;
  part.router.topk_group = c.topk_group;
  part.router.renormalize = c.renorm;
  part.router.score_bias = c.with_bias;
  part.router.routed_scale = c.scale;
  reference::RouterScratch scratch;
  scratch.reserve(hp, c.n);
  reference::ThreadPool pool(1);
  std::vector<int32_t> want_id(static_cast<size_t>(c.n * c.k));
  std::vector<float> want_w(want_id.size());
  reference::route_layer(hp, part, W, h.data(), c.n, want_id.data(), want_w.data(), scratch, pool);

  cuda::DeviceBuffer<float> dl(logits.size()), db(bias.size()), dw(want_w.size());
  cuda::DeviceBuffer<int32_t> did(want_id.size());
  dl.upload(logits.data(), logits.size());
  db.upload(bias.data(), bias.size());
  dw.fill_bytes(0xff);
  did.fill_bytes(0xff);
  cuda::route_sigmoid_group_top_k(dl.get(), c.with_bias ? db.get() : nullptr, c.n, c.ne, c.k, c.n_group, c.topk_group,
                                  c.renorm, static_cast<float>(c.scale), did.get(), dw.get());
  std::vector<int32_t> got_id(want_id.size());
  std::vector<float> got_w(want_w.size());
  did.download(got_id.data(), got_id.size());
  dw.download(got_w.data(), got_w.size());
  for (size_t i = 0; i < got_id.size(); ++i) {
    ASSERT_EQ(got_id[i], want_id[i]) << "token " << i / c.k << " slot " << i % c.k;
    ASSERT_LE(std::fabs(got_w[i] - want_w[i]), 16 * std::ldexp(1.0, -24) * std::fabs(want_w[i]) + 1e-38)
        << "token " << i / c.k << " slot " << i % c.k << ": got " << got_w[i] << ", reference " << want_w[i];
  }
}

TEST(CudaRouter, SigmoidGroupTopKMatchesReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  uint32_t seed = 21;
  for (const SigmoidCase& c : {
           SigmoidCase{5, 128, 8, 1, 1, true, true, 1.0},     // GLM-4.5-Air
           SigmoidCase{4, 160, 8, 1, 1, true, true, 2.5},     // GLM-4.5
           SigmoidCase{6, 256, 8, 8, 4, true, true, 2.5},     // DeepSeek-V3
           SigmoidCase{7, 12, 2, 4, 1, false, true, 2.5},     // tiny glm4moe:qknorm_groups
           SigmoidCase{33, 36, 5, 6, 2, true, false, 1.0},    // no bias, many tokens
           SigmoidCase{3, 8, 3, 8, 3, true, true, 1.0},       // groups of one expert
           SigmoidCase{2, 8, 8, 1, 1, false, true, 1.0},      // k = n_expert
           SigmoidCase{3, 4096, 8, 64, 8, true, true, 1.0},   // shared memory past 48 KiB
       }) {
    SCOPED_TRACE(std::to_string(c.ne) + " experts, " + std::to_string(c.n_group) + " groups");
    check_sigmoid(c, seed++);
  }
}

// The softmax routers' routed scale (scale_router_weights): one rounded product per weight.
TEST(CudaRouter, ScaleRouterWeightsIsOneProduct) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  std::mt19937 rng(31);
  const std::vector<float> w = cuda_test::random_values(rng, 1000);
  cuda::DeviceBuffer<float> d(w.size());
  d.upload(w.data(), w.size());
  cuda::scale_router_weights(d.get(), static_cast<int64_t>(w.size()), 16.0f / 3.0f);
  std::vector<float> got(w.size());
  d.download(got.data(), got.size());
  for (size_t i = 0; i < w.size(); ++i) ASSERT_EQ(got[i], w[i] * (16.0f / 3.0f)) << i;
}

TEST(CudaRouterArguments, RejectsBadK) {
  EXPECT_THROW(cuda::route_top_k_softmax(nullptr, nullptr, 1, 8, 9, nullptr, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::route_softmax_top_k(nullptr, 1, 8, 9, true, nullptr, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::route_softmax_top_k(nullptr, 1, 8, 0, true, nullptr, nullptr), std::invalid_argument);
  // Groups that do not divide the experts, or that cannot hold k of them.
  EXPECT_THROW(cuda::route_sigmoid_group_top_k(nullptr, nullptr, 1, 12, 2, 5, 1, true, 1.0f, nullptr, nullptr),
               std::invalid_argument);
  EXPECT_THROW(cuda::route_sigmoid_group_top_k(nullptr, nullptr, 1, 12, 4, 4, 1, true, 1.0f, nullptr, nullptr),
               std::invalid_argument);
  EXPECT_THROW(cuda::route_sigmoid_group_top_k(nullptr, nullptr, 1, 12, 2, 4, 5, true, 1.0f, nullptr, nullptr),
               std::invalid_argument);
}

}  // namespace
}  // namespace moraine
