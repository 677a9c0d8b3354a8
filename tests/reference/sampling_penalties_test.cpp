// The sampler's min-p cut, repetition penalties and log-probabilities against a direct reading
// of their definitions (llama.cpp's sampler and OpenAI's API docs), computed here in doubles.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "common/sampling/sampler.h"

namespace moraine::sampling {
namespace {

std::vector<float> random_logits(uint64_t seed, size_t n) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<float> l(n);
  for (float& x : l) x = d(rng);
  return l;
}

// llama.cpp's order: the min-p cut on the softmax at temperature 1 (keep p_i >= min_p * p_max),
// then the softmax at temperature t over what is kept.
std::map<int32_t, double> min_p_reference(const std::vector<float>& l, float t, float min_p) {
  std::vector<double> p1(l.size());
  double z1 = 0;
  for (size_t i = 0; i < l.size(); ++i) z1 += p1[i] = std::exp(double(l[i]));
  const double pmax = *std::max_element(p1.begin(), p1.end()) / z1;
  std::map<int32_t, double> kept;
  double mass = 0;
  for (size_t i = 0; i < l.size(); ++i) {
    if (p1[i] / z1 >= min_p * pmax) {
      const double w = std::exp(l[i] / double(t));
      kept[static_cast<int32_t>(i)] = w;
      mass += w;
    }
  }
  for (auto& [id, q] : kept) q /= mass;
  return kept;
}

TEST(SamplerMinP, DistributionMatchesDefinition) {
  for (uint64_t seed : {1u, 2u, 3u}) {
    const std::vector<float> l = random_logits(seed, 500);
    for (float t : {0.5f, 1.0f, 1.7f}) {
      for (float mp : {0.01f, 0.1f, 0.5f}) {
        const auto want = min_p_reference(l, t, mp);
        Sampler s({t, 0, 1.0f, seed, mp});
        const auto got = s.distribution(l);
        ASSERT_EQ(got.size(), want.size()) << "t " << t << " min_p " << mp;
        for (const auto& [id, q] : got) {
          ASSERT_TRUE(want.count(id)) << id;
          EXPECT_NEAR(q, want.at(id), 1e-6) << id;
        }
      }
    }
  }
}

TEST(SamplerMinP, SampledTokensAreAlwaysKept) {
  const std::vector<float> l = random_logits(9, 300);
  const auto want = min_p_reference(l, 1.0f, 0.2f);
  Sampler s({1.0f, 0, 1.0f, 42, 0.2f});
  for (int i = 0; i < 2000; ++i) EXPECT_TRUE(want.count(s.sample(l)));
}

TEST(SamplerMinP, CombinesWithTopK) {
  const std::vector<float> l = random_logits(5, 400);
  // top-k 10 then min-p 0.3 of the top token's probability at temperature 1.
  Sampler s({0.8f, 10, 1.0f, 1, 0.3f});
  const auto got = s.distribution(l);
  std::vector<int32_t> ids(l.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
  size_t n = 0;
  for (size_t i = 0; i < 10; ++i) n += std::exp(double(l[ids[i]]) - l[ids[0]]) >= 0.3 ? 1 : 0;
  EXPECT_EQ(got.size(), n);
  EXPECT_GT(n, 0u);
}

TEST(SamplerMinP, RejectsOutOfRange) {
  EXPECT_THROW(Sampler({1.0f, 0, 1.0f, 0, -0.1f}), std::invalid_argument);
  EXPECT_THROW(Sampler({1.0f, 0, 1.0f, 0, 1.5f}), std::invalid_argument);
}

TEST(Penalties, MatchReferenceFormula) {
  const std::vector<float> base = random_logits(11, 64);
  const std::vector<int32_t> history = {3, 5, 3, 7, 3, 5, 63, 1000, -1, 9, 9};
  for (PenaltyParams p : {PenaltyParams{1.3f, 0.0f, 0.0f, 64}, PenaltyParams{1.0f, 0.4f, 0.0f, 64},
                          PenaltyParams{1.0f, 0.0f, 0.7f, 64}, PenaltyParams{1.1f, 0.25f, 0.5f, 64},
                          PenaltyParams{1.2f, 0.3f, 0.1f, 4}}) {
    std::vector<float> got = base;
    apply_penalties(got, history, p);
    // Reference: count each in-vocabulary token of the last last_n, then the formula per token.
    std::map<int32_t, int> count;
    const size_t from = history.size() > static_cast<size_t>(p.last_n) ? history.size() - p.last_n : 0;
    for (size_t i = from; i < history.size(); ++i)
      if (history[i] >= 0 && history[i] < 64) ++count[history[i]];
    for (int32_t id = 0; id < 64; ++id) {
      double want = base[id];
      if (count.count(id)) {
        want = want > 0 ? want / p.repeat : want * p.repeat;
        want -= count[id] * p.frequency + p.presence;
      }
      EXPECT_NEAR(got[id], want, 1e-5) << "token " << id;
    }
  }
}

TEST(Penalties, OffLeavesLogitsAlone) {
  const std::vector<float> base = random_logits(12, 32);
  std::vector<float> got = base;
  apply_penalties(got, std::vector<int32_t>{1, 2, 3}, PenaltyParams{});
  EXPECT_EQ(got, base);
  EXPECT_FALSE(PenaltyParams{}.active());
  EXPECT_FALSE((PenaltyParams{0.0f, 0.0f, 0.0f, 64}.active()));
}

TEST(LogSoftmaxTest, MatchesDirectFormula) {
  const std::vector<float> l = random_logits(13, 1000);
  double z = 0;
  for (float x : l) z += std::exp(double(x));
  const LogSoftmax ls(l);
  for (int32_t id : {0, 17, 999}) EXPECT_NEAR(ls(id), l[id] - std::log(z), 1e-5);
  const auto top = ls.top(5);
  ASSERT_EQ(top.size(), 5u);
  std::vector<int32_t> ids(l.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(top[i].first, ids[i]);
    EXPECT_NEAR(top[i].second, l[ids[i]] - std::log(z), 1e-5);
  }
}

}  // namespace
}  // namespace moraine::sampling
