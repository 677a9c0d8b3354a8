#include "common/reference/thread_pool.h"

#include <algorithm>

namespace moraine::reference {

namespace {
void chunk_range(int64_t n, int chunks, int i, int64_t& begin, int64_t& end) {
  begin = n * i / chunks;
  end = n * (i + 1) / chunks;
}
}  // namespace

ThreadPool::ThreadPool(int n_threads, int64_t min_parallel_work)
    : min_parallel_work_(min_parallel_work) {
  if (n_threads <= 0) n_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  n_threads_ = n_threads;
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::worker(int index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t)>* job;
    int64_t n;
    int chunks;
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      n = job_n_;
      chunks = job_chunks_;
    }
    if (index < chunks) {
      int64_t b, e;
      chunk_range(n, chunks, index, b, e);
      try {
        (*job)(b, e);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t work_per_item,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  const int chunks = static_cast<int>(std::min<int64_t>(n_threads_, n));
  if (chunks <= 1 || n * std::max<int64_t>(work_per_item, 1) < min_parallel_work_) {
    fn(0, n);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    job_n_ = n;
    job_chunks_ = chunks;
    pending_ = n_threads_ - 1;
    error_ = nullptr;
    ++generation_;
  }
  start_cv_.notify_all();
  std::exception_ptr mine;
  int64_t b, e;
  chunk_range(n, chunks, 0, b, e);
  try {
    fn(b, e);
  } catch (...) {
    mine = std::current_exception();
  }
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
  if (mine) std::rethrow_exception(mine);
  if (error_) std::rethrow_exception(error_);
}

}  // namespace moraine::reference
