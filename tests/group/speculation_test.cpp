// The coordinator's speculation pieces on their own (coordinator/speculation.h): the suffix
// drafter (checked against a brute-force search of every prefix of random texts), the verify
// window's acceptance rule and the measured-cost policy.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <stdexcept>
#include <utility>
#include <vector>

#include "coordinator/speculation.h"

namespace moraine::group {
namespace {

using V = std::vector<int32_t>;

V draft_of(const V& context, DraftOptions o = {}) {
  SuffixDrafter d;
  d.sync(context);
  return d.draft(o);
}

// The drafter's rule by brute force: the longest suffix that also ends earlier (at least
// min_match tokens), then each next token by (occurrences of the string so far followed by it,
// the later end of such an occurrence); a string followed by nothing gives way to its longest
// suffix (of at least min_match) that is followed by something.
V brute_force_draft(const V& t, DraftOptions o) {
  const int64_t n = static_cast<int64_t>(t.size());
  const auto occurs_at = [&](const V& w, int64_t end) {   // w == t[end - |w| + 1 .. end]
    const int64_t len = static_cast<int64_t>(w.size());
    return end + 1 >= len && std::equal(w.begin(), w.end(), t.begin() + (end + 1 - len));
  };
  V w;
  for (int64_t len = n - 1; len >= o.min_match && w.empty(); --len) {
    const V suffix(t.end() - len, t.end());
    for (int64_t end = len - 1; end <= n - 2; ++end) {
      if (occurs_at(suffix, end)) {
        w = suffix;
        break;
      }
    }
  }
  V out;
  if (w.empty()) return out;
  while (static_cast<int>(out.size()) < o.max_draft) {
    std::map<int32_t, std::pair<int64_t, int64_t>> follow;   // token -> (count, last end)
    for (int64_t end = 0; end <= n - 2; ++end) {
      if (!occurs_at(w, end)) continue;
      auto& [count, last] = follow[t[static_cast<size_t>(end + 1)]];
      ++count;
      last = end + 1;
    }
    if (follow.empty()) {
      V shorter;
      for (int64_t len = static_cast<int64_t>(w.size()) - 1; len >= o.min_match && shorter.empty(); --len) {
        const V suffix(w.end() - len, w.end());
        for (int64_t end = len - 1; end <= n - 2; ++end) {
          if (occurs_at(suffix, end)) {
            shorter = suffix;
            break;
          }
        }
      }
      if (shorter.empty()) break;
      w = shorter;
      continue;
    }
    const auto best = std::max_element(follow.begin(), follow.end(),
                                       [](const auto& a, const auto& b) { return a.second < b.second; });
    out.push_back(best->first);
    w.push_back(best->first);
  }
  return out;
}

int64_t brute_force_occurrences(const V& t, const V& s) {
  int64_t c = 0;
  for (size_t at = 0; at + s.size() <= t.size(); ++at) c += std::equal(s.begin(), s.end(), t.begin() + at) ? 1 : 0;
  return c;
}

TEST(SuffixDrafter, ProposesTheNextLapOfRepeatedText) {
  // "1 2 3" recurs: what followed it, through the suffix itself (a loop's next lap).
  EXPECT_EQ(draft_of(V{1, 2, 3, 4, 5, 6, 1, 2, 3}), (V{4, 5, 6, 1, 2}));
  EXPECT_EQ(draft_of(V{1, 2, 3, 4, 5, 6, 1, 2, 3}, {2, 1}), (V{4, 5}));
  // A lap that runs into the present goes on from the shorter match: the loop again.
  EXPECT_EQ(draft_of(V{3, 4, 3, 4}), (V{3, 4, 3, 4, 3}));
  EXPECT_EQ(draft_of(V{7, 7}), (V{7, 7, 7, 7, 7}));
}

TEST(SuffixDrafter, PicksTheMostFrequentContinuationThenTheLatest) {
  // "7 1" was followed by 9 twice and by 8 once (last): frequency first. After "7 1 9 7 1" the
  // continuations 9 and 8 are once each: the later one.
  const V ctx{7, 1, 9, 7, 1, 9, 7, 1, 8, 7, 1};
  EXPECT_EQ(draft_of(ctx), (V{9, 7, 1, 8, 7}));
  // "5 1" -> 2 once and 3 once: the later one, then what followed it up to the end, then "5 1"
  // again (-> 3, the later).
  EXPECT_EQ(draft_of(V{5, 1, 2, 5, 1, 3, 5, 1}), (V{3, 5, 1, 3, 5}));
}

TEST(SuffixDrafter, FollowsTheLongestMatch) {
  // "5 6" matched whole at 0 (-> 7), although "6" alone is followed by 1 more recently.
  EXPECT_EQ(draft_of(V{5, 6, 7, 0, 6, 1, 2, 5, 6}, {1, 1}), (V{7}));
  EXPECT_EQ(draft_of(V{4, 6, 1, 2, 5, 6}, {5, 1}), (V{1, 2, 5, 6, 1}));
}

TEST(SuffixDrafter, ProposesNothingWithoutAMatch) {
  EXPECT_EQ(draft_of(V{1, 2, 3, 4}), V{});
  EXPECT_EQ(draft_of(V{1}), V{});
  EXPECT_EQ(draft_of(V{}), V{});
  EXPECT_EQ(draft_of(V{4, 6, 1, 2, 5, 6}, {5, 2}), V{});   // the match "6" is shorter than min_match
  SuffixDrafter d;
  d.sync(V{1, 2, 1});
  EXPECT_EQ(d.match_length(), 1);
  EXPECT_THROW(d.draft({0, 1}), std::invalid_argument);
  EXPECT_THROW(d.draft({4, 0}), std::invalid_argument);
  EXPECT_THROW(d.sync(V{1, 2}), std::logic_error);   // not an extension of what it was fed
}

TEST(SuffixDrafter, IncrementalDraftsEqualARebuildAndTheBruteForce) {
  // Small alphabets make long, frequent and tied matches; every prefix is checked.
  for (const int alphabet : {2, 3, 5, 40}) {
    std::mt19937 rng(static_cast<uint32_t>(alphabet));
    std::uniform_int_distribution<int32_t> token(0, alphabet - 1);
    V text;
    SuffixDrafter incremental;
    for (int i = 0; i < 260; ++i) {
      text.push_back(token(rng));
      if (i % 50 == 49) text.insert(text.end(), text.end() - 20, text.end());   // a repeat of the last 20
      incremental.sync(text);
      const DraftOptions o{5, 1 + i % 3};
      const V got = incremental.draft(o);
      ASSERT_EQ(got, draft_of(text, o)) << "alphabet " << alphabet << ", " << text.size() << " tokens";
      ASSERT_EQ(got, brute_force_draft(text, o)) << "alphabet " << alphabet << ", " << text.size() << " tokens";
    }
    for (int k = 0; k < 200; ++k) {   // occurrence counts of substrings and of strings not in it
      const size_t len = 1 + static_cast<size_t>(k % 6), at = static_cast<size_t>(rng() % (text.size() - len));
      V s(text.begin() + static_cast<std::ptrdiff_t>(at), text.begin() + static_cast<std::ptrdiff_t>(at + len));
      if (k % 4 == 0) s.back() = token(rng);
      ASSERT_EQ(incremental.occurrences(s), brute_force_occurrences(text, s)) << "alphabet " << alphabet;
    }
  }
}

TEST(SuffixDrafter, CountsAPeriodicTextExactly) {
  // Period 1 and 2: the suffix-link paths are n / period states long, updated per token.
  for (const int period : {1, 2}) {
    SuffixDrafter d;
    const int64_t n = 50000;
    for (int64_t i = 0; i < n; ++i) d.push(static_cast<int32_t>(i % period));
    EXPECT_EQ(d.match_length(), n - period);
    EXPECT_EQ(d.occurrences(V{0}), n / period);
    EXPECT_EQ(d.occurrences(V(static_cast<size_t>(1000 * period), 0)), period == 1 ? n - 999 : 0);
    EXPECT_EQ(d.draft({5, 1}), period == 1 ? (V{0, 0, 0, 0, 0}) : (V{0, 1, 0, 1, 0}));
  }
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


// The window length: the k of most expected tokens per microsecond. Windows of 4 drafts that each
// accept one (a = 1/2: one accepted per two tested), one-token steps of 1000 us, 5-row windows of
// `window_us`: the line through them prices every size. All in VRAM (rows share the weight
// reads: 50 us a row) E(k) / cost(k + 1) is 1.5/1050, 1.75/1100, 1.875/1150, 1.9375/1200 for
// k = 1..4: 3 drafts; where each row brings experts from RAM (900 us a row) 1 draft.
TEST(DraftPolicy, DraftLengthFromAcceptanceAndTheStepCosts) {
  const auto policy = [](double window_us, int64_t emitted) {
    DraftPolicy p;
    for (int i = 0; i < 6; ++i) {
      p.record_verify(window_us, emitted, 4);
      p.record_decode(1000);
    }
    return p;
  };
  EXPECT_EQ(DraftPolicy().draft_length(5), 5);   // nothing measured: the longest window
  DraftPolicy only_windows;
  only_windows.record_verify(1200, 2, 4);
  EXPECT_EQ(only_windows.draft_length(5), 5);   // one size measured: no line yet
  EXPECT_LT(only_windows.step_cost(3), 0.0);
  const DraftPolicy vram = policy(1200, 2);
  EXPECT_DOUBLE_EQ(vram.acceptance(), 0.5);
  EXPECT_NEAR(vram.step_cost(3), 1100, 1e-6);
  EXPECT_EQ(vram.draft_length(5), 3);
  EXPECT_EQ(vram.draft_length(2), 2);   // capped by what the caller can draft
  const DraftPolicy ram = policy(1000 + 4 * 900, 2);
  EXPECT_EQ(ram.draft_length(5), 1);
  // Every draft accepted: the longest window; none: the cheapest one (should_verify decides k = 0).
  EXPECT_EQ(policy(1200, 5).draft_length(5), 5);
  EXPECT_EQ(policy(1200, 1).draft_length(5), 1);
  DraftPolicy p;
  EXPECT_THROW(p.record_verify(100, 4, 2), std::invalid_argument);   // more tokens than a window gives
}

// A drafter asked for drafts only where the policy will verify them (the MTP head): will_verify
// says so without counting, declined_unmade counts the drafts never made, so the probe still comes.
TEST(DraftPolicy, WillVerifyPredictsAndUnmadeDraftsReachTheProbe) {
  DraftPolicy p;
  for (int i = 0; i < DraftPolicy::kWarmup; ++i) {
    ASSERT_TRUE(p.will_verify()) << i;
    ASSERT_TRUE(p.should_verify()) << i;
    p.record_verify(900, 1);
  }
  for (int i = 0; i < DraftPolicy::kWarmup; ++i) {
    ASSERT_FALSE(p.will_verify()) << i;
    p.declined_unmade();
    p.record_decode(300);
  }
  // Declined from here on: no drafts asked until the probe, which will_verify announces.
  int unmade = 0;
  while (!p.will_verify() && unmade < 100) {
    EXPECT_FALSE(p.will_verify());   // asking again changes nothing
    p.declined_unmade();
    p.record_decode(300);
    ++unmade;
  }
  EXPECT_EQ(unmade, DraftPolicy::kRetryEvery - 1);
  ASSERT_TRUE(p.should_verify());   // the probe's draft is verified
  p.record_verify(400, 4);
  EXPECT_TRUE(p.will_verify());
  EXPECT_TRUE(p.should_verify());
}


// Where the MTP head's drafts go: after a one-token step at position 9 they follow context index 10
// (the step's greedy token), after a verify window of rows [t, d0, d1, d2] from position 20 whose
// first rejected row is 1 they follow 20 + 1 + 1 + 1 = 23; a reply without drafts, or one the step
// did not ask for, gives none.
TEST(MtpDrafts, FollowTheRowDecodeGoesOnFrom) {
  MtpDrafts d;
  const int32_t drafts[3] = {4, 5, 6};
  ASSERT_TRUE(d.take(3, 0, drafts, 9, 1, 1, 3, 100));
  EXPECT_EQ(d.after(11, 3), (std::vector<int32_t>{4, 5, 6}));
  EXPECT_EQ(d.after(11, 2), (std::vector<int32_t>{4, 5}));
  EXPECT_TRUE(d.after(10, 3).empty());
  ASSERT_TRUE(d.take(2, 1, drafts, 20, 4, 4, 3, 100));
  EXPECT_EQ(d.after(23, 3), (std::vector<int32_t>{4, 5}));
  EXPECT_TRUE(d.after(25, 3).empty());
  // Two pending tokens (a DeltaNet rewind fed them again) then 3 drafts: rows 1..4 have logits.
  ASSERT_TRUE(d.take(1, 3, drafts, 30, 5, 4, 3, 100));
  EXPECT_EQ(d.after(30 + (5 - 4 + 3) + 2, 3), (std::vector<int32_t>{4}));
  EXPECT_FALSE(d.take(-1, -1, drafts, 9, 1, 1, 3, 100));
  EXPECT_TRUE(d.after(11, 3).empty());
  EXPECT_THROW(d.take(4, 0, drafts, 9, 1, 1, 3, 100), std::runtime_error);   // more than asked
  EXPECT_THROW(d.take(1, 1, drafts, 9, 1, 1, 3, 100), std::runtime_error);   // row outside the logit rows
  EXPECT_THROW(d.take(3, 0, drafts, 9, 1, 1, 3, 5), std::runtime_error);     // a token outside the vocabulary
  d.clear();
  EXPECT_TRUE(d.after(11, 3).empty());
}

}  // namespace
}  // namespace moraine::group
