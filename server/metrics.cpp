#include "server/metrics.h"

#include <algorithm>
#include <cstdio>

namespace moraine::server {
namespace {

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.9g", v);
  return b;
}

}  // namespace

void Histogram::observe(double v) {
  const size_t i = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  ++counts_[i];
  sum_ += v;
  ++n_;
}

void Histogram::render(const std::string& name, const std::string& help, std::string& out) const {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out += name + "_bucket{le=\"" + num(bounds_[i]) + "\"} " + std::to_string(cum) + "\n";
  }
  out += name + "_bucket{le=\"+Inf\"} " + std::to_string(n_) + "\n";
  out += name + "_sum " + num(sum_) + "\n" + name + "_count " + std::to_string(n_) + "\n";
}

// Buckets from 1 ms (a warm decode step on the GPU) to a minute (a long CPU prefill).
Metrics::Metrics()
    : ttft_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      itl_({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}),
      duration_({0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}) {}

void Metrics::request_done(const std::string& endpoint, int status) {
  std::lock_guard l(mu_);
  ++requests_[{endpoint, status}];
}

void Metrics::tokens(uint64_t prompt, uint64_t completion, uint64_t cached) {
  std::lock_guard l(mu_);
  prompt_tokens_ += prompt;
  completion_tokens_ += completion;
  cached_tokens_ += cached;
  if (cached > 0) ++prefix_hits_;
}

void Metrics::first_token(double s) {
  std::lock_guard l(mu_);
  ttft_.observe(s);
}
void Metrics::inter_token(double s) {
  std::lock_guard l(mu_);
  itl_.observe(s);
}
void Metrics::request_seconds(double s) {
  std::lock_guard l(mu_);
  duration_.observe(s);
}
void Metrics::queue(int64_t running, int64_t waiting) {
  std::lock_guard l(mu_);
  running_ = running;
  waiting_ = waiting;
}
void Metrics::rejected_queue_full() {
  std::lock_guard l(mu_);
  ++queue_full_;
}

std::string Metrics::text() const {
  std::lock_guard l(mu_);
  std::string out;
  out += "# HELP moraine_http_requests_total HTTP requests answered, by endpoint and status\n"
         "# TYPE moraine_http_requests_total counter\n";
  for (const auto& [k, n] : requests_)
    out += "moraine_http_requests_total{endpoint=\"" + k.first + "\",status=\"" + std::to_string(k.second) + "\"} " +
           std::to_string(n) + "\n";
  const auto counter = [&](const char* name, const char* help, uint64_t v) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " counter\n" + name + " " + std::to_string(v) + "\n";
  };
  const auto gauge = [&](const char* name, const char* help, int64_t v) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " gauge\n" + name + " " + std::to_string(v) + "\n";
  };
  counter("moraine_prompt_tokens_total", "prompt tokens of completed requests", prompt_tokens_);
  counter("moraine_completion_tokens_total", "tokens generated", completion_tokens_);
  counter("moraine_prompt_cached_tokens_total", "prompt tokens reused from the prefix cache, not prefilled", cached_tokens_);
  counter("moraine_prefix_cache_hits_total", "requests that reused cached prompt tokens", prefix_hits_);
  counter("moraine_queue_full_total", "requests refused with 429 (queue full)", queue_full_);
  gauge("moraine_requests_running", "requests admitted (at most --parallel)", running_);
  gauge("moraine_queue_depth", "requests waiting for a sequence slot", waiting_);
  ttft_.render("moraine_time_to_first_token_seconds", "from the request to its first generated token", out);
  itl_.render("moraine_inter_token_latency_seconds", "between two streamed chunks of one request", out);
  duration_.render("moraine_request_duration_seconds", "from the request to its last token", out);
  return out;
}

}  // namespace moraine::server
