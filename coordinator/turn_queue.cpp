#include "coordinator/turn_queue.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

namespace moraine::group {

TurnQueue::TurnQueue(int parallel) : parallel_(parallel) {
  if (parallel < 1) throw std::invalid_argument("--parallel must be >= 1");
}

bool TurnQueue::wait_for(std::unique_lock<std::mutex>& l, const std::function<bool()>& ready,
                         const std::function<bool()>& cancelled) {
  while (!ready()) {
    if (cancelled && cancelled()) return false;
    cv_.wait_for(l, std::chrono::milliseconds(20));
  }
  return true;
}

bool TurnQueue::acquire(uint64_t id, const std::function<bool()>& cancelled) {
  std::unique_lock l(mu_);
  const auto drop = [&](std::deque<uint64_t>& q) {
    q.erase(std::remove(q.begin(), q.end(), id), q.end());
    cv_.notify_all();
  };
  if (admitted_.count(id) == 0) {
    admit_wait_.push_back(id);
    if (!wait_for(l, [&] { return static_cast<int>(admitted_.size()) < parallel_ && admit_wait_.front() == id; }, cancelled)) {
      drop(admit_wait_);
      return false;
    }
    admit_wait_.pop_front();
    admitted_.insert(id);
    cv_.notify_all();
  }
  if (holder_ == id) return true;
  turn_wait_.push_back(id);
  if (!wait_for(l, [&] { return holder_ == 0 && turn_wait_.front() == id; }, cancelled)) {
    drop(turn_wait_);
    return false;
  }
  turn_wait_.pop_front();
  holder_ = id;
  return true;
}

void TurnQueue::release(uint64_t id) {
  std::lock_guard l(mu_);
  if (holder_ == id) holder_ = 0;
  cv_.notify_all();
}

void TurnQueue::leave(uint64_t id) {
  std::lock_guard l(mu_);
  if (holder_ == id) holder_ = 0;
  admitted_.erase(id);
  cv_.notify_all();
}

bool TurnQueue::others_waiting() const {
  std::lock_guard l(mu_);
  return !turn_wait_.empty();
}

int TurnQueue::admitted() const {
  std::lock_guard l(mu_);
  return static_cast<int>(admitted_.size());
}

int TurnQueue::waiting() const {
  std::lock_guard l(mu_);
  return static_cast<int>(admit_wait_.size());
}

}  // namespace moraine::group
