// The CPU expert worker's thread pool: one pinned thread per listed CPU, fed one flat job list
// at a time. Workers spin briefly after a list (the next one usually follows within
// microseconds: the next phase of the same layer), then sleep on a futex (std::atomic::wait),
// so an idle pool costs no CPU. Running a list allocates nothing.
#pragma once
#include <atomic>
#include <cstdint>
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
  const std::vector<int>& cpus() const { return cpus_; }

  // Calls job(i, worker) for every i in [0, n_jobs) on the workers (worker = 0..size()-1, the
  // index of the thread running it) and returns when all have finished. Jobs are claimed one
  // at a time from a shared counter, so uneven jobs balance. Jobs must not throw. One list at
  // a time: run() is not reentrant and must not be called concurrently on one pool.
  template <typename F>
  void run(int64_t n_jobs, F&& job) {
    using Fn = std::remove_reference_t<F>;
    run_erased(n_jobs, [](void* ctx, int64_t i, int w) { (*static_cast<Fn*>(ctx))(i, w); },
               const_cast<void*>(static_cast<const void*>(&job)));
  }

 private:
  using JobFn = void (*)(void* ctx, int64_t i, int worker);
  void run_erased(int64_t n_jobs, JobFn fn, void* ctx);
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
  alignas(64) std::atomic<int64_t> next_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<int> active_{0};
  alignas(64) std::atomic<uint32_t> finished_generation_{0};
};

}  // namespace moraine::cpu
