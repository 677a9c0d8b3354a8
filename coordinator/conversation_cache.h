// The conversation cache (--cache-ram), the coordinator's half: which sequences the gpu_worker
// holds saved (gpu_worker/sequence_store.h), by key, with their tokens and bytes, so that a
// request continuing any recent conversation (not only the last one) prefills only its new
// tokens. The live sequence (in the gpu_worker's KV cache) is not an entry: switching to an
// entry saves the live one first and loads the entry (StepHeader::state_save / state_load).
// Entries past the budget go least recently used first; their keys are dropped in later steps.
// With --parallel, a request waiting for its turn has its sequence here too, pinned: never
// evicted, never given to another request. Thread-safe (a cancelled waiter unpins its own).
#pragma once
#include <cstddef>
#include <cstdint>
#include <list>
#include <mutex>
#include <vector>

#include "coordinator/group_layout.h"

namespace moraine::group {

class ConversationCache {
 public:
  // recurrent: the model has recurrent layers, whose state cannot go back, so an entry is usable
  // only when all of it is a prefix of the prompt.
  ConversationCache(uint64_t budget_bytes, bool recurrent) : budget_(budget_bytes), recurrent_(recurrent) {}
  bool enabled() const { return budget_ > 0; }
  uint64_t budget() const { return budget_; }

  // How many of a prompt's first tokens a cached sequence covers usefully: the common prefix (at
  // most prompt.size() - 1: one token is always fed for the logits); 0 where a recurrent model's
  // sequence is not wholly a prefix of the prompt.
  size_t usable_prefix(const std::vector<int32_t>& cached, const std::vector<int32_t>& prompt) const;
  struct Match {
    uint64_t key = 0;   // 0: none
    size_t common = 0;
  };
  Match best(const std::vector<int32_t>& prompt) const;   // the entry with the longest usable prefix

  uint64_t new_key() {
    std::lock_guard l(mu_);
    return ++last_key_;
  }
  // A save of `tokens` under key took `bytes` in the gpu_worker: it becomes the most recent entry,
  // and the least recent unpinned ones past the budget are evicted (the new one too, if alone
  // over it and not pinned).
  void saved(uint64_t key, std::vector<int32_t> tokens, uint64_t bytes, bool pinned = false);
  // A pinned entry whose request gave up: an ordinary entry now (evicted if over the budget).
  void unpin(uint64_t key);
  // A load took key's entry out of the store: its tokens (now the live sequence's).
  std::vector<int32_t> take(uint64_t key);
  // Whether key's entry is here: a save whose step failed (a gpu_worker lost) never became one.
  bool holds(uint64_t key) const;
  // The key's entry, whether the gpu_worker kept it or not (a failed step): forget it and drop it.
  void forget(uint64_t key);
  void forget_unpinned();   // a failed step: every unpinned entry goes (its key is dropped)
  // Up to kMaxStateDrops keys for the next step's StepHeader::state_drop (the rest wait).
  void pop_drops(uint64_t (&out)[kMaxStateDrops]);

  uint64_t bytes() const;
  size_t size() const;
  uint64_t evictions() const;

 private:
  struct Entry {
    uint64_t key;
    std::vector<int32_t> tokens;
    uint64_t bytes;
    bool pinned;
  };
  void evict_over_budget();   // under mu_
  mutable std::mutex mu_;
  uint64_t budget_;
  bool recurrent_;
  std::list<Entry> entries_;   // most recently used first
  std::vector<uint64_t> drops_;
  uint64_t bytes_ = 0, last_key_ = 0, evictions_ = 0;
};

}  // namespace moraine::group
