// Pinned worker threads with spin-then-futex waiting.
#include "kernels/cpu/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

#include "kernels/cpu/cpu_topology.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace moraine::cpu {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// How long a thread spins before it sleeps. Phases of one layer follow each other within a few
// microseconds, and a futex wake costs tens of microseconds of latency; 50 us of spinning
// covers the gap while keeping idle CPU use negligible (tests/cpu_kernels checks it).
constexpr auto kSpin = std::chrono::microseconds(50);

// Spins until `a` differs from `old` or kSpin passes; then sleeps until it does. Returns the new value.
template <typename T>
T await_change(const std::atomic<T>& a, T old) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  for (int i = 0;; ++i) {
    const T v = a.load(std::memory_order_acquire);
    if (v != old) return v;
    if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) break;
    cpu_relax();
  }
  for (;;) {
    a.wait(old, std::memory_order_acquire);
    const T v = a.load(std::memory_order_acquire);
    if (v != old) return v;
  }
}

}  // namespace

ThreadPool::ThreadPool(const std::vector<int>& cpus) : cpus_(cpus) {
  if (cpus.empty()) throw std::invalid_argument("ThreadPool: the CPU list is empty");
  std::vector<int> sorted = cpus;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    throw std::invalid_argument("ThreadPool: CPU list " + format_cpu_list(sorted) + " names a CPU twice");
  }
  const std::vector<int> allowed = allowed_cpus();
  for (int c : cpus) {
    if (!std::binary_search(allowed.begin(), allowed.end(), c)) {
      throw std::invalid_argument("ThreadPool: CPU " + std::to_string(c) + " is not one this process may use (allowed: " +
                                  format_cpu_list(allowed) + ")");
    }
  }
  slices_ = std::make_unique<Slice[]>(cpus.size());
  workers_.reserve(cpus.size());
  for (int i = 0; i < static_cast<int>(cpus.size()); ++i) {
    workers_.emplace_back([this, i] { worker_loop(i); });
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[static_cast<size_t>(i)], &set);
    const int rc = pthread_setaffinity_np(workers_.back().native_handle(), sizeof(set), &set);
    if (rc != 0) {
      // Stop the threads already started before reporting (a std::thread must not be destroyed joinable).
      shutdown();
      throw std::runtime_error("ThreadPool: pinning a thread to CPU " + std::to_string(cpus[static_cast<size_t>(i)]) +
                               " failed (error " + std::to_string(rc) + ")");
    }
  }
}

ThreadPool::~ThreadPool() { shutdown(); }

void ThreadPool::shutdown() {
  if (workers_.empty()) return;
  stop_ = true;
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  for (std::thread& t : workers_) {
    if (t.joinable()) t.join();
  }
  workers_.clear();
}

void ThreadPool::run_erased(int64_t n_jobs, const int64_t* slice_end, JobFn fn, void* ctx) {
  if (n_jobs <= 0) return;
  fn_ = fn;
  ctx_ = ctx;
  n_jobs_ = n_jobs;
  next_.store(0, std::memory_order_relaxed);
  sliced_ = slice_end != nullptr;
  if (sliced_) {
    int64_t begin = 0;
    for (int w = 0; w < size(); ++w) {
      slices_[w].next.store(begin, std::memory_order_relaxed);
      slices_[w].end = std::max(begin, slice_end[w]);
      begin = slices_[w].end;
    }
  }
  active_.store(size(), std::memory_order_relaxed);
  const uint32_t gen = generation_.fetch_add(1, std::memory_order_release) + 1;
  generation_.notify_all();
  uint32_t seen = finished_generation_.load(std::memory_order_acquire);
  if (seen == gen) return;
  if (caller_spin_us_ > kSpin.count()) {
    // The caller's longer window: the first kSpin polls only, then yields between polls.
    const auto start = std::chrono::steady_clock::now();
    const auto yield_from = start + kSpin, until = start + std::chrono::microseconds(caller_spin_us_);
    for (int i = 0;; ++i) {
      if (finished_generation_.load(std::memory_order_acquire) == gen) return;
      if ((i & 15) != 15) {
        cpu_relax();
        continue;
      }
      const auto now = std::chrono::steady_clock::now();
      if (now > until) break;
      if (now > yield_from) sched_yield();
    }
    seen = finished_generation_.load(std::memory_order_acquire);
  }
  while (seen != gen) seen = await_change(finished_generation_, seen);
}

void ThreadPool::worker_loop(int index) {
  uint32_t seen = 0;
  for (;;) {
    seen = await_change(generation_, seen);
    if (stop_) return;
    const JobFn fn = fn_;
    void* const ctx = ctx_;
    const int64_t n = n_jobs_;
    if (sliced_) {
      const int n_workers = size();
      for (int k = 0; k < n_workers; ++k) {
        Slice& sl = slices_[(index + k) % n_workers];
        for (int64_t i = sl.next.fetch_add(1, std::memory_order_relaxed); i < sl.end; i = sl.next.fetch_add(1, std::memory_order_relaxed)) {
          fn(ctx, i, index);
        }
      }
    } else {
      for (int64_t i = next_.fetch_add(1, std::memory_order_relaxed); i < n; i = next_.fetch_add(1, std::memory_order_relaxed)) {
        fn(ctx, i, index);
      }
    }
    // The last worker out publishes completion (release: the jobs' writes happen before).
    if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      finished_generation_.store(seen, std::memory_order_release);
      finished_generation_.notify_all();
    }
  }
}

}  // namespace moraine::cpu
