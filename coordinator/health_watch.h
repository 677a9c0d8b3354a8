// The supervisor's periodic Health probes (issue 31): a thread asks every process of the group
// for Health each interval; one whose last answer is older than the timeout (frozen by SIGSTOP,
// wedged, or never serving after a restart) is reported, and the supervisor kills and restarts it.
// Any answer counts, STARTING included: a process loading its model is alive.
#pragma once
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace moraine::group {

class HealthWatch {
 public:
  using Clock = std::chrono::steady_clock;
  // interval 0: no probes (silent() is always empty).
  HealthWatch(std::chrono::milliseconds interval, std::chrono::milliseconds timeout);
  ~HealthWatch();
  HealthWatch(const HealthWatch&) = delete;
  HealthWatch& operator=(const HealthWatch&) = delete;

  // Watch `name` at `address` from now on (again after a restart). Until its first answer it has
  // until `first_answer_by` (its start-up time); after that, the timeout. `serving_now`: the caller
  // has just seen it serve, which counts as its first answer (else a process frozen before the
  // watch's first probe would get the start-up time).
  void watch(const std::string& name, const std::string& address, Clock::time_point first_answer_by,
             bool serving_now = false);
  void unwatch(const std::string& name);
  struct Silent {
    std::string name;
    double seconds;        // since its last answer, or since it was watched when it never answered
    bool never_answered;
  };
  std::vector<Silent> silent() const;

 private:
  struct Entry {
    std::string address;
    Clock::time_point since, last_answer, first_answer_by;
    bool answered = false;
    uint64_t generation = 0;   // bumped by watch(): an answer to an older probe does not count
  };
  void loop();

  const std::chrono::milliseconds interval_, timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Entry> entries_;
  uint64_t generations_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace moraine::group
