#include "coordinator/health_watch.h"

#include <algorithm>

#include "coordinator/control_server.h"

namespace moraine::group {

HealthWatch::HealthWatch(std::chrono::milliseconds interval, std::chrono::milliseconds timeout)
    : interval_(interval), timeout_(timeout) {
  if (interval_.count() > 0) thread_ = std::thread([this] { loop(); });
}

HealthWatch::~HealthWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void HealthWatch::watch(const std::string& name, const std::string& address, Clock::time_point first_answer_by,
                        bool serving_now) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry e;
  e.address = address;
  e.since = e.last_answer = Clock::now();
  e.first_answer_by = first_answer_by;
  e.answered = serving_now;
  e.generation = ++generations_;
  entries_[name] = e;
}

void HealthWatch::unwatch(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.erase(name);
}

std::vector<HealthWatch::Silent> HealthWatch::silent() const {
  std::vector<Silent> out;
  if (interval_.count() <= 0) return out;
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, e] : entries_) {
    const bool late = e.answered ? now - e.last_answer > timeout_ : now > e.first_answer_by;
    if (!late) continue;
    const auto from = e.answered ? e.last_answer : e.since;
    out.push_back({name, std::chrono::duration<double>(now - from).count(), !e.answered});
  }
  return out;
}

void HealthWatch::loop() {
  // A probe waits at most a second (or half the timeout), so one frozen process delays the round
  // for the others by no more than that.
  const auto probe_timeout = std::min<std::chrono::milliseconds>(std::chrono::milliseconds(1000), timeout_ / 2);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    std::vector<std::pair<std::string, std::pair<std::string, uint64_t>>> round;
    for (const auto& [name, e] : entries_) round.push_back({name, {e.address, e.generation}});
    lock.unlock();
    for (const auto& [name, target] : round) {
      moraine::control::HealthReply reply;
      const bool ok = probe_health(target.first, probe_timeout, reply).ok();
      if (!ok) continue;
      std::lock_guard<std::mutex> relock(mu_);
      auto it = entries_.find(name);
      if (it == entries_.end() || it->second.generation != target.second) continue;
      it->second.answered = true;
      it->second.last_answer = Clock::now();
    }
    lock.lock();
    cv_.wait_for(lock, interval_, [this] { return stop_; });
  }
}

}  // namespace moraine::group
