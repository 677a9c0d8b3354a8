// The coordinator's prefix cache (reuse_prefix): a request whose tokens begin with the cached
// sequence prefills only the rest, and its greedy tokens are those of the same prompt on a
// fresh group. An attention-only model (qwen3moe) reuses any common prefix (rewinding the KV
// cache); one with recurrent DeltaNet layers (qwen3next) only the whole cached sequence.
#include <gtest/gtest.h>

#include <cstdio>
#include <ostream>

#include "coordinator/group_layout.h"
#include "tests/group/group_harness.h"

namespace moraine::group_test {
namespace {

struct Case {
  const char* model;
  bool recurrent;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.model; }

class PrefixCache : public ::testing::TestWithParam<Case> {};

TEST_P(PrefixCache, FollowUpsMatchAFreshGroup) {
  const Case c = GetParam();
  const std::string dir = temp_dir(std::string("prefix-") + c.model);
  GroupOptions o;
  o.model = convert_golden(c.model, golden_quant_args("kmix"), dir);
  // Only the live sequence (the conversation cache's saved ones: ConversationCache below).
  o.extra_args = {"--cache-ram", "0"};
  const std::vector<int32_t> p = golden_prompt(c.model);
  ASSERT_GT(p.size(), 13u);
  constexpr int n = 8;
  Generation a, b, part, again;
  std::vector<int32_t> follow, partial;
  {
    Group g(o);
    a = generate(g.socket_dir(), p, n);
    ASSERT_TRUE(a.error.empty()) << a.error;
    EXPECT_EQ(a.cached_tokens, 0u);
    // The next turn: the prompt, the answer, three more tokens.
    follow = p;
    follow.insert(follow.end(), a.ids.begin(), a.ids.end());
    follow.insert(follow.end(), {17, 23, 5});
    b = generate(g.socket_dir(), follow, n);
    ASSERT_TRUE(b.error.empty()) << b.error;
    // Cached: the prompt and every generated token but the last (never fed back).
    EXPECT_EQ(b.cached_tokens, p.size() + a.ids.size() - 1);
    // A prompt that leaves the cached sequence after 12 tokens.
    partial.assign(p.begin(), p.begin() + 12);
    partial.insert(partial.end(), {31, 32, 33});
    part = generate(g.socket_dir(), partial, n);
    ASSERT_TRUE(part.error.empty()) << part.error;
    EXPECT_EQ(part.cached_tokens, c.recurrent ? 0u : 12u);
    // The follow-up again, after the cache moved on: the same tokens.
    again = generate(g.socket_dir(), follow, n);
    ASSERT_TRUE(again.error.empty()) << again.error;
    EXPECT_EQ(again.cached_tokens, c.recurrent ? 0u : 12u);
    EXPECT_EQ(again.ids, b.ids);
    EXPECT_EQ(coordinator_counter(g.socket_dir(), "prefix_cache_hits"), c.recurrent ? 1u : 3u);
    std::printf("%s: first answer %zu tokens, follow-up %zu tokens with %u cached, partial %zu with %u cached\n", c.model,
                a.ids.size(), b.ids.size(), b.cached_tokens, part.ids.size(), part.cached_tokens);
    EXPECT_EQ(a.ids.size(), static_cast<size_t>(n)) << "the first answer ended early: pick another prompt";
    g.stop();
  }
  Group fresh(o);
  const Generation fb = generate(fresh.socket_dir(), follow, n);
  ASSERT_TRUE(fb.error.empty()) << fb.error;
  EXPECT_EQ(fb.cached_tokens, 0u);
  EXPECT_EQ(b.ids, fb.ids) << "the follow-up's tokens differ from a fresh group's";
  const Generation fp = generate(fresh.socket_dir(), partial, n);
  ASSERT_TRUE(fp.error.empty()) << fp.error;
  EXPECT_EQ(part.ids, fp.ids) << "the partial prefix's tokens differ from a fresh group's";
  fresh.stop();
}

// The conversation cache (--cache-ram, on by default): two conversations taking turns each
// continue from their own saved state (the other one saved when one is loaded), with the tokens
// of a fresh group; a budget that holds one saved conversation evicts the older.
class ConversationCache : public ::testing::TestWithParam<Case> {};

TEST_P(ConversationCache, TurnsOfTwoConversationsEachReuseTheirOwn) {
  const Case c = GetParam();
  const std::string dir = temp_dir(std::string("conversations-") + c.model);
  GroupOptions o;
  o.model = convert_golden(c.model, golden_quant_args("kmix"), dir);
  // Two prompts that share no first token, each long enough to be saved (>= 32 tokens).
  std::vector<int32_t> pa = golden_prompt(c.model), pb;
  pa.insert(pa.end(), pa.begin(), pa.end());
  for (int32_t t : pa) pb.push_back(t == 7 ? 8 : 7 + (t * 13) % 90);
  ASSERT_NE(pa[0], pb[0]);
  ASSERT_GE(pa.size(), 40u);
  constexpr int n = 8;
  const auto follow_up = [](std::vector<int32_t> p, const Generation& g, std::initializer_list<int32_t> more) {
    p.insert(p.end(), g.ids.begin(), g.ids.end());
    p.insert(p.end(), more);
    return p;
  };
  Generation fa, fb;
  std::vector<int32_t> qa, qb;
  {
    Group g(o);
    const Generation a = generate(g.socket_dir(), pa, n), b = generate(g.socket_dir(), pb, n);
    ASSERT_TRUE(a.error.empty() && b.error.empty()) << a.error << b.error;
    EXPECT_EQ(b.cached_tokens, 0u);
    qa = follow_up(pa, a, {17, 23, 5});
    fa = generate(g.socket_dir(), qa, n);   // A comes back from the store, B goes in
    ASSERT_TRUE(fa.error.empty()) << fa.error;
    EXPECT_EQ(fa.cached_tokens, pa.size() + a.ids.size() - 1);
    qb = follow_up(pb, b, {19, 3});
    fb = generate(g.socket_dir(), qb, n);   // and B again
    ASSERT_TRUE(fb.error.empty()) << fb.error;
    EXPECT_EQ(fb.cached_tokens, pb.size() + b.ids.size() - 1);
    EXPECT_EQ(coordinator_counter(g.socket_dir(), "conversation_cache_hits"), 2u);
    EXPECT_EQ(coordinator_counter(g.socket_dir(), "conversation_cache_saves"), 3u);   // A, then B, then A again
    EXPECT_EQ(coordinator_counter(g.socket_dir(), "conversation_cache_entries"), 1u);
    EXPECT_GT(instance_counter(g.socket_dir(), group::kGpuWorkerInstance, "conversation_cache_bytes"), 0u);
    std::printf("%s: follow-ups of two conversations with %u and %u cached tokens, %llu bytes saved\n", c.model,
                fa.cached_tokens, fb.cached_tokens,
                static_cast<unsigned long long>(coordinator_counter(g.socket_dir(), "conversation_cache_bytes")));
    g.stop();
  }
  Group fresh(o);
  EXPECT_EQ(generate(fresh.socket_dir(), qa, n).ids, fa.ids) << "conversation A's follow-up differs from a fresh group's";
  EXPECT_EQ(generate(fresh.socket_dir(), qb, n).ids, fb.ids) << "conversation B's follow-up differs from a fresh group's";
  fresh.stop();
}

TEST_P(ConversationCache, ABudgetForOneEvictsTheOlder) {
  const Case c = GetParam();
  const std::string dir = temp_dir(std::string("evict-") + c.model);
  GroupOptions o;
  o.model = convert_golden(c.model, golden_quant_args("kmix"), dir);
  std::vector<int32_t> p[3];
  p[0] = golden_prompt(c.model);
  p[0].insert(p[0].end(), p[0].begin(), p[0].end());
  for (int k = 1; k < 3; ++k)
    for (int32_t t : p[0]) p[k].push_back(5 + k + (t * (11 + k)) % 80);
  constexpr int n = 4;
  uint64_t one = 0;
  {   // what one saved conversation takes
    Group g(o);
    ASSERT_TRUE(generate(g.socket_dir(), p[0], n).error.empty());
    ASSERT_TRUE(generate(g.socket_dir(), p[1], n).error.empty());
    one = coordinator_counter(g.socket_dir(), "conversation_cache_bytes");
    g.stop();
  }
  ASSERT_GT(one, 0u);
  o.extra_args = {"--cache-ram", std::to_string(one + one / 2)};
  Group g(o);
  std::vector<Generation> first;
  for (const auto& q : p) first.push_back(generate(g.socket_dir(), q, n));   // saves 0, then 1 (0 out)
  EXPECT_EQ(coordinator_counter(g.socket_dir(), "conversation_cache_evictions"), 1u);
  EXPECT_EQ(coordinator_counter(g.socket_dir(), "conversation_cache_entries"), 1u);
  std::vector<int32_t> q0 = p[0], q1 = p[1];
  q0.insert(q0.end(), first[0].ids.begin(), first[0].ids.end());
  q1.insert(q1.end(), first[1].ids.begin(), first[1].ids.end());
  q0.push_back(9), q1.push_back(9);
  EXPECT_EQ(generate(g.socket_dir(), q1, n).cached_tokens, p[1].size() + first[1].ids.size() - 1);
  EXPECT_EQ(generate(g.socket_dir(), q0, n).cached_tokens, 0u) << "the oldest conversation should have been evicted";
  g.stop();
}

INSTANTIATE_TEST_SUITE_P(Models, ConversationCache,
                         ::testing::Values(Case{"qwen3moe_k256", false}, Case{"qwen3next_k256", true}),
                         [](const auto& param_info) { return std::string(param_info.param.model); });

INSTANTIATE_TEST_SUITE_P(Models, PrefixCache,
                         ::testing::Values(Case{"qwen3moe_k256", false}, Case{"qwen3next_k256", true}),
                         [](const auto& param_info) { return std::string(param_info.param.model); });

}  // namespace
}  // namespace moraine::group_test
