// The FILE tier's cache directory: one header per file-cache slot of the arena (ArenaLayout's
// directory), in shared memory, so that every process mapping the arena can tell which expert a
// slot holds and whether its bytes are whole. The header's sequence number is a seqlock: odd
// while the slot is refilled, bumped to the next even number when the fill ends. A reader takes
// the number before it uses the bytes (snapshot) and checks it after (still_valid): unchanged
// means no refill began in between, so what it read was that expert's bytes whole.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "coordinator/placement.h"   // kCacheSlotHeaderBytes

namespace moraine::group {

struct CacheSlotHeader {
  std::atomic<std::uint64_t> seq;     // 0: never filled; odd: being filled; even: holds (layer, expert)
  std::atomic<std::int32_t> layer;    // -1 after an abandoned fill
  std::atomic<std::int32_t> expert;
  unsigned char pad[kCacheSlotHeaderBytes - 16];   // one cache line each: refills do not share lines
};
static_assert(sizeof(CacheSlotHeader) == kCacheSlotHeaderBytes);
// Lock-free atomics are address-free, so the same header works from every process's mapping.
static_assert(std::atomic<std::uint64_t>::is_always_lock_free && std::atomic<std::int32_t>::is_always_lock_free);

// A view of n headers at `base` (a zero-filled arena reads as n empty slots).
class CacheDirectory {
 public:
  CacheDirectory() = default;
  CacheDirectory(std::byte* base, std::int64_t n) : h_(reinterpret_cast<CacheSlotHeader*>(base)), n_(n) {}
  std::int64_t size() const { return n_; }

  // Nonzero (a token for still_valid) when slot s holds (layer, expert) whole now.
  std::uint64_t snapshot(std::int64_t s, std::int32_t layer, std::int32_t expert) const {
    const CacheSlotHeader& h = h_[s];
    const std::uint64_t seq = h.seq.load(std::memory_order_acquire);
    if (seq == 0 || (seq & 1) != 0) return 0;
    if (h.layer.load(std::memory_order_relaxed) != layer || h.expert.load(std::memory_order_relaxed) != expert) return 0;
    std::atomic_thread_fence(std::memory_order_acquire);
    return h.seq.load(std::memory_order_relaxed) == seq ? seq : 0;
  }
  // After the bytes were read: true when no refill of slot s began since snapshot gave `token`.
  bool still_valid(std::int64_t s, std::uint64_t token) const {
    std::atomic_thread_fence(std::memory_order_acquire);
    return h_[s].seq.load(std::memory_order_relaxed) == token;
  }
  // What slot s holds, for a process adopting a directory (a restarted worker): the sequence
  // number (odd: a fill its predecessor did not finish) and the identity.
  std::uint64_t seq(std::int64_t s) const { return h_[s].seq.load(std::memory_order_acquire); }
  std::int32_t layer(std::int64_t s) const { return h_[s].layer.load(std::memory_order_relaxed); }
  std::int32_t expert(std::int64_t s) const { return h_[s].expert.load(std::memory_order_relaxed); }

  // Marks slot s as being refilled with (layer, expert); false when another writer is filling it.
  bool begin_fill(std::int64_t s, std::int32_t layer, std::int32_t expert) {
    CacheSlotHeader& h = h_[s];
    std::uint64_t seq = h.seq.load(std::memory_order_relaxed);
    if ((seq & 1) != 0 || !h.seq.compare_exchange_strong(seq, seq + 1, std::memory_order_acq_rel)) return false;
    std::atomic_thread_fence(std::memory_order_release);   // the odd number before any byte of the fill
    h.layer.store(layer, std::memory_order_relaxed);
    h.expert.store(expert, std::memory_order_relaxed);
    return true;
  }
  // The fill begun last landed whole: readers may use it.
  void end_fill(std::int64_t s) { h_[s].seq.fetch_add(1, std::memory_order_release); }
  // The fill failed (or a predecessor died in it): the slot holds nothing.
  void abandon(std::int64_t s) {
    CacheSlotHeader& h = h_[s];
    h.layer.store(-1, std::memory_order_relaxed);
    h.expert.store(-1, std::memory_order_relaxed);
    if ((h.seq.load(std::memory_order_relaxed) & 1) != 0) h.seq.fetch_add(1, std::memory_order_release);
  }

 private:
  CacheSlotHeader* h_ = nullptr;
  std::int64_t n_ = 0;
};

}  // namespace moraine::group
