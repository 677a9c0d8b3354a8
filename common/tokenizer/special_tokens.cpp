#include "common/tokenizer/special_tokens.h"

#include <algorithm>
#include <map>

namespace moraine::tokenizer {

SpecialTokenMatcher::SpecialTokenMatcher(std::vector<std::pair<std::string, TokenId>> tokens)
    : tokens_(std::move(tokens)) {
  std::erase_if(tokens_, [](const auto& t) { return t.first.empty(); });
  std::stable_sort(tokens_.begin(), tokens_.end(), [](const auto& a, const auto& b) {
    return a.first.size() != b.first.size() ? a.first.size() > b.first.size() : a.second < b.second;
  });
  sorted_.resize(tokens_.size());
  for (uint32_t i = 0; i < tokens_.size(); ++i) {
    sorted_[i] = i;
    starts_token_[static_cast<uint8_t>(tokens_[i].first[0])] = true;
  }
  std::sort(sorted_.begin(), sorted_.end(),
            [&](uint32_t a, uint32_t b) { return tokens_[a].first < tokens_[b].first; });
}

void SpecialTokenMatcher::occurrences_at(std::string_view text, size_t pos,
                                         std::vector<std::pair<uint32_t, size_t>>& found) const {
  // Invariant: [lo, hi) are the tokens whose first k bytes equal text[pos, pos + k). Sorted by
  // text, those of length exactly k come first (each one occurs here), the rest are ordered by
  // their byte at k.
  auto lo = sorted_.begin(), hi = sorted_.end();
  for (size_t k = 0; lo != hi; ++k) {
    while (lo != hi && tokens_[*lo].first.size() == k) found.emplace_back(*lo++, pos);
    if (lo == hi || pos + k >= text.size()) break;
    const auto byte_at = [&](uint32_t i) { return static_cast<uint8_t>(tokens_[i].first[k]); };
    const auto c = static_cast<uint8_t>(text[pos + k]);
    lo = std::partition_point(lo, hi, [&](uint32_t i) { return byte_at(i) < c; });
    hi = std::partition_point(lo, hi, [&](uint32_t i) { return byte_at(i) == c; });
  }
}

void SpecialTokenMatcher::partition(std::string_view text, std::vector<Fragment>& out) const {
  if (text.empty()) return;
  if (tokens_.empty()) {
    out.push_back({text, -1});
    return;
  }
  // Every occurrence of every token, as (priority, position). Only bytes that start some token
  // are examined, so plain text costs one table look-up per byte.
  std::vector<std::pair<uint32_t, size_t>> found;
  for (size_t p = 0; p < text.size(); ++p) {
    if (starts_token_[static_cast<uint8_t>(text[p])]) occurrences_at(text, p, found);
  }
  if (found.empty()) {
    out.push_back({text, -1});
    return;
  }
  std::sort(found.begin(), found.end());
  std::map<size_t, std::pair<size_t, uint32_t>> taken;  // start -> (end, token index)
  for (const auto& [i, start] : found) {
    const size_t end = start + tokens_[i].first.size();
    auto next = taken.lower_bound(start);
    if (next != taken.end() && next->first < end) continue;
    if (next != taken.begin() && std::prev(next)->second.first > start) continue;
    taken.emplace_hint(next, start, std::make_pair(end, i));
  }
  size_t pos = 0;
  for (const auto& [start, span] : taken) {
    if (start > pos) out.push_back({text.substr(pos, start - pos), -1});
    out.push_back({text.substr(start, span.first - start), tokens_[span.second].second});
    pos = span.first;
  }
  if (pos < text.size()) out.push_back({text.substr(pos), -1});
}

}  // namespace moraine::tokenizer
