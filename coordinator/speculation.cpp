#include "coordinator/speculation.h"

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

namespace moraine::group {

SuffixDrafter::SuffixDrafter() { add_state(0); }

int32_t SuffixDrafter::add_state(int64_t len) {
  states_.push_back({len, -1, {}});
  path_.emplace_back();
  return static_cast<int32_t>(states_.size() - 1);
}

int32_t SuffixDrafter::transition(int32_t state, int32_t token) const {
  const auto& next = states_[static_cast<size_t>(state)].next;
  const auto it = std::lower_bound(next.begin(), next.end(), std::make_pair(token, INT32_MIN));
  return it != next.end() && it->first == token ? it->second : -1;
}

void SuffixDrafter::set_transition(int32_t state, int32_t token, int32_t to) {
  auto& next = states_[static_cast<size_t>(state)].next;
  const auto it = std::lower_bound(next.begin(), next.end(), std::make_pair(token, INT32_MIN));
  if (it != next.end() && it->first == token) {
    it->second = to;
  } else {
    next.insert(it, {token, to});
  }
}

void SuffixDrafter::push(int32_t token) {
  const int64_t position = static_cast<int64_t>(n_++);   // the new token's end position
  const int32_t cur = add_state(states_[static_cast<size_t>(last_)].len + 1);
  int32_t p = last_;
  while (p != -1 && transition(p, token) < 0) {
    set_transition(p, token, cur);
    p = states_[static_cast<size_t>(p)].link;
  }
  int32_t link = 0;
  if (p != -1) {
    const int32_t q = transition(p, token);
    if (states_[static_cast<size_t>(p)].len + 1 == states_[static_cast<size_t>(q)].len) {
      link = q;
    } else {
      // q holds strings of two end-position classes now: the shorter ones move to a clone, which
      // has q's occurrences so far and takes q's place under q's link, with q beneath it.
      const auto [count, last] = count_and_last(q);
      const int32_t clone = add_state(states_[static_cast<size_t>(p)].len + 1);
      states_[static_cast<size_t>(clone)].next = states_[static_cast<size_t>(q)].next;
      states_[static_cast<size_t>(clone)].link = states_[static_cast<size_t>(q)].link;
      path_[static_cast<size_t>(clone)].count = count;
      path_[static_cast<size_t>(clone)].last = last;
      path_[static_cast<size_t>(clone)].parent = states_[static_cast<size_t>(q)].link;
      cut_from_parent(q);
      path_[static_cast<size_t>(q)].parent = clone;   // q is a root of the tree after the cut
      states_[static_cast<size_t>(q)].link = clone;
      while (p != -1 && transition(p, token) == q) {
        set_transition(p, token, clone);
        p = states_[static_cast<size_t>(p)].link;
      }
      link = clone;
    }
  }
  states_[static_cast<size_t>(cur)].link = link;
  path_[static_cast<size_t>(cur)].parent = link;   // a fresh node is its own splay tree
  // The new end position belongs to every state on the suffix-link path from cur to the root.
  access(cur);
  apply(cur, 1, position);
  last_ = cur;
}

void SuffixDrafter::sync(std::span<const int32_t> context) {
  if (context.size() < n_)
    throw std::logic_error("speculation: a context of " + std::to_string(context.size()) +
                           " tokens does not extend the drafter's " + std::to_string(n_));
  for (size_t i = n_; i < context.size(); ++i) push(context[i]);
}

int64_t SuffixDrafter::match_length() const {
  const int32_t link = states_[static_cast<size_t>(last_)].link;
  return link < 0 ? 0 : states_[static_cast<size_t>(link)].len;
}

std::vector<int32_t> SuffixDrafter::draft(const DraftOptions& o) {
  if (o.max_draft < 1 || o.min_match < 1)
    throw std::invalid_argument("speculation: need max_draft >= 1 and min_match >= 1 (got " +
                                std::to_string(o.max_draft) + ", " + std::to_string(o.min_match) + ")");
  std::vector<int32_t> out;
  if (match_length() < o.min_match) return out;
  // Every occurrence of the match but the last has a next token, so the walk starts with a choice.
  int32_t s = states_[static_cast<size_t>(last_)].link;
  while (static_cast<int>(out.size()) < o.max_draft) {
    // The string drafted so far occurs only at the end (a loop's lap ran into the present): go on
    // from its longest suffix that also occurs earlier, i.e. the suffix link.
    while (states_[static_cast<size_t>(s)].next.empty()) {
      s = states_[static_cast<size_t>(s)].link;
      if (s < 0 || states_[static_cast<size_t>(s)].len < o.min_match) return out;
    }
    int32_t best_token = -1, best_state = -1;
    std::pair<int64_t, int64_t> best{-1, -1};   // (occurrences, last end position): the larger wins
    // count_and_last restructures the link-cut tree only, never the transitions walked here.
    for (const auto& [token, to] : states_[static_cast<size_t>(s)].next) {
      const std::pair<int64_t, int64_t> score = count_and_last(to);
      if (score > best) {
        best = score;
        best_token = token;
        best_state = to;
      }
    }
    if (best_state < 0) break;
    out.push_back(best_token);
    s = best_state;
  }
  return out;
}

int64_t SuffixDrafter::occurrences(std::span<const int32_t> s) {
  if (s.empty()) return 0;
  int32_t state = 0;
  for (const int32_t t : s) {
    state = transition(state, t);
    if (state < 0) return 0;
  }
  return count_and_last(state).first;
}

bool SuffixDrafter::is_path_root(int32_t x) const {
  const int32_t p = path_[static_cast<size_t>(x)].parent;
  return p < 0 || (path_[static_cast<size_t>(p)].child[0] != x && path_[static_cast<size_t>(p)].child[1] != x);
}

void SuffixDrafter::apply(int32_t x, int64_t count_add, int64_t last) {
  if (x < 0) return;
  PathNode& n = path_[static_cast<size_t>(x)];
  n.count += count_add;
  n.count_tag += count_add;
  n.last = std::max(n.last, last);   // end positions only grow: a maximum is an assignment
  n.last_tag = std::max(n.last_tag, last);
}

void SuffixDrafter::push_down(int32_t x) {
  PathNode& n = path_[static_cast<size_t>(x)];
  if (n.count_tag == 0 && n.last_tag < 0) return;
  apply(n.child[0], n.count_tag, n.last_tag);
  apply(n.child[1], n.count_tag, n.last_tag);
  n.count_tag = 0;
  n.last_tag = -1;
}

void SuffixDrafter::rotate(int32_t x) {
  const int32_t p = path_[static_cast<size_t>(x)].parent, g = path_[static_cast<size_t>(p)].parent;
  const int side = path_[static_cast<size_t>(p)].child[1] == x ? 1 : 0;
  const int32_t b = path_[static_cast<size_t>(x)].child[1 - side];
  if (!is_path_root(p)) path_[static_cast<size_t>(g)].child[path_[static_cast<size_t>(g)].child[1] == p ? 1 : 0] = x;
  path_[static_cast<size_t>(x)].parent = g;
  path_[static_cast<size_t>(x)].child[1 - side] = p;
  path_[static_cast<size_t>(p)].parent = x;
  path_[static_cast<size_t>(p)].child[side] = b;
  if (b >= 0) path_[static_cast<size_t>(b)].parent = p;
}

void SuffixDrafter::splay(int32_t x) {
  // Pending updates come down from the splay tree's root first.
  splay_chain_.assign(1, x);
  for (int32_t y = x; !is_path_root(y); y = path_[static_cast<size_t>(y)].parent)
    splay_chain_.push_back(path_[static_cast<size_t>(y)].parent);
  for (auto it = splay_chain_.rbegin(); it != splay_chain_.rend(); ++it) push_down(*it);
  while (!is_path_root(x)) {
    const int32_t p = path_[static_cast<size_t>(x)].parent;
    if (!is_path_root(p)) {
      const int32_t g = path_[static_cast<size_t>(p)].parent;
      const bool zigzig = (path_[static_cast<size_t>(g)].child[1] == p) == (path_[static_cast<size_t>(p)].child[1] == x);
      rotate(zigzig ? p : x);
    }
    rotate(x);
  }
}

void SuffixDrafter::access(int32_t x) {
  // Makes the root .. x path one splay tree, rooted at x, with nothing deeper in it.
  for (int32_t below = -1, y = x; y >= 0; below = y, y = path_[static_cast<size_t>(y)].parent) {
    splay(y);
    path_[static_cast<size_t>(y)].child[1] = below;
  }
  splay(x);
}

void SuffixDrafter::cut_from_parent(int32_t x) {
  access(x);
  const int32_t above = path_[static_cast<size_t>(x)].child[0];
  if (above >= 0) path_[static_cast<size_t>(above)].parent = -1;
  path_[static_cast<size_t>(x)].child[0] = -1;
}

std::pair<int64_t, int64_t> SuffixDrafter::count_and_last(int32_t x) {
  access(x);
  return {path_[static_cast<size_t>(x)].count, path_[static_cast<size_t>(x)].last};
}

size_t accepted_prefix(std::span<const int32_t> draft, std::span<const int32_t> greedy) {
  if (greedy.size() != draft.size() + 1)
    throw std::invalid_argument("speculation: " + std::to_string(greedy.size()) + " greedy tokens for a draft of " +
                                std::to_string(draft.size()) + " (expected one more)");
  size_t j = 0;
  while (j < draft.size() && draft[j] == greedy[j]) ++j;
  return j;
}

void DraftPolicy::update(double& avg, int& n, double x) {
  // The first samples set the mean; later ones move it by 1/8: a few steps follow a change of
  // context (a loop starting or ending) without one slow step (a census merge) ruling it.
  ++n;
  avg = n <= kWarmup ? avg + (x - avg) / n : avg + (x - avg) / 8;
}

bool DraftPolicy::should_verify() {
  if (n_verify_ < kWarmup) return true;
  if (n_decode_ < kWarmup) return false;   // drafts may exist at every step: measure plain ones too
  if (verify_ < decode_) {
    skipped_ = 0;
    return true;
  }
  if (++skipped_ >= kRetryEvery) {
    skipped_ = 0;
    return true;
  }
  return false;
}

bool MtpDrafts::take(int32_t n_drafts, int32_t row, const int32_t* drafts, int64_t first, int64_t n, int64_t logit_rows,
                     int max_drafts, int64_t n_vocab) {
  at_ = -1;
  if (n_drafts < 0) return false;
  if (n_drafts > max_drafts || row < 0 || row >= logit_rows || logit_rows > n)
    throw std::runtime_error("gpu_worker: " + std::to_string(n_drafts) + " MTP drafts after logit row " + std::to_string(row) +
                             " of " + std::to_string(logit_rows) + " (asked for " + std::to_string(max_drafts) + ")");
  drafts_.assign(drafts, drafts + n_drafts);
  for (const int32_t t : drafts_)
    if (t < 0 || t >= n_vocab) throw std::runtime_error("gpu_worker: MTP draft " + std::to_string(t) + " is outside the vocabulary");
  at_ = first + (n - logit_rows + row) + 2;
  return true;
}

std::vector<int32_t> MtpDrafts::after(int64_t size, int64_t most) const {
  if (size != at_ || most <= 0) return {};
  return {drafts_.begin(), drafts_.begin() + std::min<int64_t>(most, static_cast<int64_t>(drafts_.size()))};
}

bool DraftPolicy::will_verify() const {
  if (n_verify_ < kWarmup) return true;
  if (n_decode_ < kWarmup) return false;
  return verify_ < decode_ || skipped_ + 1 >= kRetryEvery;
}

void DraftPolicy::declined_unmade() {   // should_verify's declining path, without the draft
  if (n_verify_ >= kWarmup && n_decode_ >= kWarmup && !will_verify()) ++skipped_;
}

void DraftPolicy::record_decode(double us) {
  update(decode_, n_decode_, us);
  record_rows(1, us);
}

void DraftPolicy::record_rows(int64_t rows, double us) {
  const size_t r = static_cast<size_t>(rows);
  if (rows_us_.size() <= r) {
    rows_us_.resize(r + 1, 0.0);
    rows_n_.resize(r + 1, 0);
  }
  update(rows_us_[r], rows_n_[r], us);
}

double DraftPolicy::step_cost(int64_t rows) const {
  // Least squares through the sizes measured, each once (a size measured often is not surer of
  // the line's slope than one measured a few times).
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (size_t r = 1; r < rows_us_.size(); ++r) {
    if (rows_n_[r] == 0) continue;
    const double x = static_cast<double>(r), y = rows_us_[r];
    n += 1, sx += x, sy += y, sxx += x * x, sxy += x * y;
  }
  if (n < 2) return -1.0;
  const double slope = std::max(0.0, (n * sxy - sx * sy) / (n * sxx - sx * sx));
  const double intercept = (sy - slope * sx) / n;
  return std::max(1e-3, intercept + slope * static_cast<double>(rows));
}

int DraftPolicy::draft_length(int most) const {
  if (most <= 1 || step_cost(1) < 0) return std::max(most, 1);
  const double a = std::min(acceptance(), 0.99);
  int best = 1;
  double best_rate = -1, expected = 1, power = 1;
  for (int k = 1; k <= most; ++k) {
    power *= a;
    expected += power;   // E(k): the window's tokens if each draft holds with probability a
    const double rate = expected / step_cost(k + 1);
    if (rate > best_rate * (1 + 1e-9)) {   // ties: the shorter window
      best_rate = rate;
      best = k;
    }
  }
  return best;
}

void DraftPolicy::record_verify(double us, int64_t emitted, int64_t drafted) {
  if (emitted < 1) throw std::invalid_argument("speculation: a verify step emits at least one token");
  if (drafted >= 0) {
    if (emitted > drafted + 1)
      throw std::invalid_argument("speculation: " + std::to_string(emitted) + " tokens from a window of " +
                                  std::to_string(drafted) + " drafts");
    const double ok = static_cast<double>(emitted - 1);
    accepted_ = accepted_ * 7 / 8 + ok;
    tested_ = tested_ * 7 / 8 + ok + (emitted - 1 < drafted ? 1 : 0);
    record_rows(drafted + 1, us);
  }
  const double x = us / static_cast<double>(emitted);
  // A probe that pays while verifying is declined switches it back on at once: the average of
  // windows from before the context changed would take ~10 probes (160 steps) to come down.
  if (n_verify_ >= kWarmup && n_decode_ >= kWarmup && verify_ >= decode_ && x < decode_) {
    ++n_verify_;
    verify_ = x;
    return;
  }
  update(verify_, n_verify_, x);
}

}  // namespace moraine::group
