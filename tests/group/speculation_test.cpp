// The coordinator's speculation pieces on their own (coordinator/speculation.h): prompt-lookup
// drafts, the verify window's acceptance rule and the measured-cost policy.
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "coordinator/speculation.h"

namespace moraine::group {
namespace {

using V = std::vector<int32_t>;

TEST(LookupDraft, ProposesWhatFollowedTheLatestEarlierOccurrence) {
  // Suffix "1 2" occurs at 0 (followed by 3 4 5) and at 5 (followed by 9 8): the latest wins.
  const V ctx{1, 2, 3, 4, 5, 1, 2, 9, 8, 7, 1, 2};
  EXPECT_EQ(lookup_draft(ctx, {4, 2, 1}), (V{9, 8, 7, 1}));
  EXPECT_EQ(lookup_draft(ctx, {2, 2, 1}), (V{9, 8}));
}

TEST(LookupDraft, PrefersTheLongestSuffix) {
  // "5 6" matched by 2 tokens at 0 (-> 7), by the 1-gram "6" latest at 4 (-> 1).
  const V ctx{5, 6, 7, 0, 6, 1, 2, 5, 6};
  EXPECT_EQ(lookup_draft(ctx, {1, 2, 1}), (V{7}));
  EXPECT_EQ(lookup_draft(ctx, {1, 1, 1}), (V{1}));
  // min_ngram 2: no 1-gram fallback.
  EXPECT_EQ(lookup_draft(V{4, 6, 1, 2, 5, 6}, {3, 2, 2}), V{});
  EXPECT_EQ(lookup_draft(V{4, 6, 1, 2, 5, 6}, {3, 2, 1}), (V{1, 2, 5}));
}

TEST(LookupDraft, DraftStopsAtTheContextEndAndNeedsARecurrence) {
  // A loop: "3 4" last seen just before the suffix; what followed runs into the suffix itself.
  EXPECT_EQ(lookup_draft(V{3, 4, 3, 4}, {5, 2, 1}), (V{3, 4}));
  EXPECT_EQ(lookup_draft(V{7, 7}, {4, 3, 1}), (V{7}));
  EXPECT_EQ(lookup_draft(V{1, 2, 3, 4}, {4, 3, 1}), V{});
  EXPECT_EQ(lookup_draft(V{1}, {4, 3, 1}), V{});
  EXPECT_EQ(lookup_draft(V{}, {4, 3, 1}), V{});
}

TEST(LookupDraft, RejectsBadOptions) {
  EXPECT_THROW(lookup_draft(V{1, 1}, {0, 3, 1}), std::invalid_argument);
  EXPECT_THROW(lookup_draft(V{1, 1}, {4, 3, 0}), std::invalid_argument);
  EXPECT_THROW(lookup_draft(V{1, 1}, {4, 1, 2}), std::invalid_argument);
}

TEST(AcceptedPrefix, CountsLeadingAgreement) {
  EXPECT_EQ(accepted_prefix(V{5, 6, 7}, V{5, 6, 7, 8}), 3u);
  EXPECT_EQ(accepted_prefix(V{5, 6, 7}, V{5, 9, 7, 8}), 1u);   // agreement after a miss does not count
  EXPECT_EQ(accepted_prefix(V{5, 6, 7}, V{1, 6, 7, 8}), 0u);
  EXPECT_EQ(accepted_prefix(V{}, V{4}), 0u);
  EXPECT_THROW(accepted_prefix(V{5, 6}, V{5, 6}), std::invalid_argument);
}

TEST(DraftPolicy, MeasuresBothStepsThenKeepsTheCheaper) {
  DraftPolicy p;
  // Warm-up: kWarmup verifies, then kWarmup plain steps, whatever they cost.
  for (int i = 0; i < DraftPolicy::kWarmup; ++i) {
    ASSERT_TRUE(p.should_verify()) << i;
    p.record_verify(900, 1);   // a window that emitted one token: 900 us per token
  }
  for (int i = 0; i < DraftPolicy::kWarmup; ++i) {
    ASSERT_FALSE(p.should_verify()) << i;
    p.record_decode(300);
  }
  EXPECT_DOUBLE_EQ(p.verify_us_per_token(), 900);
  EXPECT_DOUBLE_EQ(p.decode_us_per_token(), 300);
  // Verifying costs more per token: declined, but probed at the kRetryEvery-th declined draft.
  for (int i = 1; i < DraftPolicy::kRetryEvery; ++i) {
    ASSERT_FALSE(p.should_verify()) << i;
    p.record_decode(300);
  }
  ASSERT_TRUE(p.should_verify());
  p.record_verify(400, 4);   // the context turned repetitive: 4 tokens a window, 100 us each
  EXPECT_DOUBLE_EQ(p.verify_us_per_token(), 100);   // a probe that pays switches verifying on
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(p.should_verify());
  // Acceptance collapses (one token a window at 900 us): off again within a few windows.
  int windows = 0;
  while (p.should_verify() && windows < 10) {
    p.record_verify(900, 1);
    ++windows;
  }
  EXPECT_LE(windows, 4);
  EXPECT_GT(p.verify_us_per_token(), p.decode_us_per_token());
  EXPECT_THROW(p.record_verify(100, 0), std::invalid_argument);
}

}  // namespace
}  // namespace moraine::group
