// The HTTP front end's Prometheus metrics: request and token counters, latency histograms
// (time to first token, inter-token, request), queue gauges. Thread-safe; text() renders the
// exposition format (version 0.0.4), with the group's own counters appended by the caller.
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace moraine::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double v);
  // Appends `name`'s _bucket/_sum/_count lines (cumulative buckets, +Inf last).
  void render(const std::string& name, const std::string& help, std::string& out) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;
  double sum_ = 0.0;
  uint64_t n_ = 0;
};

class Metrics {
 public:
  Metrics();
  void request_done(const std::string& endpoint, int status);
  void tokens(uint64_t prompt, uint64_t completion, uint64_t cached);
  void first_token(double seconds);
  void inter_token(double seconds);
  void request_seconds(double seconds);
  void queue(int64_t running, int64_t waiting);
  void rejected_queue_full();
  std::string text() const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  uint64_t prompt_tokens_ = 0, completion_tokens_ = 0, cached_tokens_ = 0, prefix_hits_ = 0, queue_full_ = 0;
  int64_t running_ = 0, waiting_ = 0;
  Histogram ttft_, itl_, duration_;
};

}  // namespace moraine::server
