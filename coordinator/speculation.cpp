#include "coordinator/speculation.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace moraine::group {

std::vector<int32_t> lookup_draft(std::span<const int32_t> context, const LookupOptions& o) {
  if (o.max_draft < 1 || o.min_ngram < 1 || o.max_ngram < o.min_ngram)
    throw std::invalid_argument("speculation: need max_draft >= 1 and 1 <= min_ngram <= max_ngram (got max_draft " +
                                std::to_string(o.max_draft) + ", ngram " + std::to_string(o.min_ngram) + ".." +
                                std::to_string(o.max_ngram) + ")");
  const int64_t size = static_cast<int64_t>(context.size());
  for (int64_t n = std::min<int64_t>(o.max_ngram, size - 1); n >= o.min_ngram; --n) {
    const std::span<const int32_t> suffix = context.subspan(static_cast<size_t>(size - n));
    // Latest match first: recent text predicts the next tokens best (a loop's last lap). A match
    // must leave at least one token after it before the suffix starts.
    for (int64_t at = size - n - 1; at >= 0; --at) {
      if (!std::equal(suffix.begin(), suffix.end(), context.begin() + at)) continue;
      const int64_t from = at + n, count = std::min<int64_t>(o.max_draft, size - from);
      return {context.begin() + from, context.begin() + from + count};
    }
  }
  return {};
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

void DraftPolicy::record_decode(double us) { update(decode_, n_decode_, us); }

void DraftPolicy::record_verify(double us, int64_t emitted) {
  if (emitted < 1) throw std::invalid_argument("speculation: a verify step emits at least one token");
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
