// moraine-handoff-bench: round-trip hop latency between two processes for the two hand-off
// paths docs/design.md "How they talk" weighs against each other, and what they cost a decode
// step.
//   zmq-jobs    : JobClient -> JobServer (REQ/REP over ipc://) with a decode-step expert job list,
//                 i.e. the real descriptor path incl. encode, decode and range validation
//   zmq-pair    : raw ZeroMQ PAIR over ipc:// with the same bytes (the socket alone)
//   doorbell    : shared-memory sequence-number doorbell, spin then futex (--spin-us)
//   doorbell-futex: the same with no spin (every wait sleeps in FUTEX_WAIT)
// A round trip is two hops (GPU -> CPU worker -> GPU). The decode-step share is
// layers x hops-per-layer x (round trip / 2) / step time.
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "common/messaging/job_channel.h"
#include "common/shm/doorbell.h"
#include "common/shm/shm_layout.h"
#include "common/shm/shm_segment.h"

namespace {

using Clock = std::chrono::steady_clock;
using moraine::jobs::JobEnvelope;
using moraine::jobs::JobReply;

struct Options {
  int iters = 20000;
  int warmup = 2000;
  int layers = 48;
  int hops_per_layer = 2;
  double step_ms = 10.0;
  double spin_us = 20.0;
  bool pin = false;
  bool json = false;
};

struct Result {
  std::string path;
  double p50_us = 0, p99_us = 0, mean_us = 0, max_us = 0;
};

Result summarize(std::string path, std::vector<double> us) {
  std::sort(us.begin(), us.end());
  Result r;
  r.path = std::move(path);
  auto at = [&](double p) { return us[std::min(us.size() - 1, static_cast<std::size_t>(p * double(us.size())))]; };
  r.p50_us = at(0.50);
  r.p99_us = at(0.99);
  r.max_us = us.back();
  double sum = 0;
  for (double v : us) sum += v;
  r.mean_us = sum / double(us.size());
  return r;
}

void pin_to(int cpu, bool enabled) {
  if (!enabled) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu % static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN))), &set);
  sched_setaffinity(0, sizeof(set), &set);
}

double us_since(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

// A decode-step descriptor: one token, top-8 experts, 2048-float rows (Qwen3-30B-A3B shapes).
constexpr std::uint32_t kSegmentId = 1;
constexpr std::uint32_t kRowBytes = 2048 * 4;

moraine::messaging::JobLimits limits() { return {{{kSegmentId, 1u << 20}}, 48, 128, 1, kRowBytes}; }

JobEnvelope decode_step_job(std::uint64_t seq, std::mt19937_64& rng) {
  JobEnvelope job;
  job.set_version(moraine::messaging::kJobProtocolVersion);
  job.set_seq(seq);
  auto* list = job.mutable_expert_jobs();
  list->set_step_seq(seq);
  list->set_layer(static_cast<std::uint32_t>(seq % 48));
  list->set_n_tokens(1);
  list->set_row_bytes(kRowBytes);
  auto ref = [](moraine::jobs::ShmRef* r, std::uint64_t offset, std::uint64_t length) {
    r->set_segment_id(kSegmentId);
    r->set_offset(offset);
    r->set_length(length);
  };
  ref(list->mutable_activations(), 0, kRowBytes);
  ref(list->mutable_routing(), 65536, 64);
  ref(list->mutable_outputs(), 131072, 8 * kRowBytes);
  list->set_done_seq(seq);
  for (std::uint32_t k = 0; k < 8; ++k) {
    auto* e = list->add_jobs();
    e->set_expert_id(static_cast<std::uint32_t>(rng() % 128));
    e->add_token_rows(0);
    e->set_output_offset(std::uint64_t{k} * kRowBytes);
  }
  return job;
}

int wait_child(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

Result bench_zmq_jobs(const Options& o) {
  const std::string endpoint = "ipc:///tmp/moraine-handoff-bench-" + std::to_string(getpid()) + "-jobs.sock";
  const int total = o.warmup + o.iters;
  const pid_t child = fork();
  if (child == 0) {
    pin_to(1, o.pin);
    {
      zmq::context_t context(1);
      moraine::messaging::JobServer server(context, endpoint, limits());
      auto handler = [](const JobEnvelope& job, JobReply& reply) { reply.set_done_seq(job.expert_jobs().done_seq()); };
      for (int i = 0; i < total; ++i) {
        if (server.serve_one(handler, std::chrono::seconds(10)) != moraine::messaging::ServeResult::kHandled) {
          std::fprintf(stderr, "zmq-jobs server: request %d not handled: %s\n", i, server.last_error().c_str());
          _exit(3);
        }
      }
    }  // close the socket (flushing the last reply) before _exit
    _exit(0);
  }
  pin_to(0, o.pin);
  zmq::context_t context(1);
  moraine::messaging::JobClient client(context, endpoint);
  std::mt19937_64 rng(1);
  std::vector<JobEnvelope> jobs;
  for (int i = 0; i < 64; ++i) jobs.push_back(decode_step_job(0, rng));
  std::vector<double> us;
  us.reserve(o.iters);
  JobReply reply;
  for (int i = 0; i < total; ++i) {
    JobEnvelope& job = jobs[i % jobs.size()];
    job.set_seq(static_cast<std::uint64_t>(i) + 1);
    const auto start = Clock::now();
    const std::string error = client.call(job, reply, std::chrono::seconds(10));
    const double t = us_since(start);
    if (!error.empty() || reply.status() != moraine::jobs::JOB_OK) {
      std::fprintf(stderr, "zmq-jobs: round trip %d: %s %s\n", i, error.c_str(), reply.error().c_str());
      std::exit(1);
    }
    if (i >= o.warmup) us.push_back(t);
  }
  if (wait_child(child) != 0) std::fprintf(stderr, "zmq-jobs: server exited badly\n");
  return summarize("zmq-jobs (REQ/REP ipc, encode+decode+validate)", std::move(us));
}

Result bench_zmq_pair(const Options& o) {
  const std::string endpoint = "ipc:///tmp/moraine-handoff-bench-" + std::to_string(getpid()) + "-pair.sock";
  const int total = o.warmup + o.iters;
  std::mt19937_64 rng(2);
  const std::string request = decode_step_job(1, rng).SerializeAsString();
  const pid_t child = fork();
  if (child == 0) {
    pin_to(1, o.pin);
    zmq::context_t context(1);
    zmq::socket_t socket(context, zmq::socket_type::pair);
    socket.set(zmq::sockopt::linger, 0);
    socket.set(zmq::sockopt::rcvtimeo, 10000);
    socket.bind(endpoint);
    zmq::message_t message;
    for (int i = 0; i < total; ++i) {
      if (!socket.recv(message)) _exit(3);
      socket.send(zmq::buffer("ok", 2), zmq::send_flags::none);
    }
    // The last reply must leave before the process does: wait for the client's goodbye.
    (void)socket.recv(message);
    _exit(0);
  }
  pin_to(0, o.pin);
  zmq::context_t context(1);
  zmq::socket_t socket(context, zmq::socket_type::pair);
  socket.set(zmq::sockopt::linger, 0);
  socket.set(zmq::sockopt::rcvtimeo, 10000);
  socket.connect(endpoint);
  std::vector<double> us;
  us.reserve(o.iters);
  char answer[16];
  for (int i = 0; i < total; ++i) {
    const auto start = Clock::now();
    socket.send(zmq::buffer(request), zmq::send_flags::none);
    if (!socket.recv(zmq::buffer(answer))) {
      std::fprintf(stderr, "zmq-pair: no reply within 10 s\n");
      std::exit(1);
    }
    const double t = us_since(start);
    if (i >= o.warmup) us.push_back(t);
  }
  socket.send(zmq::buffer("bye", 3), zmq::send_flags::none);
  wait_child(child);
  ::unlink(endpoint.c_str() + 6);  // libzmq leaves the socket file of a bound ipc:// endpoint
  return summarize("zmq-pair (raw PAIR ipc, same bytes)", std::move(us));
}

Result bench_doorbell(const Options& o, double spin_us, const std::string& name) {
  using moraine::shm::Doorbell;
  moraine::shm::ShmLayout layout;
  layout.add_doorbells("to_worker", 1).add_doorbells("to_gpu", 1);
  moraine::shm::ShmSegment segment = moraine::shm::ShmSegment::create(
      {"moraine-handoff-bench-" + std::to_string(getpid()), "bells", layout.total_bytes(), false, true});
  Doorbell* to_worker = Doorbell::init_at(layout.region("to_worker").at<void>(segment.data()));
  Doorbell* to_gpu = Doorbell::init_at(layout.region("to_gpu").at<void>(segment.data()));
  const auto spin = std::chrono::nanoseconds(static_cast<long long>(spin_us * 1000));
  const std::uint64_t total = static_cast<std::uint64_t>(o.warmup + o.iters);
  const pid_t child = fork();
  if (child == 0) {
    pin_to(1, o.pin);
    // The worker side maps the segment by name, as a real worker would.
    moraine::shm::ShmSegment peer = moraine::shm::ShmSegment::open(segment.locator());
    Doorbell* in = Doorbell::at(layout.region("to_worker").at<void>(peer.data()));
    Doorbell* out = Doorbell::at(layout.region("to_gpu").at<void>(peer.data()));
    for (std::uint64_t i = 1; i <= total; ++i) {
      if (in->wait_for(i, std::chrono::seconds(10), spin) != moraine::shm::WaitResult::kReady) _exit(3);
      out->ring(i);
    }
    _exit(0);
  }
  pin_to(0, o.pin);
  std::vector<double> us;
  us.reserve(o.iters);
  std::uint64_t slept = 0;
  for (std::uint64_t i = 1; i <= total; ++i) {
    moraine::shm::WaitStats stats;
    const auto start = Clock::now();
    to_worker->ring(i);
    if (to_gpu->wait_for(i, std::chrono::seconds(10), spin, &stats) != moraine::shm::WaitResult::kReady) {
      std::fprintf(stderr, "%s: no answer within 10 s at %llu\n", name.c_str(), static_cast<unsigned long long>(i));
      std::exit(1);
    }
    const double t = us_since(start);
    if (i > static_cast<std::uint64_t>(o.warmup)) {
      us.push_back(t);
      slept += stats.slept;
    }
  }
  wait_child(child);
  Result r = summarize(name, std::move(us));
  r.path += " (slept " + std::to_string(slept * 100 / std::max<std::uint64_t>(1, o.iters)) + "% of waits)";
  return r;
}

// In-process cost of the descriptor codec: encode + decode + validate of one decode-step job list.
Result bench_codec(const Options& o) {
  std::mt19937_64 rng(3);
  const JobEnvelope job = decode_step_job(1, rng);
  std::string wire;
  JobEnvelope back;
  const auto lim = limits();
  std::vector<double> us;
  us.reserve(o.iters);
  const int batch = 16;  // one job is below the clock's resolution: time 16 at a time
  for (int i = 0; i < o.warmup / batch + o.iters; ++i) {
    const auto start = Clock::now();
    for (int b = 0; b < batch; ++b) {
      moraine::messaging::encode_job(job, wire);
      back.Clear();
      if (!moraine::messaging::decode_job(std::as_bytes(std::span(wire.data(), wire.size())), 1 << 20, back).empty() ||
          !moraine::messaging::validate_job(back, lim).empty()) {
        std::fprintf(stderr, "codec: round trip failed\n");
        std::exit(1);
      }
    }
    const double t = us_since(start) / batch;
    if (i >= o.warmup / batch) us.push_back(t);
  }
  return summarize("codec (encode+decode+validate, " + std::to_string(wire.size()) + " bytes, in-process)", std::move(us));
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"moraine-handoff-bench: process-to-process hand-off latency (ZeroMQ ipc vs shared-memory doorbell)"};
  app.add_option("--iters", o.iters, "timed round trips per path")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "untimed round trips first")->check(CLI::NonNegativeNumber);
  app.add_option("--layers", o.layers, "layers in a decode step")->check(CLI::PositiveNumber);
  app.add_option("--hops-per-layer", o.hops_per_layer, "one-way hops per layer (GPU->CPU->GPU = 2)")->check(CLI::PositiveNumber);
  app.add_option("--step-ms", o.step_ms, "decode step time the hops are compared with")->check(CLI::PositiveNumber);
  app.add_option("--spin-us", o.spin_us, "doorbell spin budget before futex wait")->check(CLI::NonNegativeNumber);
  app.add_flag("--pin", o.pin, "pin the two processes to CPUs 0 and 1");
  app.add_flag("--json", o.json, "print JSON instead of a table");
  CLI11_PARSE(app, argc, argv);

  std::vector<Result> results;
  results.push_back(bench_zmq_jobs(o));
  results.push_back(bench_zmq_pair(o));
  results.push_back(bench_doorbell(o, o.spin_us, "doorbell spin " + std::to_string(static_cast<int>(o.spin_us)) + " us then futex"));
  results.push_back(bench_doorbell(o, 0.0, "doorbell futex only"));
  const Result codec = bench_codec(o);

  const double hops = double(o.layers) * o.hops_per_layer;
  auto share = [&](double round_trip_us) { return hops * (round_trip_us / 2.0) / (o.step_ms * 1000.0); };
  const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  if (o.json) {
    nlohmann::json out;
    out["iters"] = o.iters;
    out["layers"] = o.layers;
    out["hops_per_layer"] = o.hops_per_layer;
    out["step_ms"] = o.step_ms;
    out["spin_us"] = o.spin_us;
    out["pinned"] = o.pin;
    out["online_cpus"] = cpus;
    for (const Result& r : results) {
      out["paths"].push_back({{"path", r.path}, {"round_trip_p50_us", r.p50_us}, {"round_trip_p99_us", r.p99_us},
                              {"round_trip_mean_us", r.mean_us}, {"round_trip_max_us", r.max_us},
                              {"step_ms_p50", hops * r.p50_us / 2000.0}, {"step_share_p50", share(r.p50_us)},
                              {"step_share_p99", share(r.p99_us)}});
    }
    out["codec"] = {{"path", codec.path}, {"p50_us", codec.p50_us}, {"p99_us", codec.p99_us}};
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("hand-off round trips between two processes: %d timed (+%d warm-up), %ld online CPUs%s\n", o.iters,
              o.warmup, cpus, o.pin ? ", pinned to CPUs 0/1" : "");
  std::printf("decode step: %d layers x %d hops, %.1f ms\n\n", o.layers, o.hops_per_layer, o.step_ms);
  std::printf("%-62s %9s %9s %9s %9s %10s %8s %8s\n", "path", "p50 us", "p99 us", "mean us", "max us", "ms/step", "share50", "share99");
  for (const Result& r : results) {
    std::printf("%-62s %9.2f %9.2f %9.2f %9.1f %10.3f %7.1f%% %7.1f%%\n", r.path.c_str(), r.p50_us, r.p99_us, r.mean_us,
                r.max_us, hops * r.p50_us / 2000.0, 100 * share(r.p50_us), 100 * share(r.p99_us));
  }
  std::printf("%-62s %9.3f %9.3f\n", codec.path.c_str(), codec.p50_us, codec.p99_us);
  return 0;
}
