// A small fixed pool for parallel-for over output rows. The caller's thread takes the first
// chunk, so a pool of n threads starts n - 1 workers. Each index is handled by exactly one
// thread with the same code, so results do not depend on the thread count.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moraine::reference {

class ThreadPool {
 public:
  // n_threads <= 0: std::thread::hardware_concurrency(). Jobs below min_parallel_work total
  // work run on the caller; tests pass 0 to force every job through the workers.
  explicit ThreadPool(int n_threads, int64_t min_parallel_work = kDefaultMinParallelWork);

  // A condition-variable wake-up costs a few microseconds, about what 100k multiply-adds take
  // on one core, so smaller jobs are not worth splitting.
  static constexpr int64_t kDefaultMinParallelWork = int64_t{1} << 17;
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Calls fn(begin, end) on disjoint contiguous chunks covering [0, n); returns when all are
  // done and rethrows the first exception a chunk threw. `work_per_item` is a rough cost (e.g.
  // multiply-adds); small jobs run inline because waking workers costs more than they save.
  void parallel_for(int64_t n, int64_t work_per_item,
                    const std::function<void(int64_t, int64_t)>& fn);

 private:
  void worker(int index);

  int n_threads_ = 1;
  int64_t min_parallel_work_ = kDefaultMinParallelWork;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  int64_t job_n_ = 0;
  int job_chunks_ = 0;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  std::exception_ptr error_;
};

}  // namespace moraine::reference
