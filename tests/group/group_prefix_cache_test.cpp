// The coordinator's prefix cache (reuse_prefix): a request whose tokens begin with the cached
// sequence prefills only the rest, and its greedy tokens are those of the same prompt on a
// fresh group. An attention-only model (qwen3moe) reuses any common prefix (rewinding the KV
// cache); one with recurrent DeltaNet layers (qwen3next) only the whole cached sequence.
#include <gtest/gtest.h>

#include <cstdio>
#include <ostream>

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

INSTANTIATE_TEST_SUITE_P(Models, PrefixCache,
                         ::testing::Values(Case{"qwen3moe_k256", false}, Case{"qwen3next_k256", true}),
                         [](const auto& info) { return std::string(info.param.model); });

}  // namespace
}  // namespace moraine::group_test
