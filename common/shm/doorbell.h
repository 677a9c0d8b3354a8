#pragma once
// Sequence-number doorbell for the per-layer hand-off between processes (docs/design.md "How they
// talk": the decode step crosses between GPU and CPU twice per layer, so the hop must cost little).
// One cache line per channel in a shared-memory segment. The producer stores a larger sequence
// number and issues FUTEX_WAKE only when a waiter has gone to sleep; the waiter spins for a short
// budget (the other side usually answers within microseconds), then sleeps in FUTEX_WAIT on the
// low 32 bits of the sequence number. Waits are always bounded: a dead producer is a timeout.
//
// Why: a spin-then-futex round trip is 0.29 us p50 against 31-56 us for ZeroMQ ipc (0.1% vs 15-27%
// of a 10 ms decode step at 96 hops); the futex saves the core during long expert batches
// (docs/perf-log.md#doorbell-round-trips).
#include <atomic>
#include <chrono>
#include <cstdint>

namespace moraine::shm {

enum class WaitResult { kReady, kTimedOut };

struct WaitStats {
  std::uint64_t observed = 0;   // sequence number seen when the wait ended
  bool slept = false;           // went to FUTEX_WAIT at least once
};

class alignas(64) Doorbell {
 public:
  // Constructs a doorbell in place (the segment creator does this once, at session start).
  static Doorbell* init_at(void* where, std::uint64_t initial = 0);
  // A doorbell made by another process inside a mapped segment.
  static Doorbell* at(void* where) { return static_cast<Doorbell*>(where); }

  // Publishes `value` (must not go backwards) and wakes sleepers. Release semantics: data written
  // before ring() is visible to a waiter that sees `value`.
  void ring(std::uint64_t value);
  std::uint64_t load() const { return seq_.load(std::memory_order_acquire); }

  // Waits until the sequence number is >= target. Spins for spin_budget, then futex-waits.
  WaitResult wait_for(std::uint64_t target, std::chrono::nanoseconds timeout,
                      std::chrono::nanoseconds spin_budget = std::chrono::microseconds(20),
                      WaitStats* stats = nullptr);

 private:
  Doorbell() = default;
  std::uint32_t* futex_word() { return reinterpret_cast<std::uint32_t*>(&seq_); }

  std::atomic<std::uint64_t> seq_{0};
  std::atomic<std::uint32_t> sleepers_{0};
};

static_assert(sizeof(Doorbell) == 64, "one doorbell per cache line: neighbours must not false-share");
static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "the doorbell must be lock-free to work across processes");

}  // namespace moraine::shm
