// moraine-perplexity's statistics (tools/common/perplexity_stats.h) on rows whose answers are
// known in closed form.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "tools/common/perplexity_stats.h"

namespace moraine::tools {
namespace {

using Row = std::vector<float>;

TEST(PerplexityStats, UniformRowsGiveTheVocabularySize) {
  PerplexityStats s;
  const Row flat(50, 3.25f);
  for (int t = 0; t < 7; ++t) s.add(flat, t);
  EXPECT_EQ(s.count(), 7u);
  EXPECT_NEAR(s.ppl().mean, 50.0, 50.0 * 1e-12);
  EXPECT_EQ(s.ppl().error, 0.0);   // every nll the same
}

TEST(PerplexityStats, NllAndErrorFromTheDefinition) {
  // Row (0, log 3): p = (1/4, 3/4). nll of token 1 = log(4/3), of token 0 = log 4.
  const Row r{0.0f, static_cast<float>(std::log(3.0))};
  EXPECT_NEAR(negative_log_likelihood(r, 1), std::log(4.0 / 3.0), 1e-7);
  EXPECT_NEAR(negative_log_likelihood(r, 0), std::log(4.0), 1e-7);
  PerplexityStats s;
  s.add_nll(1.0);
  s.add_nll(2.0);
  s.add_nll(4.0);
  // mean 7/3, sample variance of the three (population 14/9) over n - 1 = 2: error sqrt(7/9).
  EXPECT_DOUBLE_EQ(s.mean_nll(), 7.0 / 3.0);
  EXPECT_NEAR(s.ppl().mean, std::exp(7.0 / 3.0), 1e-12);
  EXPECT_NEAR(s.ppl().error, std::exp(7.0 / 3.0) * std::sqrt(7.0 / 9.0), 1e-12);
  EXPECT_THROW(negative_log_likelihood(r, 2), std::invalid_argument);
  EXPECT_THROW(negative_log_likelihood(r, -1), std::invalid_argument);
}

TEST(DivergenceStats, ARowAgainstItselfIsExactlyZero) {
  DivergenceStats d;
  const Row a{1.5f, -2.0f, 0.25f, 7.0f}, b{-3.0f, 0.0f, 0.5f, 0.5f};
  d.add(a, a, 3);
  d.add(b, b, 0);
  EXPECT_EQ(d.kl().mean, 0.0);
  EXPECT_EQ(d.kl().error, 0.0);
  EXPECT_EQ(d.top1().mean, 1.0);
  EXPECT_EQ(d.delta_ppl().mean, 0.0);
  EXPECT_EQ(d.delta_ppl().error, 0.0);
  EXPECT_EQ(d.ppl().mean, d.base_ppl().mean);
}

TEST(DivergenceStats, KlAndTopOneFromTheDefinition) {
  // base p = (1/2, 1/2), model q = (1/4, 3/4): KL(p || q) = 1/2 log 2 + 1/2 log(2/3). The rows are
  // floats (log 3 rounded to 24 bits): the closed forms hold to ~1e-7 relative.
  const Row base{0.0f, 0.0f}, model{0.0f, static_cast<float>(std::log(3.0))};
  DivergenceStats d;
  d.add(base, model, 0);
  EXPECT_NEAR(d.kl().mean, 0.5 * std::log(2.0) + 0.5 * std::log(2.0 / 3.0), 1e-7);
  EXPECT_EQ(d.top1().mean, 0.0);   // the base's tie goes to its first index, the model's argmax is 1
  EXPECT_NEAR(d.ppl().mean, 4.0, 1e-6);
  EXPECT_NEAR(d.base_ppl().mean, 2.0, 1e-6);
  EXPECT_NEAR(d.delta_ppl().mean, 2.0, 1e-6);
  d.add(Row{0.0f, 1.0f}, model, 1);   // both argmax 1
  EXPECT_DOUBLE_EQ(d.top1().mean, 0.5);
  EXPECT_NEAR(d.top1().error, std::sqrt(0.25 / 1.0), 1e-12);
  EXPECT_THROW(d.add(Row{0.0f}, model, 0), std::invalid_argument);
}

}  // namespace
}  // namespace moraine::tools
