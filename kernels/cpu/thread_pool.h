// The CPU expert worker's thread pool: one pinned thread per listed CPU, fed one flat job list
// at a time. Workers spin briefly after a list (the next one usually follows within
// microseconds: the next phase of the same layer), then sleep on a futex (std::atomic::wait),
// so an idle pool costs no CPU. Running a list allocates nothing.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

namespace moraine::cpu {

class ThreadPool {
 public:
  // One worker per CPU in `cpus`, each pinned to its CPU (pthread_setaffinity_np). Two pools
  // with disjoint lists split a node's cores (the worker's --cpus). Throws
  // std::invalid_argument for an empty list, a duplicate or a CPU this process may not use.
  explicit ThreadPool(const std::vector<int>& cpus);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()); }

  // How long run()'s caller keeps polling for the end of its list before it sleeps on a futex
  // (default 50 us, the workers' own spin). Past the first 50 us the caller yields the CPU
  // between polls (sched_yield), so a worker pinned to the caller's CPU keeps running; a longer
  // window saves the futex wake-up (tens of us) at the end of lists that take longer than
  // 50 us: a whole layer's experts at decode take 0.2-1 ms. Per pool, for A/B runs.
  void set_caller_spin_us(int us) { caller_spin_us_ = us < 0 ? 0 : us; }
  int caller_spin_us() const { return caller_spin_us_; }
  const std::vector<int>& cpus() const { return cpus_; }

  // Calls job(i, worker) for every i in [0, n_jobs) on the workers (worker = 0..size()-1, the
  // index of the thread running it) and returns when all have finished. Jobs are claimed one
  // at a time from a shared counter, so uneven jobs balance. Jobs must not throw. One list at
  // a time: run() is not reentrant and must not be called concurrently on one pool.
  template <typename F>
  void run(int64_t n_jobs, F&& job) {
    using Fn = std::remove_reference_t<F>;
    run_erased(n_jobs, nullptr, [](void* ctx, int64_t i, int w) { (*static_cast<Fn*>(ctx))(i, w); },
               const_cast<void*>(static_cast<const void*>(&job)));
  }

  // Like run(), with the jobs cut into size() slices: slice w is [slice_end[w-1], slice_end[w])
  // (slice_end[-1] = 0; slice_end[size()-1] = the number of jobs, non-decreasing). Worker w
  // runs its own slice's jobs in order first, then helps with the other slices (from w+1 on,
  // claiming each one's next job, also in order). A worker's jobs are then one contiguous run
  // of the list until it helps, so jobs laid out in memory order give each thread one long
  // stream instead of every thread hopping to the next free job. A job that waits for another
  // one needs an order that keeps the wait deadlock-free (MoeFfn's sliced schedule argues its).
  template <typename F>
  void run_sliced(const int64_t* slice_end, F&& job) {
    using Fn = std::remove_reference_t<F>;
    run_erased(slice_end[size() - 1], slice_end, [](void* ctx, int64_t i, int w) { (*static_cast<Fn*>(ctx))(i, w); },
               const_cast<void*>(static_cast<const void*>(&job)));
  }

 private:
  using JobFn = void (*)(void* ctx, int64_t i, int worker);
  void run_erased(int64_t n_jobs, const int64_t* slice_end, JobFn fn, void* ctx);
  void worker_loop(int index);
  void shutdown();

  std::vector<int> cpus_;
  std::vector<std::thread> workers_;
  // The current list. Written by run() before `generation_` is bumped (release), read by the
  // workers after they see the bump (acquire).
  JobFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_jobs_ = 0;
  bool stop_ = false;
  int caller_spin_us_ = 50;
  alignas(64) std::atomic<int64_t> next_{0};
  // run_sliced's slices: next job to claim and end, one cache line each.
  struct alignas(64) Slice {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  std::unique_ptr<Slice[]> slices_;
  bool sliced_ = false;
  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<int> active_{0};
  alignas(64) std::atomic<uint32_t> finished_generation_{0};
};

}  // namespace moraine::cpu
