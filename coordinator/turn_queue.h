// Which request steps the gpu_worker (coordinator --parallel): at most `parallel` requests are
// admitted at a time, in arrival order, and the admitted ones take turns, first come first
// served; the others wait to be admitted. A request in its turn runs steps for its own sequence
// (the gpu_worker holds one live sequence; the others wait saved in its conversation store), and
// yields after a few tokens when another admitted request waits. Waits give up when the caller's
// `cancelled` says so (polled every 20 ms).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <set>

namespace moraine::group {

class TurnQueue {
 public:
  explicit TurnQueue(int parallel);
  int parallel() const { return parallel_; }
  // Blocks until id is admitted and holds the turn; false when cancelled first (id keeps its
  // admission if it had one: leave() ends it).
  bool acquire(uint64_t id, const std::function<bool()>& cancelled);
  void release(uint64_t id);
  void leave(uint64_t id);   // id is done: its admission ends (and its turn, if it held it)
  bool others_waiting() const;   // an admitted request waits for the turn
  int admitted() const;
  int waiting() const;   // requests not admitted yet

 private:
  bool wait_for(std::unique_lock<std::mutex>& l, const std::function<bool()>& ready, const std::function<bool()>& cancelled);
  const int parallel_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::set<uint64_t> admitted_;
  std::deque<uint64_t> admit_wait_, turn_wait_;
  uint64_t holder_ = 0;
};

}  // namespace moraine::group
