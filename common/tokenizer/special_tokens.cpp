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
  for (uint32_t i = 0; i < tokens_.size(); ++i) {
    by_first_byte_[static_cast<uint8_t>(tokens_[i].first[0])].push_back(i);
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
    const auto& candidates = by_first_byte_[static_cast<uint8_t>(text[p])];
    for (uint32_t i : candidates) {
      const std::string& t = tokens_[i].first;
      if (text.size() - p >= t.size() && text.compare(p, t.size(), t) == 0) found.emplace_back(i, p);
    }
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
