// Speculative decoding's host side (docs/design.md "Speculation"): a drafter that proposes the
// tokens that followed an earlier occurrence of the context's last n-gram (prompt lookup: code,
// quoted text and loops repeat), the acceptance rule of a greedy verify window, and the
// measured-cost policy that decides whether drafting pays on this model and host.
//
// A verify step runs the last sampled token and the draft d[0..k) as one step of k + 1 rows and
// returns each row's greedy token g[0..k]. g[i] is what greedy decode would pick after d[i-1]
// (after the last token for i = 0), so the output is d[0..j) then g[j], where j is the number of
// leading drafts with d[i] == g[i]: the same tokens greedy decode gives, one step for up to k + 1
// of them. What the step costs over a one-token step is mostly the extra experts the window
// routes to (uniform routing: up to k + 1 times the expert bytes; H200, 30B shape all in VRAM:
// steps of 1 / 2 / 3 / 5 / 8 tokens 2.20 / 2.95 / 4.34 / 5.71 / 7.92 ms,
// docs/perf-log.md#session-12-verify-window-cost), so it pays only where drafts are accepted: the
// policy compares the measured time per emitted token of both kinds of step.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace moraine::group {

struct LookupOptions {
  int max_draft = 4;   // tokens proposed at most (the verify window is one more)
  int max_ngram = 3;   // the longest suffix looked up first ...
  int min_ngram = 1;   // ... down to this length
};

// The draft for `context`: for n = max_ngram .. min_ngram, the latest earlier position where the
// context's last n tokens occur (not the suffix itself), and up to max_draft tokens that followed
// it there. Empty when no suffix recurs. Throws std::invalid_argument for options out of range
// (max_draft < 1, min_ngram < 1, max_ngram < min_ngram).
std::vector<int32_t> lookup_draft(std::span<const int32_t> context, const LookupOptions& o);

// How many of `draft` a verify window accepts: the leading i with draft[i] == greedy[i]
// (greedy has draft.size() + 1 entries: each row's greedy token).
size_t accepted_prefix(std::span<const int32_t> draft, std::span<const int32_t> greedy);

// Drafting on or off, from the time per emitted token measured for both kinds of step
// (exponential moving averages). Verifies the first kWarmup drafts, then declines drafts until
// kWarmup one-token steps are measured; then verifies only while a verify step's tokens come
// cheaper than one-token steps, with a verify every kRetryEvery drafts it declined so that a
// context turning repetitive is noticed again (a probe that pays switches verifying back on).
class DraftPolicy {
 public:
  static constexpr int kWarmup = 4;        // samples of each kind before the averages decide
  static constexpr int kRetryEvery = 16;   // skipped drafts between two probes
  bool should_verify();                    // a draft exists: verify it?
  void record_decode(double us);           // a one-token step took us
  void record_verify(double us, int64_t emitted);   // a verify step took us for `emitted` tokens
  double decode_us_per_token() const { return decode_; }
  double verify_us_per_token() const { return verify_; }

 private:
  static void update(double& avg, int& n, double x);
  double decode_ = 0, verify_ = 0;
  int n_decode_ = 0, n_verify_ = 0, skipped_ = 0;
};

}  // namespace moraine::group
