// Speculative sampling through a request's sequence (Sequence::speculate), statistically: a toy
// model (logits from the context's last two tokens, 6 tokens), a deterministic drafter (the toy's
// greedy continuation, without penalties: often right, not always), temperature, top-k, top-p and
// all three penalties. 30,000 seeded generations of 3 tokens, with speculation and plainly; the
// frequencies of the 3-token continuations against their exact probabilities (the product of each
// position's distribution, penalties over the context as it is there) by Pearson's chi-square at
// p = 1e-4. A variant that applies the window's first context's penalties to every row fails it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <vector>

#include "common/sampling/sampler.h"
#include "coordinator/sequence.h"
#include "tests/support/chi_square.h"

namespace moraine::group {
namespace {

constexpr int32_t kV = 6;
constexpr uint32_t kTokens = 3;
constexpr int64_t kRuns = 30000;
constexpr double kP = 1e-4;
const std::vector<int32_t> kPrompt = {1, 4};

std::vector<float> toy_logits(const std::vector<int32_t>& ctx) {
  const float a = static_cast<float>(ctx.back()), b = static_cast<float>(ctx[ctx.size() - 2]);
  std::vector<float> l(kV);
  for (int32_t v = 0; v < kV; ++v) l[static_cast<size_t>(v)] = 1.2f * std::sin(1.7f * v + 0.9f * a + 0.4f * b) + 0.15f * v;
  return l;
}

std::vector<int32_t> toy_draft(std::vector<int32_t> ctx, int64_t k) {
  std::vector<int32_t> d;
  for (int64_t i = 0; i < k; ++i) {
    d.push_back(sampling::argmax(toy_logits(ctx)));
    ctx.push_back(d.back());
  }
  return d;
}

generate::SamplingParams params(uint64_t seed) {
  generate::SamplingParams sp;
  sp.set_temperature(0.9f);
  sp.set_top_k(5);
  sp.set_top_p(0.95f);
  sp.set_frequency_penalty(0.5f);
  sp.set_presence_penalty(0.3f);
  sp.set_repeat_penalty(1.3f);
  sp.set_max_tokens(kTokens);
  sp.set_seed(seed);
  return sp;
}

// The distribution at context `ctx`, as the sequence's sampler draws from it.
std::vector<std::pair<int32_t, float>> exact_at(const std::vector<int32_t>& ctx) {
  const generate::SamplingParams sp = params(0);
  std::vector<float> l = toy_logits(ctx);
  sampling::apply_penalties(l, ctx, {sp.repeat_penalty(), sp.frequency_penalty(), sp.presence_penalty(), 64});
  return sampling::Sampler({sp.temperature(), static_cast<int32_t>(sp.top_k()), sp.top_p(), 0, 0.0f}).distribution(l);
}

void enumerate(std::vector<int32_t>& ctx, double p, std::map<std::vector<int32_t>, double>& out) {
  if (ctx.size() == kPrompt.size() + kTokens) {
    out[{ctx.begin() + static_cast<std::ptrdiff_t>(kPrompt.size()), ctx.end()}] = p;
    return;
  }
  for (const auto& [id, q] : exact_at(ctx)) {
    ctx.push_back(id);
    enumerate(ctx, p * q, out);
    ctx.pop_back();
  }
}

// Rows of the toy's logits after ctx + draft[0..i), i = 0..draft.size().
std::vector<float> window_rows(std::vector<int32_t> ctx, const std::vector<int32_t>& draft) {
  std::vector<float> rows;
  for (size_t i = 0; i <= draft.size(); ++i) {
    const std::vector<float> l = toy_logits(ctx);
    rows.insert(rows.end(), l.begin(), l.end());
    if (i < draft.size()) ctx.push_back(draft[i]);
  }
  return rows;
}

// One generation of kTokens tokens; max_draft 0: plain sampling.
std::vector<int32_t> generate_one(uint64_t seed, int64_t max_draft, int64_t* drafted = nullptr, int64_t* accepted = nullptr) {
  Sequence seq(params(seed), nullptr, kPrompt, 64);
  for (;;) {
    const int64_t k = std::min<int64_t>(max_draft, static_cast<int64_t>(seq.max_new() - seq.generated()) - 1);
    const std::vector<int32_t> draft = toy_draft(seq.context, k);
    std::vector<int32_t> decided;
    if (draft.empty()) {
      decided.push_back(seq.sample(toy_logits(seq.context)));
    } else {
      decided = seq.speculate(window_rows(seq.context, draft), kV, draft);
      EXPECT_TRUE(std::equal(decided.begin(), decided.end() - 1, draft.begin())) << "accepted tokens are the draft's";
      if (drafted) *drafted += static_cast<int64_t>(draft.size());
      if (accepted) *accepted += static_cast<int64_t>(decided.size()) - 1;
    }
    for (const int32_t id : decided) {
      generate::GenerateChunk chunk;
      if (seq.accept(id, chunk))
        return {seq.context.begin() + static_cast<std::ptrdiff_t>(kPrompt.size()), seq.context.end()};
    }
  }
}

// The wrong variant: every row of a window sampled with the penalties of the window's first context.
std::vector<int32_t> generate_stale_penalties(uint64_t seed) {
  const generate::SamplingParams sp = params(seed);
  sampling::Sampler s({sp.temperature(), static_cast<int32_t>(sp.top_k()), sp.top_p(), seed, 0.0f});
  const sampling::PenaltyParams pen{sp.repeat_penalty(), sp.frequency_penalty(), sp.presence_penalty(), 64};
  std::vector<int32_t> ctx = kPrompt;
  while (ctx.size() < kPrompt.size() + kTokens) {
    const int64_t k = static_cast<int64_t>(kPrompt.size() + kTokens - ctx.size()) - 1;
    const std::vector<int32_t> draft = toy_draft(ctx, k);
    const std::vector<int32_t> start = ctx;
    for (size_t i = 0; i <= draft.size(); ++i) {
      std::vector<float> l = toy_logits(ctx);
      sampling::apply_penalties(l, start, pen);
      const sampling::Sampler::Verdict v = i < draft.size() ? s.verify(l, draft[i]) : sampling::Sampler::Verdict{s.sample(l), false};
      ctx.push_back(v.token);
      if (!v.accepted) break;
    }
  }
  return {ctx.begin() + static_cast<std::ptrdiff_t>(kPrompt.size()), ctx.end()};
}

testing::ChiSquare test_generator(const auto& gen) {
  std::map<std::vector<int32_t>, double> exact;
  std::vector<int32_t> ctx = kPrompt;
  enumerate(ctx, 1.0, exact);
  std::map<std::vector<int32_t>, int64_t> seen;
  for (int64_t r = 0; r < kRuns; ++r) ++seen[gen(static_cast<uint64_t>(r) + 1)];
  return testing::chi_square(seen, exact, kRuns, kP);
}

TEST(SequenceSpeculation, MatchesPlainSamplingsDistributionWithPenalties) {
  int64_t drafted = 0, accepted = 0;
  const testing::ChiSquare spec = test_generator([&](uint64_t seed) { return generate_one(seed, 2, &drafted, &accepted); });
  EXPECT_TRUE(spec.passes()) << "speculative: " << spec.describe();
  // Drafts both accepted and rejected, or the test would not exercise both paths.
  EXPECT_GT(accepted, drafted / 10);
  EXPECT_LT(accepted, drafted * 9 / 10);
  const testing::ChiSquare plain = test_generator([](uint64_t seed) { return generate_one(seed, 0); });
  EXPECT_TRUE(plain.passes()) << "plain: " << plain.describe();
  std::printf("speculative: %s (%lld of %lld drafts accepted)\nplain: %s\n", spec.describe().c_str(),
              static_cast<long long>(accepted), static_cast<long long>(drafted), plain.describe().c_str());
}

TEST(SequenceSpeculation, StalePenaltiesFailTheTest) {
  const testing::ChiSquare stale = test_generator([](uint64_t seed) { return generate_stale_penalties(seed); });
  EXPECT_FALSE(stale.passes()) << "stale penalties: " << stale.describe();
  std::printf("stale penalties: %s\n", stale.describe().c_str());
}

TEST(SequenceSpeculation, SeededGenerationReproduces) {
  for (uint64_t seed : {3u, 4u, 5u}) EXPECT_EQ(generate_one(seed, 2), generate_one(seed, 2));
}

TEST(SequenceSpeculation, LogprobsFollowEveryToken) {
  generate::SamplingParams sp = params(7);
  sp.set_logprobs(true);
  sp.set_max_tokens(8);
  Sequence seq(sp, nullptr, kPrompt, 64);
  const std::vector<int32_t> draft = toy_draft(seq.context, 3);
  const std::vector<int32_t> decided = seq.speculate(window_rows(seq.context, draft), kV, draft);
  for (const int32_t id : decided) {
    generate::GenerateChunk chunk;
    seq.accept(id, chunk);
    ASSERT_EQ(chunk.logprobs_size(), 1);
    EXPECT_EQ(chunk.logprobs(0).id(), static_cast<uint32_t>(id));
  }
}

TEST(SequenceSpeculation, RowsMustMatchTheDraft) {
  Sequence seq(params(1), nullptr, kPrompt, 64);
  const std::vector<int32_t> draft = {1, 2};
  const std::vector<float> rows(kV * 2, 0.0f);   // two rows for a draft of two: one short
  EXPECT_THROW(seq.speculate(rows, kV, draft), std::invalid_argument);
  EXPECT_THROW(seq.speculate(std::vector<float>(kV * 3, 0.0f), 0, draft), std::invalid_argument);
}

}  // namespace
}  // namespace moraine::group
