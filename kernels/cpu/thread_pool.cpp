// Pinned worker threads with spin-then-futex waiting.
#include "kernels/cpu/thread_pool.h"

#include <pthread.h>
#include <sched.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "kernels/cpu/cpu_topology.h"


namespace moraine::cpu {
namespace {

long involuntary_switches() {
  rusage ru{};
  getrusage(RUSAGE_THREAD, &ru);
  return ru.ru_nivcsw;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Per thread: whether its CPU is shared, from how long it waited runnable for a CPU (the
// scheduler's run_delay, /proc/thread-self/schedstat) over the last interval of >= 10 ms.
// Preemption while spinning is one sign; a spinner's late wake-ups after a sleep are the other
// (the scheduler favours tasks that sleep over tasks that spin), which no counter of this
// thread's switches shows. Over 2% of the interval spent waiting: shared. The read (a few us)
// happens at most once per interval, and when spin_poll sees an involuntary switch: then over
// 100 us of waiting since the last sample says shared, a kernel thread's few microseconds do not.
struct CpuShareMonitor {
  using Clock = std::chrono::steady_clock;
  int fd = -1;
  bool opened = false, shared = false;
  Clock::time_point last_at{};
  long long last_delay_ns = -1;

  ~CpuShareMonitor() {
    if (fd >= 0) close(fd);
  }
  long long run_delay_ns() {
    if (!opened) {
      opened = true;
      fd = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    }
    if (fd < 0) return -1;
    char buf[128];
    const ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    if (n <= 0) return -1;
    buf[n] = 0;
    long long on_cpu = 0, waiting = 0;
    if (std::sscanf(buf, "%lld %lld", &on_cpu, &waiting) != 2) return -1;
    return waiting;
  }
  bool cpu_shared(Clock::time_point now) {
    if (now - last_at < std::chrono::milliseconds(10)) return shared;
    const long long d = run_delay_ns();
    if (d >= 0 && last_delay_ns >= 0) {
      const double interval_ns = std::chrono::duration<double, std::nano>(now - last_at).count();
      shared = static_cast<double>(d - last_delay_ns) > 0.02 * interval_ns;
    }
    last_delay_ns = d;
    last_at = now;
    return shared;
  }
  // After an involuntary switch: whether this thread waited over 100 us for its CPU since the
  // last sample (then it is marked shared for the next interval).
  bool preempted_for_long(Clock::time_point now) {
    const long long d = run_delay_ns();
    if (d < 0 || last_delay_ns < 0 || d - last_delay_ns <= 100000) return false;
    shared = true;
    last_at = now;
    last_delay_ns = d;
    return true;
  }
};
thread_local CpuShareMonitor t_cpu_share;

// Polls `a` until it differs from `old` (spin_poll: spin_us at most), then sleeps until it
// does. Returns the new value.
template <typename T>
T await_change(const std::atomic<T>& a, T old, int spin_us, bool watch_sharing, std::atomic<uint64_t>& sleeps) {
  T v = old;
  if (spin_poll([&] { return (v = a.load(std::memory_order_acquire)) != old; }, spin_us, watch_sharing)) return v;
  sleeps.fetch_add(1, std::memory_order_relaxed);
  for (;;) {
    a.wait(old, std::memory_order_acquire);
    v = a.load(std::memory_order_acquire);
    if (v != old) return v;
  }
}

}  // namespace

namespace {
std::atomic<uint64_t> g_spins_cut_short{0};
// The poll ends early because the CPU is shared: counted when it ends without `ready`.
bool cut_short(bool (*ready)(const void* ctx), const void* ctx) {
  if (ready(ctx)) return true;
  g_spins_cut_short.fetch_add(1, std::memory_order_relaxed);
  return false;
}
}  // namespace

uint64_t spins_cut_short() { return g_spins_cut_short.load(std::memory_order_relaxed); }

bool spin_poll(bool (*ready)(const void* ctx), const void* ctx, int spin_us, bool watch_sharing) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  bool shortened = false;
  if (watch_sharing && spin_us > kShortSpinUs && t_cpu_share.cpu_shared(start)) {
    spin_us = kShortSpinUs;
    shortened = true;
  }
  const auto short_end = start + std::chrono::microseconds(std::min(spin_us, kShortSpinUs));
  const auto until = start + std::chrono::microseconds(spin_us);
  long switches = -1;  // read once the wait outlasts the short spin (most waits end before: no syscall)
  for (int i = 1;; ++i) {
    if (ready(ctx)) return true;
    cpu_relax();
    if ((i & 63) != 0) continue;
    const auto now = Clock::now();
    if (now >= until) return shortened ? cut_short(ready, ctx) : ready(ctx);
    if (now < short_end) continue;
    if (!watch_sharing) continue;
    if (switches < 0) {
      switches = involuntary_switches();
    } else if ((i & 511) == 0) {
      const long s = involuntary_switches();
      if (s != switches) {
        switches = s;
        if (t_cpu_share.preempted_for_long(now)) return cut_short(ready, ctx);
      }
    }
  }
}

ThreadPool::ThreadPool(const std::vector<int>& cpus, Options options)
    : cpus_(cpus), caller_joins_(options.caller_joins), first_thread_(options.caller_joins ? 1 : 0),
      spin_us_(std::max(0, options.spin_us)), watch_sharing_(options.watch_sharing) {
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
  slices_ = std::make_unique<Slice[]>(cpus.size() * kMaxSlicePhases);
  workers_.reserve(cpus.size());
  for (int i = first_thread_; i < static_cast<int>(cpus.size()); ++i) {
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

void ThreadPool::pin_caller() const {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpus_.front(), &set);
  const int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  if (rc != 0) {
    throw std::runtime_error("ThreadPool: pinning the calling thread to CPU " + std::to_string(cpus_.front()) + " failed (error " +
                             std::to_string(rc) + ")");
  }
}

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

void ThreadPool::run_erased(int64_t n_jobs, const int64_t* slice_end, int n_phases, JobFn fn, void* ctx) {
  if (slice_end && (n_phases < 1 || n_phases > kMaxSlicePhases)) {
    throw std::invalid_argument("ThreadPool::run_sliced_phases: " + std::to_string(n_phases) + " phases (1.." + std::to_string(kMaxSlicePhases) + ")");
  }
  if (n_jobs <= 0) return;
  fn_ = fn;
  ctx_ = ctx;
  n_jobs_ = n_jobs;
  if (!slice_end) next_.store(0, std::memory_order_relaxed);  // (sliced lists leave its line alone)
  slice_phases_ = slice_end ? n_phases : 0;
  if (slice_end) {
    if (n_jobs >= (int64_t{1} << 31)) throw std::invalid_argument("ThreadPool::run_sliced: " + std::to_string(n_jobs) + " jobs (at most 2^31 - 1)");
    int64_t begin = 0;
    for (int w = 0; w < n_phases * size(); ++w) {
      const int64_t end = std::max(begin, slice_end[w]);
      slices_[w].range.store(static_cast<uint64_t>(begin) | static_cast<uint64_t>(end) << 32, std::memory_order_relaxed);
      begin = end;
    }
  }
  active_.store(size(), std::memory_order_relaxed);
  const uint32_t gen = generation_.fetch_add(1, std::memory_order_release) + 1;
  if (static_cast<int>(workers_.size()) > 0) generation_.notify_all();
  if (caller_joins_) work_on_list(0, gen);
  uint32_t seen = finished_generation_.load(std::memory_order_acquire);
  const int spin = spin_us();
  while (seen != gen) seen = await_change(finished_generation_, seen, spin, watch_sharing_, sleeps_);
}

void ThreadPool::work_on_list(int index, uint32_t gen) {
  const JobFn fn = fn_;
  void* const ctx = ctx_;
  const int64_t n = n_jobs_;
  const int n_workers = size();
  for (int phase = 0; phase < slice_phases_; ++phase) {
    for (int k = 0; k < n_workers; ++k) {
      std::atomic<uint64_t>& range = slices_[phase * n_workers + (index + k) % n_workers].range;
      const bool own = k == 0;
      // Claims one job: the owner the front one, a helper the back one. The load is plain
      // until a job is there: at the end of a list every worker looks at every slice, and a
      // compare-exchange on a slice already used up would take its cache line from the other
      // workers (size() x size() line transfers in a row at 15 threads) for nothing.
      uint64_t r = range.load(std::memory_order_relaxed);
      for (;;) {
        const auto next = static_cast<uint32_t>(r), end = static_cast<uint32_t>(r >> 32);
        if (next >= end) break;
        const uint64_t claimed = own ? r + 1 : r - (uint64_t{1} << 32);
        if (!range.compare_exchange_weak(r, claimed, std::memory_order_relaxed)) continue;  // r reloaded
        fn(ctx, own ? next : end - 1, index);
        r = range.load(std::memory_order_relaxed);
      }
    }
  }
  if (slice_phases_ == 0) {
    for (int64_t i = next_.fetch_add(1, std::memory_order_relaxed); i < n; i = next_.fetch_add(1, std::memory_order_relaxed)) {
      fn(ctx, i, index);
    }
  }
  // The last worker out publishes completion (release: the jobs' writes happen before).
  if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    finished_generation_.store(gen, std::memory_order_release);
    if (!caller_joins_ || index != 0) finished_generation_.notify_all();
  }
}

void ThreadPool::worker_loop(int index) {
  uint32_t seen = 0;
  for (;;) {
    seen = await_change(generation_, seen, spin_us(), watch_sharing_, sleeps_);
    if (stop_) return;
    work_on_list(index, seen);
  }
}

}  // namespace moraine::cpu
