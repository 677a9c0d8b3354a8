#include "coordinator/conversation_cache.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

namespace moraine::group {

size_t ConversationCache::usable_prefix(const std::vector<int32_t>& cached, const std::vector<int32_t>& prompt) const {
  if (prompt.empty()) return 0;
  const size_t most = std::min(cached.size(), prompt.size() - 1);
  size_t common = 0;
  while (common < most && cached[common] == prompt[common]) ++common;
  if (recurrent_ && common != cached.size()) return 0;
  return common;
}

ConversationCache::Match ConversationCache::best(const std::vector<int32_t>& prompt) const {
  std::lock_guard l(mu_);
  Match m;
  for (const Entry& e : entries_) {
    if (e.pinned) continue;
    const size_t c = usable_prefix(e.tokens, prompt);
    if (c > m.common) m = {e.key, c};
  }
  return m;
}

void ConversationCache::saved(uint64_t key, std::vector<int32_t> tokens, uint64_t bytes, bool pinned) {
  std::lock_guard l(mu_);
  entries_.push_front({key, std::move(tokens), bytes, pinned});
  bytes_ += bytes;
  evict_over_budget();
}

void ConversationCache::evict_over_budget() {
  for (auto it = entries_.end(); bytes_ > budget_ && it != entries_.begin();) {
    --it;
    if (it->pinned) continue;
    drops_.push_back(it->key);
    bytes_ -= it->bytes;
    it = entries_.erase(it);
    ++evictions_;
  }
}

void ConversationCache::unpin(uint64_t key) {
  std::lock_guard l(mu_);
  for (Entry& e : entries_)
    if (e.key == key) e.pinned = false;
  evict_over_budget();
}

std::vector<int32_t> ConversationCache::take(uint64_t key) {
  std::lock_guard l(mu_);
  auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.key == key; });
  if (it == entries_.end()) throw std::logic_error("conversation cache: no entry " + std::to_string(key));
  std::vector<int32_t> tokens = std::move(it->tokens);
  bytes_ -= it->bytes;
  entries_.erase(it);
  return tokens;
}

bool ConversationCache::holds(uint64_t key) const {
  std::lock_guard l(mu_);
  return std::any_of(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.key == key; });
}

void ConversationCache::forget(uint64_t key) {
  if (key == 0) return;
  std::lock_guard l(mu_);
  auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.key == key; });
  if (it != entries_.end()) {
    bytes_ -= it->bytes;
    entries_.erase(it);
  }
  drops_.push_back(key);
}

void ConversationCache::forget_unpinned() {
  std::lock_guard l(mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->pinned) {
      ++it;
      continue;
    }
    drops_.push_back(it->key);
    bytes_ -= it->bytes;
    it = entries_.erase(it);
  }
}

uint64_t ConversationCache::bytes() const {
  std::lock_guard l(mu_);
  return bytes_;
}

size_t ConversationCache::size() const {
  std::lock_guard l(mu_);
  return entries_.size();
}

uint64_t ConversationCache::evictions() const {
  std::lock_guard l(mu_);
  return evictions_;
}

void ConversationCache::pop_drops(uint64_t (&out)[kMaxStateDrops]) {
  std::lock_guard l(mu_);
  std::fill(std::begin(out), std::end(out), uint64_t{0});
  const size_t n = std::min(drops_.size(), kMaxStateDrops);
  std::copy_n(drops_.begin(), n, out);
  drops_.erase(drops_.begin(), drops_.begin() + static_cast<std::ptrdiff_t>(n));
}

}  // namespace moraine::group
