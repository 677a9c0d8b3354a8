// The cpu_expert_worker's next-layer guess (cpu_expert_worker/next_layer_guess.h): layer il + 1's
// router folded with the ratio of the two ffn norms must give, from layer il's normalised MoE
// input, layer il + 1's logits of the same residual (within the int8 rounding it states), and
// its guess must be their top-k.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "common/formats/quant.h"
#include "common/model/model.h"
#include "common/reference/moe_parts.h"
#include "common/reference/ops.h"
#include "cpu_expert_worker/next_layer_guess.h"
#include "kernels/cpu/thread_pool.h"
#include "tests/reference/synthetic_model.h"

namespace moraine {
namespace {

struct GuessFixture : ::testing::Test {
  static model::Model load(const std::string& arch) {
    testing::SyntheticSpec spec;
    spec.arch = arch;
    spec.n_layer = 4;
    spec.n_embd = 128;
    spec.n_expert = 24;
    spec.n_expert_used = 4;
    spec.seed = 11;
    testing::SyntheticModel sm(spec);
    const std::string path = testing::temp_path("next_layer_guess.gguf");
    sm.write(path);
    model::Model m = model::Model::load(path);
    std::remove(path.c_str());
    return m;
  }
};

// Layer il + 1's logits of residual x in double, from its own router and norm.
std::vector<double> reference_logits(const model::Model& m, int64_t layer, const std::vector<float>& x) {
  const int64_t d = m.hp.n_embd;
  std::vector<float> y(static_cast<size_t>(d)), w(static_cast<size_t>(d));
  reference::rms_norm(x.data(), m.layers[static_cast<size_t>(layer)].ffn_norm.data(), d, static_cast<float>(m.hp.rms_eps), y.data());
  const model::Matrix& r = m.layers[static_cast<size_t>(layer)].moe.router;
  std::vector<double> out(static_cast<size_t>(m.hp.n_expert));
  for (int64_t e = 0; e < m.hp.n_expert; ++e) {
    dequantize_row(r.type, r.row(e), w.data(), d);
    double s = 0;
    for (int64_t i = 0; i < d; ++i) s += static_cast<double>(w[static_cast<size_t>(i)]) * y[static_cast<size_t>(i)];
    out[static_cast<size_t>(e)] = s;
  }
  return out;
}

void check_model(const model::Model& m) {
  const int64_t d = m.hp.n_embd, ne = m.hp.n_expert, k = m.hp.n_expert_used;
  cpu_worker::NextLayerGuess guess(m);
  cpu::ThreadPool pool({0});
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(d)), h(static_cast<size_t>(d)), logits;
  int near_ties = 0;
  for (int trial = 0; trial < 50; ++trial) {
    for (float& v : x) v = nd(rng);
    x[static_cast<size_t>(trial % d)] += 20.0f;   // a large coordinate, as real residuals have
    for (int64_t il = 0; il + 1 < m.hp.n_layer; ++il) {
      reference::rms_norm(x.data(), m.layers[static_cast<size_t>(il)].ffn_norm.data(), d, static_cast<float>(m.hp.rms_eps), h.data());
      const std::vector<double> want = reference_logits(m, il + 1, x);
      guess.logits(il, h.data(), pool, logits);
      ASSERT_EQ(logits.size(), static_cast<size_t>(ne));
      double worst = 0;
      std::vector<float> y(static_cast<size_t>(d)), w(static_cast<size_t>(d));
      reference::rms_norm(x.data(), m.layers[static_cast<size_t>(il + 1)].ffn_norm.data(), d, static_cast<float>(m.hp.rms_eps), y.data());
      const model::Matrix& r = m.layers[static_cast<size_t>(il + 1)].moe.router;
      for (int64_t e = 0; e < ne; ++e) {
        // The F32 fold itself: each term h_i * (w'_i / w_i) * W_ei carries a few roundings more
        // than the double sum (h from rms_norm, the ratio, the product): 8 units of 2^-24 of
        // sum |W_ei y_i| covers them.
        dequantize_row(r.type, r.row(e), w.data(), d);
        double abs_wy = 0;
        for (int64_t i = 0; i < d; ++i) abs_wy += std::fabs(static_cast<double>(w[static_cast<size_t>(i)]) * y[static_cast<size_t>(i)]);
        const double tol = guess.error_bound(il, e, h.data()) + 8 * 0x1p-24 * abs_wy;
        EXPECT_LE(std::fabs(logits[static_cast<size_t>(e)] - want[static_cast<size_t>(e)]), tol)
            << "layer " << il + 1 << " expert " << e << " trial " << trial;
        worst = std::max(worst, tol);
      }
      // The guess is the top k of its own logits, best first.
      std::vector<int32_t> got;
      guess.guess(il, h.data(), 1, pool, got);
      ASSERT_EQ(got.size(), static_cast<size_t>(k));
      for (size_t s = 1; s < got.size(); ++s) EXPECT_GE(logits[static_cast<size_t>(got[s - 1])], logits[static_cast<size_t>(got[s])]);
      for (int64_t e = 0; e < ne; ++e) {
        if (std::find(got.begin(), got.end(), e) == got.end()) {
          EXPECT_LE(logits[static_cast<size_t>(e)], logits[static_cast<size_t>(got.back())]) << "expert " << e << " left out";
        }
      }
      // Against layer il + 1's real routing of x: a guessed expert outside its top k must be
      // within the logits' error of the k-th (a near tie the int8 rounding may flip).
      std::vector<double> sorted = want;
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      const double kth = sorted[static_cast<size_t>(k - 1)];
      for (const int32_t e : got) {
        if (want[static_cast<size_t>(e)] < kth) {
          ++near_ties;
          EXPECT_GE(want[static_cast<size_t>(e)], kth - 2 * worst) << "layer " << il + 1 << " expert " << e << " is no near tie";
        }
      }
    }
  }
  // Near ties are rare: most guesses are exactly the routing.
  EXPECT_LT(near_ties, 15);
}

TEST_F(GuessFixture, Qwen3MoeFoldsTheNormRatioIntoTheNextRouter) { check_model(load("qwen3moe")); }
TEST_F(GuessFixture, Qwen3NextFoldsTheNormRatioIntoTheNextRouter) { check_model(load("qwen3next")); }

TEST_F(GuessFixture, SeveralRowsGiveTheUnionRowZeroFirst) {
  const model::Model m = load("qwen3moe");
  const int64_t d = m.hp.n_embd, k = m.hp.n_expert_used;
  cpu_worker::NextLayerGuess guess(m);
  cpu::ThreadPool pool({0});
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> h(static_cast<size_t>(3 * d));
  for (float& v : h) v = nd(rng);
  std::vector<int32_t> all, each;
  guess.guess(1, h.data(), 3, pool, all);
  for (int t = 0; t < 3; ++t) {
    std::vector<int32_t> one;
    guess.guess(1, h.data() + t * d, 1, pool, one);
    if (t == 0) {
      EXPECT_TRUE(std::equal(one.begin(), one.end(), all.begin()));
    }
    for (int32_t e : one) {
      EXPECT_NE(std::find(all.begin(), all.end(), e), all.end());
      if (std::find(each.begin(), each.end(), e) == each.end()) each.push_back(e);
    }
  }
  EXPECT_EQ(all.size(), each.size());
  EXPECT_GE(all.size(), static_cast<size_t>(k));
  std::vector<float> logits;
  EXPECT_THROW(guess.logits(m.hp.n_layer - 1, h.data(), pool, logits), std::invalid_argument);   // no layer after the last
}

}  // namespace
}  // namespace moraine
