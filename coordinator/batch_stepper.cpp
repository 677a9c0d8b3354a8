#include "coordinator/batch_stepper.h"

#include "coordinator/group_layout.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace moraine::group {

namespace {
constexpr auto kPoll = std::chrono::milliseconds(20);
constexpr size_t kMaxRows = kMaxSegments;   // rows of one batched step: one segment each
}  // namespace

BatchStepper::BatchStepper(int slots, Issue issue) : issue_(std::move(issue)), free_(static_cast<size_t>(slots), 1) {
  if (slots < 1 || static_cast<size_t>(slots) > kMaxRows)
    throw std::invalid_argument("batched decode: " + std::to_string(slots) + " slots, expected 1.." + std::to_string(kMaxRows));
}

int BatchStepper::acquire_slot(const std::function<bool()>& cancelled) {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    const auto it = std::find(free_.begin(), free_.end(), 1);
    if (it != free_.end()) {
      *it = 0;
      return static_cast<int>(it - free_.begin());
    }
    if (cancelled && cancelled()) return -1;
    cv_.wait_for(l, kPoll);
  }
}

void BatchStepper::release_slot(int slot) {
  std::lock_guard<std::mutex> l(mu_);
  free_.at(static_cast<size_t>(slot)) = 1;
  cv_.notify_all();
}

void BatchStepper::exclusive(const std::function<void()>& fn) {
  {
    std::unique_lock<std::mutex> l(mu_);
    ++exclusive_waiting_;
    cv_.wait(l, [&] { return !busy_; });
    --exclusive_waiting_;
    busy_ = true;
  }
  struct Done {
    BatchStepper& s;
    ~Done() {
      std::lock_guard<std::mutex> l(s.mu_);
      s.busy_ = false;
      s.cv_.notify_all();
    }
  } done{*this};
  fn();
}

void BatchStepper::begin_decoding() {
  std::lock_guard<std::mutex> l(mu_);
  ++decoding_;
}

void BatchStepper::end_decoding() {
  std::lock_guard<std::mutex> l(mu_);
  --decoding_;
  cv_.notify_all();
}

void BatchStepper::decode(Row& row) {
  std::unique_lock<std::mutex> l(mu_);
  row.done = false;
  row.error.clear();
  pending_.push_back(&row);
  cv_.notify_all();
  const auto since = std::chrono::steady_clock::now();
  for (;;) {
    if (row.done) {
      if (!row.error.empty()) throw std::runtime_error(row.error);
      return;
    }
    // Lead a step: none in flight, no prefill waiting, and every decoding request's row here or
    // kGather gone by.
    const bool all_in = static_cast<int>(pending_.size()) >= decoding_ || pending_.size() >= kMaxRows;
    if (!busy_ && exclusive_waiting_ == 0 && (all_in || std::chrono::steady_clock::now() - since >= kGather)) {
      const size_t take = std::min(pending_.size(), kMaxRows);
      std::vector<Row*> rows(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(take));
      pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(take));
      busy_ = true;
      l.unlock();
      std::string error;
      try {
        issue_(rows);
      } catch (const std::exception& e) {
        error = e.what();
      }
      l.lock();
      for (Row* r : rows) {
        r->error = error;
        r->done = true;
      }
      ++steps_;
      rows_ += rows.size();
      busy_ = false;
      cv_.notify_all();
      continue;
    }
    if (busy_ || exclusive_waiting_ > 0) {
      cv_.wait(l);
    } else {
      cv_.wait_for(l, kGather / 5);
    }
  }
}

uint64_t BatchStepper::steps() const {
  std::lock_guard<std::mutex> l(mu_);
  return steps_;
}

uint64_t BatchStepper::rows() const {
  std::lock_guard<std::mutex> l(mu_);
  return rows_;
}

}  // namespace moraine::group
