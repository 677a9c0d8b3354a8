// The expert popularity census: how often each (layer, expert) was routed to, summed over every
// run of a model. Placement (coordinator/placement.h) reads it to put the most used experts in the
// fastest tier; the gpu_worker records it while it runs (CensusRecorder) and merges its counts
// into the file beside the model, so the next start of the group places by what was really used.
//
// File format (JSON): {"n_layer": L, "n_expert": E, "counts": [[c_0 ... c_{E-1}] x L]}.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace moraine::group {

struct Census {
  std::vector<std::vector<std::uint64_t>> counts;   // [layer][expert]
  static Census uniform(std::int64_t n_layer, std::int64_t n_expert);
  // Throws std::runtime_error naming the file and what disagrees with the model's shape.
  static Census read(const std::string& path, std::int64_t n_layer, std::int64_t n_expert);
  // Atomically (a temp file beside it, then rename): a reader never sees half a file.
  void write(const std::string& path) const;
};
// Where a census is looked for and written when none is named: "<model path>.census.json".
std::string default_census_path(const std::string& model_path);

// What one CensusRecorder::flush did.
struct CensusFlush {
  bool wrote = false;      // the file now includes every count recorded so far
  std::string replaced;    // non-empty: the file there was unreadable or for another shape (why); it was replaced
  std::string error;       // non-empty: nothing was written (why); the counts stay pending for the next flush
};

// Counts routing choices in memory and merges them into the census file now and then.
// Not thread-safe: one thread (the gpu_worker's step loop) calls add and flush; add is an array
// increment per id, no allocation, no lock. Every count is merged into the file exactly once:
// flush adds what was recorded since the last successful flush and then forgets it.
class CensusRecorder {
 public:
  // path empty: recording still counts (for stats) but flush writes nothing.
  CensusRecorder(std::int64_t n_layer, std::int64_t n_expert, std::string path);

  // The routing of one layer for one step: `count` expert ids (tokens x top-k). Ids < 0 or
  // >= n_expert, and layers out of range, are ignored (counted in ignored()).
  void add(std::int64_t layer, const std::int32_t* chosen, std::int64_t count) {
    if (layer < 0 || layer >= n_layer_) {
      ignored_ += static_cast<std::uint64_t>(count > 0 ? count : 0);
      return;
    }
    std::uint64_t* row = pending_.data() + layer * n_expert_;
    for (std::int64_t i = 0; i < count; ++i) {
      const std::int32_t e = chosen[i];
      if (e < 0 || e >= n_expert_) {
        ++ignored_;
        continue;
      }
      ++row[e];
    }
    any_pending_ = true;
  }

  // Reads the file (if any), adds the pending counts, writes a temp file and renames it over the
  // file, holding an advisory lock (<path>.lock) so that two processes flushing at once both
  // count. A corrupt or mismatched file is replaced by this recorder's counts (said in
  // `replaced`); an I/O failure leaves the counts pending (said in `error`). Never throws.
  CensusFlush flush();
  // flush() when something is pending and at least `every` passed since the last flush (or since
  // construction); otherwise nothing (wrote = false, no error).
  CensusFlush flush_if_due(std::chrono::steady_clock::duration every = std::chrono::seconds(1));

  const std::string& path() const { return path_; }
  std::int64_t n_layer() const { return n_layer_; }
  std::int64_t n_expert() const { return n_expert_; }
  std::uint64_t pending(std::int64_t layer, std::int64_t expert) const {
    return pending_[static_cast<std::size_t>(layer * n_expert_ + expert)];
  }
  std::uint64_t flushed_total() const { return flushed_total_; }   // ids merged into the file so far
  std::uint64_t ignored() const { return ignored_; }

 private:
  std::int64_t n_layer_, n_expert_;
  std::string path_;
  std::vector<std::uint64_t> pending_;   // [layer * n_expert + expert], since the last flush
  bool any_pending_ = false;
  std::uint64_t flushed_total_ = 0, ignored_ = 0;
  std::chrono::steady_clock::time_point last_flush_;
};

}  // namespace moraine::group
