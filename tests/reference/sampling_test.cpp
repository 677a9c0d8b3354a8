// Sampler: the distribution it reports against direct formulas, and the frequencies it draws
// against that distribution (200k draws, each token within 5 sigma).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
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

// Expected probabilities by a direct reading of the definitions.
std::map<int32_t, double> expected(const std::vector<float>& l, float temp, int top_k, float top_p) {
  std::vector<int32_t> ids(l.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
  if (top_k > 0) ids.resize(std::min<size_t>(ids.size(), top_k));
  std::vector<double> p;
  double z = 0;
  for (int32_t id : ids) z += std::exp(l[id] / double(temp));
  for (int32_t id : ids) p.push_back(std::exp(l[id] / double(temp)) / z);
  size_t n = ids.size();
  double cum = 0;
  for (size_t i = 0; i < ids.size() && top_p < 1.0f; ++i) {
    cum += p[i];
    if (cum >= top_p) {
      n = i + 1;
      break;
    }
  }
  double kept = std::accumulate(p.begin(), p.begin() + n, 0.0);
  std::map<int32_t, double> out;
  for (size_t i = 0; i < n; ++i) out[ids[i]] = p[i] / kept;
  return out;
}

TEST(Sampling, ArgmaxTakesLowestIndexOnTies) {
  EXPECT_EQ(argmax(std::vector<float>{1, 3, 3, 2}), 1);
  auto l = random_logits(3, 500);
  EXPECT_EQ(argmax(l), std::max_element(l.begin(), l.end()) - l.begin());
  Sampler greedy({0.0f, 5, 0.5f, 9});
  EXPECT_EQ(greedy.sample(l), argmax(l));
}

// The vectorised argmax against the definition (first index of the strict maximum, scanning
// left to right; a NaN never compares greater) on lengths around its 16-wide lanes and the real
// vocabulary size, with the maximum repeated inside one lane, across lanes and in the tail, and
// with NaN and infinities.
int32_t argmax_by_definition(const std::vector<float>& l) {
  int32_t best = 0;
  for (size_t i = 1; i < l.size(); ++i)
    if (l[i] > l[best]) best = static_cast<int32_t>(i);
  return best;
}

TEST(Sampling, ArgmaxEqualsTheDefinitionOnEveryShape) {
  std::mt19937_64 rng(11);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (size_t n : {1, 2, 15, 16, 17, 31, 32, 33, 47, 100, 151936}) {
    for (int variant = 0; variant < 8; ++variant) {
      std::vector<float> l = random_logits(n * 8 + variant, n);
      std::uniform_int_distribution<size_t> at(0, n - 1);
      const float top = *std::max_element(l.begin(), l.end()) + 1.0f;
      switch (variant) {
        case 1: l[at(rng)] = top; l[at(rng)] = top; break;   // a tie anywhere
        case 2: l[n - 1] = top; if (n > 16) l[n - 17] = top; break;   // tail and the lane before
        case 3: l[0] = nan; break;
        case 4: l[at(rng)] = nan; l[at(rng)] = nan; break;
        case 5: l[at(rng)] = inf; l[at(rng)] = inf; break;
        case 6: std::fill(l.begin(), l.end(), -inf); break;
        case 7: std::fill(l.begin(), l.end(), 0.5f); break;
        default: break;
      }
      EXPECT_EQ(argmax(l), argmax_by_definition(l)) << "n " << n << " variant " << variant;
    }
  }
}

struct Case {
  float temp;
  int top_k;
  float top_p;
};

TEST(Sampling, DistributionMatchesDefinitions) {
  const auto l = random_logits(21, 50);
  for (Case c : {Case{1.0f, 0, 1.0f}, Case{0.7f, 0, 1.0f}, Case{1.3f, 5, 1.0f},
                 Case{1.0f, 0, 0.8f}, Case{0.8f, 10, 0.6f}}) {
    Sampler s({c.temp, c.top_k, c.top_p, 1});
    const auto d = s.distribution(l);
    const auto e = expected(l, c.temp, c.top_k, c.top_p);
    ASSERT_EQ(d.size(), e.size()) << "temp " << c.temp << " k " << c.top_k << " p " << c.top_p;
    double total = 0;
    for (const auto& [id, p] : d) {
      ASSERT_TRUE(e.count(id)) << "token " << id << " should have been cut";
      EXPECT_NEAR(p, e.at(id), 1e-6);
      total += p;
    }
    EXPECT_NEAR(total, 1.0, 1e-6);
  }
}

TEST(Sampling, DrawFrequenciesFollowTheDistribution) {
  const auto l = random_logits(22, 30);
  for (Case c : {Case{1.0f, 0, 1.0f}, Case{0.9f, 6, 1.0f}, Case{1.2f, 0, 0.7f}}) {
    Sampler s({c.temp, c.top_k, c.top_p, 12345});
    const auto e = expected(l, c.temp, c.top_k, c.top_p);
    const int N = 200000;
    std::map<int32_t, int> count;
    for (int i = 0; i < N; ++i) ++count[s.sample(l)];
    for (const auto& [id, n] : count) ASSERT_TRUE(e.count(id)) << "sampled cut token " << id;
    for (const auto& [id, p] : e) {
      const double sigma = std::sqrt(N * p * (1 - p));
      EXPECT_NEAR(count[id], N * p, 5 * sigma + 1) << "token " << id << " p " << p;
    }
  }
}

// A vocabulary large enough that the top-p prefix outgrows the first sorted prefixes (64, 512)
// and the no-cut draw goes through every token in id order.
TEST(Sampling, LargeVocabularyCutsAndDrawsMatchDefinitions) {
  const auto l = random_logits(24, 5000);
  for (Case c : {Case{1.0f, 0, 0.9f}, Case{0.5f, 0, 0.3f}, Case{2.0f, 0, 0.99f}, Case{1.0f, 700, 0.95f}}) {
    Sampler s({c.temp, c.top_k, c.top_p, 1});
    const auto d = s.distribution(l);
    const auto e = expected(l, c.temp, c.top_k, c.top_p);
    ASSERT_EQ(d.size(), e.size()) << "temp " << c.temp << " k " << c.top_k << " p " << c.top_p;
    for (size_t i = 0; i < d.size(); ++i) {
      ASSERT_TRUE(e.count(d[i].first)) << "token " << d[i].first << " should have been cut";
      EXPECT_NEAR(d[i].second, e.at(d[i].first), 1e-6);
      if (i > 0) {
        EXPECT_GE(l[d[i - 1].first], l[d[i].first]) << "not sorted at " << i;
      }
    }
  }
  // No cut: draws in id order must still follow the softmax. Bucket the tokens by probability
  // rank so each bucket's count is large.
  Sampler s({1.0f, 0, 1.0f, 99});
  const auto e = expected(l, 1.0f, 0, 1.0f);
  std::vector<std::pair<double, int32_t>> by_p;
  for (const auto& [id, p] : e) by_p.push_back({p, id});
  std::sort(by_p.rbegin(), by_p.rend());
  std::map<int32_t, int> bucket_of;
  std::vector<double> bucket_p(10, 0.0);
  for (size_t r = 0; r < by_p.size(); ++r) {
    const int b = static_cast<int>(std::min<size_t>(9, r / 8));   // the top 72 one by one-ish, then the rest
    bucket_of[by_p[r].second] = b;
    bucket_p[b] += by_p[r].first;
  }
  const int N = 40000;
  std::vector<int> count(10, 0);
  for (int i = 0; i < N; ++i) ++count[bucket_of.at(s.sample(l))];
  for (int b = 0; b < 10; ++b) {
    const double sigma = std::sqrt(N * bucket_p[b] * (1 - bucket_p[b]));
    EXPECT_NEAR(count[b], N * bucket_p[b], 5 * sigma + 1) << "bucket " << b << " p " << bucket_p[b];
  }
}

TEST(Sampling, SameSeedSameSequenceOtherSeedDiffers) {
  const auto l = random_logits(23, 100);
  Sampler a({1.0f, 0, 1.0f, 77}), b({1.0f, 0, 1.0f, 77}), c({1.0f, 0, 1.0f, 78});
  std::vector<int32_t> sa, sb, sc;
  for (int i = 0; i < 64; ++i) {
    sa.push_back(a.sample(l));
    sb.push_back(b.sample(l));
    sc.push_back(c.sample(l));
  }
  EXPECT_EQ(sa, sb);
  EXPECT_NE(sa, sc);
}

TEST(Sampling, BadParametersAreRefused) {
  EXPECT_THROW(Sampler({1.0f, 0, 0.0f, 1}), std::invalid_argument);
  EXPECT_THROW(argmax(std::vector<float>{}), std::invalid_argument);
}

}  // namespace
}  // namespace moraine::sampling
