// The sigmoid group-limited router (reference::route_sigmoid_group_top_k through route_layer) on
// hand-made scores: groups ranked by the sum of their two best biased scores, the score bias
// deciding the choice but not the weights, renormalisation, and routed_scale applied to every
// router kind. The whole path against llama.cpp: arch_llama_test's glm4moe files.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

#include "common/model/model.h"
#include "common/reference/moe_parts.h"

namespace moraine {
namespace {

// One input of 1.0 and a router whose row e is logit(s_e): the router's scores are s.
struct Router {
  std::vector<float> rows;
  model::HParams hp;
  model::MoeWeights W;
  reference::RouterScratch scratch;

  Router(const std::vector<float>& s, int64_t k) {
    for (float p : s) rows.push_back(std::log(p / (1.0f - p)));
    hp.n_embd = 1;
    hp.n_expert = static_cast<int64_t>(s.size());
    hp.n_expert_used = k;
    W.router.type = TensorType::F32;
    W.router.n_cols = 1;
    W.router.n_rows = hp.n_expert;
    W.router.row_bytes = sizeof(float);
    W.router.data = reinterpret_cast<const uint8_t*>(rows.data());
    scratch.reserve(hp, 1);
  }
  // The chosen experts and their weights for the part.
  std::pair<std::vector<int32_t>, std::vector<float>> route(const model::FfnPart& part) {
    reference::ThreadPool pool(1);
    const float h = 1.0f;
    std::vector<int32_t> chosen(static_cast<size_t>(hp.n_expert_used));
    std::vector<float> weight(chosen.size());
    reference::route_layer(hp, part, W, &h, 1, chosen.data(), weight.data(), scratch, pool);
    return {chosen, weight};
  }
  float s(int64_t e) const { return 1.0f / (1.0f + std::exp(-rows[static_cast<size_t>(e)])); }
};

model::FfnPart sigmoid_part(int64_t n_group, int64_t topk_group, bool renormalize, double scale) {
  model::FfnPart p;
  p.router.kind = model::RouterKind::SigmoidGroupTopK;
  p.router.n_group = n_group;
  p.router.topk_group = topk_group;
  p.router.renormalize = renormalize;
  p.router.routed_scale = scale;
  return p;
}

TEST(SigmoidGroupRouter, GroupsRankByTheirTwoBestScores) {
  // Group 0 holds the best expert and the best sum of all three; group 1 the best two-best sum.
  Router r({0.9f, 0.45f, 0.45f, 0.7f, 0.7f, 0.05f}, 2);
  auto [chosen, weight] = r.route(sigmoid_part(2, 1, true, 1.0));
  EXPECT_EQ(chosen, (std::vector<int32_t>{3, 4}));
  const float sum = r.s(3) + r.s(4);
  EXPECT_FLOAT_EQ(weight[0], r.s(3) / sum);
  EXPECT_FLOAT_EQ(weight[1], r.s(4) / sum);
  // One group: the two best overall, raw scores without renormalising, times the scale.
  std::tie(chosen, weight) = r.route(sigmoid_part(1, 1, false, 2.5));
  EXPECT_EQ(chosen, (std::vector<int32_t>{0, 3}));
  EXPECT_FLOAT_EQ(weight[0], r.s(0) * 2.5f);
  EXPECT_FLOAT_EQ(weight[1], r.s(3) * 2.5f);
}

TEST(SigmoidGroupRouter, ScoreBiasChoosesButDoesNotWeigh) {
  Router r({0.9f, 0.45f, 0.45f, 0.7f, 0.7f, 0.05f}, 2);
  r.W.score_bias = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 1.0f};
  auto [chosen, weight] = r.route(sigmoid_part(1, 1, true, 1.0));
  EXPECT_EQ(chosen, (std::vector<int32_t>{5, 0}));   // 0.05 + 1 ranks first
  const float sum = r.s(5) + r.s(0);
  EXPECT_FLOAT_EQ(weight[0], r.s(5) / sum);          // weighed by its unbiased 0.05
  EXPECT_FLOAT_EQ(weight[1], r.s(0) / sum);
  // The bias counts in the group scores too: group 1's two best become 0.7 + 1.05.
  std::tie(chosen, weight) = r.route(sigmoid_part(2, 1, true, 1.0));
  EXPECT_EQ(chosen, (std::vector<int32_t>{5, 3}));
}

TEST(SigmoidGroupRouter, RoutedScaleAppliesToEveryRouterKind) {
  Router r({0.9f, 0.45f, 0.2f, 0.7f}, 2);
  model::FfnPart softmax;
  r.hp.norm_topk_prob = true;
  const auto [c1, w1] = r.route(softmax);
  softmax.router.routed_scale = 3.0;
  const auto [c3, w3] = r.route(softmax);
  EXPECT_EQ(c1, c3);
  EXPECT_FLOAT_EQ(w3[0], 3.0f * w1[0]);
  EXPECT_FLOAT_EQ(w3[1], 3.0f * w1[1]);
}

TEST(SigmoidGroupRouter, AChoiceTheGroupsCannotHoldIsALogicError) {
  Router r({0.9f, 0.45f, 0.45f, 0.7f, 0.7f, 0.05f}, 4);   // 4 from one group of 3
  EXPECT_THROW(r.route(sigmoid_part(2, 1, true, 1.0)), std::logic_error);
}

}  // namespace
}  // namespace moraine
