// What the tools that write a model tensor by tensor (moraine-quantize, moraine-synth) share:
// a progress report on stderr and the pool that fills one tensor's rows on all cores.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace moraine::tools {

// One tensor as the progress report names it.
struct ProgressItem {
  std::string name;
  std::string from;         // e.g. the source type, or "random"
  std::string to;           // the written type
  uint64_t out_bytes = 0;   // bytes written for it
  uint64_t rate_bytes = 0;  // bytes the MB/s figure counts for it (input for a conversion)
  bool copied = false;
};

// Progress on stderr: a redrawn bar on a terminal, one line per tensor otherwise (logs, CI).
class TensorProgress {
 public:
  TensorProgress(size_t n_tensors, uint64_t total_out_bytes);

  bool tty() const { return tty_; }
  void draw(size_t index, const ProgressItem& item, double fraction);  // `fraction` of tensor `index` done
  void finish(size_t index, const ProgressItem& item);
  void end();  // ends a half-drawn bar line
  double seconds() const;

 private:
  bool tty_;
  size_t n_;
  uint64_t total_;
  uint64_t done_out_ = 0;
  uint64_t done_rate_ = 0;
  std::chrono::steady_clock::time_point start_;
};

// Runs fn(begin, end) over rows [0, n_rows) in chunks of `chunk` rows claimed by `n_threads`
// threads; meanwhile the calling thread calls tick(fraction done) ten times a second. The first
// exception thrown by fn stops the others and is rethrown here.
void for_rows_in_parallel(int64_t n_rows, int64_t chunk, int n_threads,
                          const std::function<void(int64_t begin, int64_t end)>& fn,
                          const std::function<void(double fraction)>& tick);

}  // namespace moraine::tools
