// Speculative decoding's host side (docs/design.md "Speculation"): a drafter that proposes what
// followed the longest earlier match of the context's suffix (code, quoted text and loops repeat),
// the acceptance rule of a greedy verify window, and the measured-cost policy that decides whether
// drafting pays on this model and host.
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
#include <utility>
#include <vector>

namespace moraine::group {

struct DraftOptions {
  int max_draft = 5;   // tokens proposed at most (the verify window is one more)
  int min_match = 1;   // the shortest suffix match that drafts
};

// A suffix automaton over a sequence (a request's prompt and the tokens accepted so far), grown a
// token at a time, whose states count their occurrences online. The draft: the longest suffix of
// the sequence that also occurs earlier, then, a token at a time, the continuation that followed
// the matched string most often (ties: the one seen last), up to max_draft tokens; where the
// string drafted so far occurs only at the end, from its longest suffix that occurs earlier too.
// So a loop's next laps, or the usual continuation of a phrase quoted several times, are
// proposed whole.
//
// Occurrence counts are the sizes of the states' end-position sets. Each new token adds its end
// position to every state on the suffix-link path from the new state to the root; a path that
// long (n / period states in a periodic text) walked per token would be quadratic, so the counts
// live in a link-cut tree over the suffix links, where a path update and a query are O(log n)
// amortised.
class SuffixDrafter {
 public:
  SuffixDrafter();
  void push(int32_t token);
  // Feeds context[size() ..]: the context must extend the tokens fed so far (a request's only
  // grows). Throws std::logic_error when it is shorter.
  void sync(std::span<const int32_t> context);
  size_t size() const { return n_; }
  // The draft after the tokens fed. Empty when no suffix of at least min_match tokens recurs.
  // Throws std::invalid_argument for max_draft < 1 or min_match < 1.
  std::vector<int32_t> draft(const DraftOptions& o);
  // The length of the longest suffix that occurs earlier too (0: none).
  int64_t match_length() const;
  // How often `s` occurs in the tokens fed (0 for an empty s).
  int64_t occurrences(std::span<const int32_t> s);

 private:
  struct State {
    int64_t len = 0;      // the longest string of the state
    int32_t link = -1;    // suffix link
    std::vector<std::pair<int32_t, int32_t>> next;   // (token, state), sorted by token
  };
  // The link-cut tree's node of a state: a splay tree per preferred path of the suffix-link tree,
  // and per node its occurrence count and last end position with their pending path updates.
  struct PathNode {
    int32_t child[2] = {-1, -1}, parent = -1;
    int64_t count = 0, count_tag = 0, last = -1, last_tag = -1;
  };
  int32_t transition(int32_t state, int32_t token) const;
  void set_transition(int32_t state, int32_t token, int32_t to);
  int32_t add_state(int64_t len);
  // The link-cut tree (tree edges: suffix links, rooted at state 0).
  bool is_path_root(int32_t x) const;
  void apply(int32_t x, int64_t count_add, int64_t last);
  void push_down(int32_t x);
  void rotate(int32_t x);
  void splay(int32_t x);
  void access(int32_t x);
  void cut_from_parent(int32_t x);
  std::pair<int64_t, int64_t> count_and_last(int32_t x);   // (occurrences, last end position)

  std::vector<State> states_;
  std::vector<PathNode> path_;
  std::vector<int32_t> splay_chain_;   // splay's scratch: a node and its splay-tree ancestors
  int32_t last_ = 0;    // the state of the whole sequence
  size_t n_ = 0;
};

// The MTP head's drafts from the last step's reply (StepReply::mtp_*, made by the gpu_worker): they
// follow logit row `row`'s greedy token, so for a step of n rows from position `first` with
// logit_rows logit rows, draft[0] would sit at context index first + (n - logit_rows + row) + 2.
class MtpDrafts {
 public:
  void clear() { at_ = -1; }
  // n_drafts -1: the reply has none (the head could not follow): false. std::runtime_error for a
  // reply that is not one the step asked for (more than max_drafts, a row outside the logit rows,
  // a token outside the vocabulary).
  bool take(int32_t n_drafts, int32_t row, const int32_t* drafts, int64_t first, int64_t n, int64_t logit_rows,
            int max_drafts, int64_t n_vocab);
  // At most `most` of them when they follow a context of `size` tokens; else none.
  std::vector<int32_t> after(int64_t size, int64_t most) const;

 private:
  std::vector<int32_t> drafts_;
  int64_t at_ = -1;
};

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
  // What should_verify would answer now, without counting a declined draft: a drafter whose drafts
  // cost a step's time (the MTP head's) is asked for them only then.
  bool will_verify() const;
  // A draft should_verify would have declined and that was therefore never made (counts toward the probe).
  void declined_unmade();
  void record_decode(double us);           // a one-token step took us
  // A verify step took us for `emitted` tokens; drafted (>= 0): its window held that many drafts,
  // of which emitted - 1 were accepted (for draft_length).
  void record_verify(double us, int64_t emitted, int64_t drafted = -1);
  double decode_us_per_token() const { return decode_; }
  double verify_us_per_token() const { return verify_; }

  // How many drafts (1..most) the next window should verify: the k that maximises the expected
  // tokens per microsecond E(k) / cost(k + 1), where E(k) = 1 + a + ... + a^k for the drafter's
  // measured acceptance a (accepted drafts over tested ones: a rejection ends a window's tests)
  // and cost(r) the line fitted through the mean measured time of steps of r rows (one-token
  // steps are r = 1; the coordinator times its own steps, so the fit is the current placement's:
  // all in VRAM a window's rows share the step's weight reads, from RAM or disk each row may add
  // experts). `most` until steps of two sizes are measured. Whether to verify at all (k = 0)
  // stays should_verify's: the measured time per token of both kinds of step.
  int draft_length(int most) const;
  double acceptance() const { return tested_ > 0 ? accepted_ / tested_ : 0.0; }
  // The fitted cost of a step of `rows` rows (us); negative until two sizes are measured.
  double step_cost(int64_t rows) const;

 private:
  static void update(double& avg, int& n, double x);
  void record_rows(int64_t rows, double us);
  double decode_ = 0, verify_ = 0;
  int n_decode_ = 0, n_verify_ = 0, skipped_ = 0;
  // Acceptance counts, decayed by 7/8 a window so that a change of context shows within ~8.
  double accepted_ = 0, tested_ = 0;
  std::vector<double> rows_us_;   // [r]: mean time of steps of r rows (update's average)
  std::vector<int> rows_n_;
};

}  // namespace moraine::group
