#include "common/shm/doorbell.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <climits>
#include <ctime>
#include <new>

#include "common/shm/shm_error.h"

namespace moraine::shm {

static_assert(std::endian::native == std::endian::little,
              "the futex word is the low half of the 64-bit sequence number");

namespace {

// Not FUTEX_PRIVATE_FLAG: the word is in memory shared between processes.
long futex_wait(std::uint32_t* word, std::uint32_t expected, const timespec* timeout) {
  return syscall(SYS_futex, word, FUTEX_WAIT, expected, timeout, nullptr, 0);
}

long futex_wake_all(std::uint32_t* word) {
  return syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

Doorbell* Doorbell::init_at(void* where, std::uint64_t initial) {
  auto* bell = new (where) Doorbell();
  bell->seq_.store(initial, std::memory_order_release);
  return bell;
}

void Doorbell::ring(std::uint64_t value) {
  // seq_cst store then seq_cst load of sleepers_, against the waiter's seq_cst increment of
  // sleepers_ then load of seq_: one of the two sides must see the other, so either the waiter
  // sees the new value before sleeping or we see the sleeper and wake it. FUTEX_WAIT re-checks
  // the word atomically, closing the gap between the waiter's check and its sleep.
  seq_.store(value, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) != 0) futex_wake_all(futex_word());
}

WaitResult Doorbell::wait_for(std::uint64_t target, std::chrono::nanoseconds timeout,
                              std::chrono::nanoseconds spin_budget, WaitStats* stats) {
  using Clock = std::chrono::steady_clock;
  std::uint64_t seen = seq_.load(std::memory_order_acquire);
  if (seen >= target) {
    if (stats) *stats = {seen, false};
    return WaitResult::kReady;
  }
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  // Spin: read the clock only every 64 pauses, it costs more than a pause.
  if (spin_budget.count() > 0) {
    const auto spin_end = start + std::min(spin_budget, timeout);
    for (;;) {
      for (int i = 0; i < 64; ++i) {
        cpu_relax();
        seen = seq_.load(std::memory_order_acquire);
        if (seen >= target) {
          if (stats) *stats = {seen, false};
          return WaitResult::kReady;
        }
      }
      if (Clock::now() >= spin_end) break;
    }
  }
  sleepers_.fetch_add(1, std::memory_order_seq_cst);
  WaitResult result = WaitResult::kReady;
  for (;;) {
    seen = seq_.load(std::memory_order_seq_cst);
    if (seen >= target) break;
    const auto now = Clock::now();
    if (now >= deadline) {
      result = WaitResult::kTimedOut;
      break;
    }
    const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now).count();
    const timespec relative{static_cast<time_t>(left / 1000000000), static_cast<long>(left % 1000000000)};
    if (futex_wait(futex_word(), static_cast<std::uint32_t>(seen), &relative) != 0 &&
        errno != EAGAIN && errno != EINTR && errno != ETIMEDOUT) {
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      throw_errno("futex wait on doorbell", errno);
    }
  }
  sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  if (stats) *stats = {seen, true};
  return result;
}

}  // namespace moraine::shm
