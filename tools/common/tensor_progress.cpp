#include "tools/common/tensor_progress.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace moraine::tools {

using Clock = std::chrono::steady_clock;

TensorProgress::TensorProgress(size_t n_tensors, uint64_t total_out_bytes)
    : tty_(isatty(STDERR_FILENO) == 1), n_(n_tensors), total_(total_out_bytes), start_(Clock::now()) {}

double TensorProgress::seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

void TensorProgress::draw(size_t index, const ProgressItem& item, double fraction) {
  const uint64_t out_now = done_out_ + static_cast<uint64_t>(fraction * static_cast<double>(item.out_bytes));
  const uint64_t rate_now = done_rate_ + static_cast<uint64_t>(fraction * static_cast<double>(item.rate_bytes));
  const double secs = seconds();
  const double mbps = secs > 0 ? static_cast<double>(rate_now) / 1e6 / secs : 0.0;
  const double overall = total_ ? static_cast<double>(out_now) / static_cast<double>(total_) : 1.0;
  constexpr int kWidth = 24;
  const int filled = std::clamp(static_cast<int>(overall * kWidth), 0, kWidth);
  std::fprintf(stderr, "\r\033[K[%s%s] tensor %zu/%zu  %.1f/%.1f MB  %.0f MB/s  %s -> %s",
               std::string(static_cast<size_t>(filled), '#').c_str(),
               std::string(static_cast<size_t>(kWidth - filled), '.').c_str(), index + 1, n_,
               static_cast<double>(out_now) / 1e6, static_cast<double>(total_) / 1e6, mbps, item.name.c_str(),
               item.to.c_str());
  std::fflush(stderr);
}

void TensorProgress::finish(size_t index, const ProgressItem& item) {
  done_out_ += item.out_bytes;
  done_rate_ += item.rate_bytes;
  if (tty_) {
    draw(index, item, 0.0);
    return;
  }
  const double secs = seconds();
  std::fprintf(stderr, "[%zu/%zu] %s %s -> %s%s  %.1f/%.1f MB  %.0f MB/s\n", index + 1, n_, item.name.c_str(),
               item.from.c_str(), item.to.c_str(), item.copied ? " (copied)" : "",
               static_cast<double>(done_out_) / 1e6, static_cast<double>(total_) / 1e6,
               secs > 0 ? static_cast<double>(done_rate_) / 1e6 / secs : 0.0);
}

void TensorProgress::end() {
  if (tty_) std::fprintf(stderr, "\n");
}

void for_rows_in_parallel(int64_t n_rows, int64_t chunk, int n_threads,
                          const std::function<void(int64_t, int64_t)>& fn,
                          const std::function<void(double)>& tick) {
  chunk = std::max<int64_t>(chunk, 1);
  std::atomic<int64_t> next{0}, rows_done{0};
  int running = 0;  // guarded by `mutex`
  std::exception_ptr error;
  std::mutex mutex;
  std::condition_variable all_done;

  auto work = [&] {
    try {
      for (;;) {
        const int64_t begin = next.fetch_add(chunk);
        if (begin >= n_rows) break;
        const int64_t end = std::min(n_rows, begin + chunk);
        fn(begin, end);
        rows_done.fetch_add(end - begin);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex);
      if (!error) error = std::current_exception();
      next.store(n_rows);  // stop the others early
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (--running == 0) all_done.notify_one();
  };

  const int n = static_cast<int>(std::clamp<int64_t>(n_threads, 1, std::max<int64_t>(1, n_rows / chunk + 1)));
  running = n;
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) pool.emplace_back(work);
  {
    // Tick ten times a second until the last worker is done (without waiting out the tick).
    std::unique_lock<std::mutex> lock(mutex);
    while (!all_done.wait_for(lock, std::chrono::milliseconds(100), [&] { return running == 0; })) {
      tick(static_cast<double>(rows_done.load()) / static_cast<double>(std::max<int64_t>(n_rows, 1)));
    }
  }
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace moraine::tools
