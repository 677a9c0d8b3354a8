// Greedy decode with the gpu_worker picking the tokens (StepHeader::greedy_token), whichever
// backend it runs: the check group_test (CPU backend) and group_cuda_test (CUDA backend) share.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "tests/group/group_harness.h"

namespace moraine::group_test {

// Starts the group `o` describes (no logits dump: the coordinator asks for tokens only) and
// generates `tokens` greedy tokens from `prompt` twice: plainly, then with check_logits
// (moraine-bench's default: the gpu_worker also checks the row for non-finite logits where it
// is). Both must be `want`, and every token the gpu_worker's (the coordinator's
// greedy_worker_tokens counter). Stops the group. A fatal failure returns early: call it under
// ASSERT_NO_FATAL_FAILURE.
inline void expect_worker_greedy_tokens(const GroupOptions& o, const std::vector<int32_t>& prompt,
                                        const std::vector<int32_t>& want, int tokens) {
  Group g(o);
  const Generation gen = generate(g.socket_dir(), prompt, tokens);
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, want);
  EXPECT_EQ(coordinator_counter(g.socket_dir(), "greedy_worker_tokens"), static_cast<uint64_t>(tokens));
  const Generation checked = generate(g.socket_dir(), prompt, tokens, /*check_logits=*/true);
  ASSERT_TRUE(checked.error.empty()) << checked.error;
  EXPECT_EQ(checked.ids, want);
  EXPECT_EQ(coordinator_counter(g.socket_dir(), "greedy_worker_tokens"), static_cast<uint64_t>(2 * tokens));
  g.stop();
}

// A prompt whose greedy continuation repeats itself, so that suffix drafts are accepted and,
// where the loop breaks, rejected: a unit of one or two tokens eight times. Random tiny models
// rarely repeat their output otherwise (the golden prompt's 32 greedy tokens hold no draft a
// lookup would get right). Found by simulating the drafter over the reference's greedy tokens
// (F32 cache) for prompts (t) x 8 and (t, t + 97) x 8, every 13th t (first for prompt lookup,
// qwen3moe_k256's again for the suffix drafter, which got all of (104, 201)'s first drafts right):
// - qwen3moe_odd (f32), (754, 851): 206 132 47 143 47 143 ... 47 143 361 687 194 699 47 143 ...,
//   17 acceptable drafts of 31;
// - qwen3moe_k256 (kmix weights), (170): 308 63 386 158 473 468 473 468 ... 473 595 276 595 276
//   595 33 10 ..., the suffix drafter's first 4 drafts (always verified: DraftPolicy) 14 of 20 right;
// - qwen3next_k256 (kmix weights), (299): 449 86 319 409 449 420 ... 562 3 13 499 240 464 173 562
//   3 13 499 240, one draft rejected (449 -> 420, the DeltaNet snapshot restored) and 4 accepted.
// Other models: (1, 2) (the tests that use it there expect no drafts).
inline std::vector<int32_t> repeating_prompt(const std::string& model) {
  const std::vector<int32_t> unit = model == "qwen3moe_odd"     ? std::vector<int32_t>{754, 851}
                                    : model == "qwen3moe_k256"  ? std::vector<int32_t>{170}
                                    : model == "qwen3next_k256" ? std::vector<int32_t>{299}
                                                                : std::vector<int32_t>{1, 2};
  std::vector<int32_t> p;
  for (int i = 0; i < 8; ++i) p.insert(p.end(), unit.begin(), unit.end());
  return p;
}

// Speculative decode (GenerateRequest::speculate) in the group `o` describes: `tokens` greedy
// tokens from `prompt`, plainly and with check_logits, must be `want` (the reference's greedy
// tokens) both times; the coordinator must have verified drafted windows, accepted some drafts
// and rejected some (the assertions that both paths ran: `want` must repeat itself and break the
// repetition, repeating_prompt). Stops the group.
inline void expect_speculative_tokens(const GroupOptions& o, const std::vector<int32_t>& prompt,
                                      const std::vector<int32_t>& want, int tokens) {
  Group g(o);
  for (const bool check : {false, true}) {
    const Generation gen = generate(g.socket_dir(), prompt, tokens, check, /*speculate=*/true);
    ASSERT_TRUE(gen.error.empty()) << gen.error;
    EXPECT_EQ(gen.ids, want) << (check ? "with" : "without") << " check_logits";
  }
  const uint64_t verified = coordinator_counter(g.socket_dir(), "verify_steps");
  const uint64_t drafted = coordinator_counter(g.socket_dir(), "drafted_tokens");
  const uint64_t accepted = coordinator_counter(g.socket_dir(), "accepted_draft_tokens");
  std::printf("speculation: %llu verify steps, %llu of %llu drafted tokens accepted\n",
              static_cast<unsigned long long>(verified), static_cast<unsigned long long>(accepted),
              static_cast<unsigned long long>(drafted));
  EXPECT_GT(verified, 0u);
  EXPECT_GE(drafted, verified);
  EXPECT_GT(accepted, 0u);
  EXPECT_GT(drafted, accepted);   // a rejection: the cache rewound (DeltaNet: the snapshot restored)
  // Every token is the gpu_worker's greedy token: one-token steps' and verified windows'.
  EXPECT_EQ(coordinator_counter(g.socket_dir(), "greedy_worker_tokens"), static_cast<uint64_t>(2 * tokens));
  g.stop();
}

}  // namespace moraine::group_test
