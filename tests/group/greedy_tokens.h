// Greedy decode with the gpu_worker picking the tokens (StepHeader::greedy_token), whichever
// backend it runs: the check group_test (CPU backend) and group_cuda_test (CUDA backend) share.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
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

}  // namespace moraine::group_test
