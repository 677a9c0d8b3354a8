// Speculative sampling's row test (sampling::Sampler::verify) against plain sampling's
// distribution, statistically: 20,000 draws per case on fixed synthetic logits, and the joint
// outcome (draft accepted, or which token replaced it) compared with its exact probabilities by
// Pearson's chi-square at p = 1e-4 (the bound is that quantile for the case's degrees of freedom,
// tests/support/chi_square.h). Two wrong rules (always accepting; drawing the rejection's token
// from p without removing the draft) fail the same test, so it can tell.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "common/sampling/sampler.h"
#include "tests/support/chi_square.h"

namespace moraine::sampling {
namespace {

constexpr int64_t kDraws = 20000;
constexpr double kP = 1e-4;

std::vector<float> synthetic_logits(size_t v, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.5f);
  std::vector<float> l(v);
  for (float& x : l) x = n(rng);
  return l;
}

// (accepted, token): the draft accepted as itself, or rejected and replaced by token.
using Outcome = std::pair<bool, int32_t>;
using Rule = std::function<Outcome(std::span<const float>, int32_t)>;

// The exact outcome probabilities of a correct rule: the draft accepted with p(draft), every other
// token y drawn with p(y) (a rejection, then y from the residual: (1 - p(x)) * p(y) / (1 - p(x))),
// the draft never drawn on a rejection.
std::map<Outcome, double> exact_outcomes(const Sampler& s, std::span<const float> logits, int32_t draft) {
  std::map<Outcome, double> e;
  for (const auto& [id, p] : s.distribution(logits)) e[{id == draft, id}] = p;
  return e;
}

testing::ChiSquare test_rule(const Sampler& ref, std::span<const float> logits, int32_t draft, const Rule& rule) {
  std::map<Outcome, int64_t> seen;
  for (int64_t i = 0; i < kDraws; ++i) ++seen[rule(logits, draft)];
  return testing::chi_square(seen, exact_outcomes(ref, logits, draft), kDraws, kP);
}

struct Case {
  const char* name;
  SamplerParams p;
};
const Case kCases[] = {
    {"temperature", {0.8f, 0, 1.0f, 11, 0.0f}},
    {"top_k", {1.2f, 5, 1.0f, 12, 0.0f}},
    {"top_p", {1.3f, 0, 0.9f, 13, 0.0f}},
    {"min_p_top_k", {1.0f, 8, 1.0f, 14, 0.05f}},
};

// Drafts of every kind: the most likely token, one in the middle of the kept ones, and one the
// cuts dropped (or the least likely where none is dropped).
std::vector<int32_t> drafts_of(const Sampler& s, std::span<const float> logits) {
  const auto d = s.distribution(logits);
  // Fewer kept tokens would make p a point mass or nearly, where a wrong rule is right too.
  EXPECT_GE(d.size(), 3u) << "the case's cuts keep too little to test";
  std::vector<int32_t> out{d[0].first, d[d.size() / 2].first};
  std::vector<bool> kept(logits.size(), false);
  for (const auto& [id, p] : d) kept[static_cast<size_t>(id)] = true;
  int32_t dropped = d.back().first;
  for (size_t i = 0; i < kept.size(); ++i)
    if (!kept[i]) dropped = static_cast<int32_t>(i);
  out.push_back(dropped);
  return out;
}

TEST(SpeculativeSampling, VerifyDrawsPlainSamplingsDistribution) {
  const std::vector<float> logits = synthetic_logits(12, 5);
  for (const Case& c : kCases) {
    const Sampler ref(c.p);
    for (const int32_t draft : drafts_of(ref, logits)) {
      Sampler s(c.p);
      const testing::ChiSquare chi =
          test_rule(ref, logits, draft, [&](std::span<const float> l, int32_t x) {
            const Sampler::Verdict v = s.verify(l, x);
            EXPECT_EQ(v.accepted, v.token == x);   // a rejection never draws the draft again
            return Outcome{v.accepted, v.token};
          });
      EXPECT_TRUE(chi.passes()) << c.name << ", draft " << draft << ": " << chi.describe();
      std::printf("%s, draft %d: %s\n", c.name, draft, chi.describe().c_str());
    }
  }
}

TEST(SpeculativeSampling, WrongRulesFailTheTest) {
  const std::vector<float> logits = synthetic_logits(12, 5);
  for (const Case& c : kCases) {
    const Sampler ref(c.p);
    std::mt19937_64 rng(c.p.seed);
    const auto uniform = [&] { return static_cast<double>(rng() >> 11) * 0x1.0p-53; };
    const auto draw = [&](const std::vector<std::pair<int32_t, float>>& d) {
      double u = uniform(), cum = 0.0;
      for (const auto& [id, p] : d) {
        cum += p;
        if (u < cum) return id;
      }
      return d.back().first;
    };
    const Rule always_accept = [](std::span<const float>, int32_t x) { return Outcome{true, x}; };
    // Accepts with p(x), but on a rejection draws from p itself, draft included.
    const Rule residual_keeps_draft = [&](std::span<const float> l, int32_t x) {
      const auto d = ref.distribution(l);
      double px = 0.0;
      for (const auto& [id, p] : d) px += id == x ? p : 0.0;
      if (uniform() < px) return Outcome{true, x};
      return Outcome{false, draw(d)};
    };
    const std::vector<int32_t> drafts = drafts_of(ref, logits);
    for (const int32_t draft : drafts) {
      const testing::ChiSquare chi = test_rule(ref, logits, draft, always_accept);
      EXPECT_FALSE(chi.passes()) << c.name << ", always accepting draft " << draft << ": " << chi.describe();
    }
    // Where the draft has some probability (the top and the middle token), a rejection that may
    // draw it again shows (a dropped draft is never accepted nor drawn: that rule is then right).
    for (const int32_t draft : {drafts[0], drafts[1]}) {
      const testing::ChiSquare chi = test_rule(ref, logits, draft, residual_keeps_draft);
      EXPECT_FALSE(chi.passes()) << c.name << ", residual with draft " << draft << ": " << chi.describe();
    }
  }
}

// The outcome alone, ignoring the accepted flag: the emitted token's frequencies match sample()'s
// distribution too (what a request sees).
TEST(SpeculativeSampling, EmittedTokenMatchesSample) {
  const std::vector<float> logits = synthetic_logits(12, 9);
  for (const Case& c : kCases) {
    Sampler s(c.p);
    const Sampler ref(c.p);
    const int32_t draft = ref.distribution(logits)[1].first;
    std::map<int32_t, int64_t> seen;
    for (int64_t i = 0; i < kDraws; ++i) ++seen[s.verify(logits, draft).token];
    std::map<int32_t, double> e;
    for (const auto& [id, p] : ref.distribution(logits)) e[id] = p;
    const testing::ChiSquare chi = testing::chi_square(seen, e, kDraws, kP);
    EXPECT_TRUE(chi.passes()) << c.name << ": " << chi.describe();
  }
}

TEST(SpeculativeSampling, GreedyAcceptsOnlyTheArgmax) {
  const std::vector<float> logits = synthetic_logits(12, 5);
  Sampler s({0.0f, 0, 1.0f, 1, 0.0f});
  const int32_t best = argmax(logits);
  EXPECT_EQ(s.verify(logits, best).token, best);
  EXPECT_TRUE(s.verify(logits, best).accepted);
  const Sampler::Verdict v = s.verify(logits, (best + 1) % 12);
  EXPECT_FALSE(v.accepted);
  EXPECT_EQ(v.token, best);
}

TEST(SpeculativeSampling, SeededVerifyReproduces) {
  const std::vector<float> logits = synthetic_logits(12, 5);
  Sampler a(kCases[0].p), b(kCases[0].p);
  for (int i = 0; i < 200; ++i) {
    const Sampler::Verdict x = a.verify(logits, i % 12), y = b.verify(logits, i % 12);
    ASSERT_EQ(x.token, y.token);
    ASSERT_EQ(x.accepted, y.accepted);
  }
}

TEST(SpeculativeSampling, QuantileMatchesTables) {
  // Closed forms (df 2: -2 ln p; df 1: the square of the normal's two-sided quantile) and tables.
  EXPECT_NEAR(testing::chi_square_upper_quantile(2, 1e-4), -2.0 * std::log(1e-4), 1e-6);
  EXPECT_NEAR(testing::chi_square_upper_quantile(1, 1e-4), 15.137, 0.002);
  EXPECT_NEAR(testing::chi_square_upper_quantile(1, 0.05), 3.841, 0.002);
  EXPECT_NEAR(testing::chi_square_upper_quantile(10, 0.05), 18.307, 0.002);
  EXPECT_NEAR(testing::chi_square_upper_quantile(3, 1e-4), 21.108, 0.005);
}

}  // namespace
}  // namespace moraine::sampling
