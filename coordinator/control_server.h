// The Control service every process of the group serves on its Unix socket (proto/control.proto):
// Health reports the serving state, Stats the per-stage counters a process records with
// StageRecorder, Drain stops admitting work and answers once what was admitted is done, Shutdown
// asks the process's main loop to stop. Configure/Load are left UNIMPLEMENTED: a process takes
// its configuration from its flags and the group manifest at start.
#pragma once
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "proto/control.grpc.pb.h"

namespace moraine::group {

// Counters and a latency histogram of one pipeline stage. record() is called once per step or
// job from the hot path: a mutex and a few adds into storage sized at construction.
class StageRecorder {
 public:
  explicit StageRecorder(std::string name);
  void record(std::uint64_t tokens, std::uint64_t experts, std::uint64_t bytes, double latency_us);
  void set_queue_depth(std::uint64_t depth);
  void fill(moraine::control::StageStats& out, bool reset);
  const std::string& name() const { return name_; }

 private:
  static constexpr std::array<double, 14> kBoundsUs = {10, 20, 50, 100, 200, 500, 1e3, 2e3,
                                                        5e3, 1e4, 2e4, 5e4, 1e5, 1e300};
  // Percentiles come from the last kWindow samples (a ring), the histogram from all of them.
  static constexpr std::size_t kWindow = 4096;
  std::string name_;
  std::mutex mu_;
  std::uint64_t tokens_ = 0, steps_ = 0, experts_ = 0, bytes_ = 0, depth_ = 0, max_depth_ = 0;
  std::array<std::uint64_t, kBoundsUs.size()> counts_{};
  double sum_us_ = 0, max_us_ = 0;
  std::vector<double> window_;
  std::size_t window_next_ = 0, window_fill_ = 0;
  std::vector<double> sort_scratch_;
};

// On a "unix:" address the server listens on its own socket and hands gRPC only the connections
// of peers that run as this process's uid (SO_PEERCRED); another user's is closed unanswered.
// The constructor makes the socket directory 0700 or refuses one that is not private
// (private_socket.h), before the process writes anything into it.
class ControlServer final : public moraine::control::Control::Service {
 public:
  ControlServer(moraine::control::Role role, std::string instance, std::string address);
  ~ControlServer() override;

  // Stages must be added before start(); the reference stays valid for the server's lifetime.
  StageRecorder& add_stage(const std::string& name);
  void add_service(grpc::Service* service) { extra_services_.push_back(service); }
  // Extra fields of every Stats reply (shm sizes, counters); may be set after start().
  void set_stats_hook(std::function<void(moraine::control::StatsReply&)> hook);
  void start();   // throws std::runtime_error when the socket cannot be bound
  void stop();
  std::uint64_t refused_peers() const { return refused_.load(); }   // connections of another uid closed

  void set_state(moraine::control::ServingState state, std::string detail = {});
  // Drain: the process stops taking new work (accepting() turns false: DRAINING) and the reply
  // comes when `in_flight` (default: none) reaches 0, then the state is STOPPED; or at the
  // request's deadline with drained = false. A process with work of its own to finish sets it.
  void set_in_flight_hook(std::function<std::uint64_t()> in_flight);
  bool accepting();
  void request_shutdown();
  bool shutdown_requested() const { return shutdown_.load(); }
  // Sleeps up to `d` or until a shutdown is requested; returns shutdown_requested().
  bool wait_shutdown(std::chrono::milliseconds d);

  grpc::Status Health(grpc::ServerContext*, const moraine::control::HealthRequest*,
                      moraine::control::HealthReply*) override;
  grpc::Status Stats(grpc::ServerContext*, const moraine::control::StatsRequest*,
                     moraine::control::StatsReply*) override;
  grpc::Status Shutdown(grpc::ServerContext*, const moraine::control::ShutdownRequest*,
                        moraine::control::ShutdownReply*) override;
  grpc::Status Drain(grpc::ServerContext*, const moraine::control::DrainRequest*,
                     moraine::control::DrainReply*) override;
  // Configuration is by flags (or the supervisor's --config) at start; these say so.
  grpc::Status Configure(grpc::ServerContext*, const moraine::control::ConfigureRequest*,
                         moraine::control::ConfigureReply*) override;
  grpc::Status Load(grpc::ServerContext*, const moraine::control::LoadRequest*,
                    moraine::control::LoadReply*) override;

 private:
  std::uint64_t uptime_us() const;
  void listen_unix(const std::string& path);   // binds path; accept_loop() hands gRPC the peers
  void accept_loop();

  moraine::control::Role role_;
  std::string instance_;
  std::string address_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::vector<std::unique_ptr<StageRecorder>> stages_;
  std::vector<grpc::Service*> extra_services_;
  std::function<void(moraine::control::StatsReply&)> hook_;
  std::function<std::uint64_t()> in_flight_;
  std::unique_ptr<grpc::Server> server_;
  std::mutex mu_;
  std::condition_variable cv_;
  moraine::control::ServingState state_ = moraine::control::STARTING;
  std::string detail_;
  std::atomic<bool> shutdown_{false};
  int listen_fd_ = -1, wake_fd_ = -1;   // the unix listener and the eventfd that stops accept_loop
  std::thread acceptor_;
  std::atomic<std::uint64_t> refused_{0};
};

// Client side: Health of `address` until SERVING or the deadline. Empty string when serving,
// else the last reason it was not. With `child` (> 0, a child of the caller), it also stops
// waiting when that process has exited (it is not reaped: the caller still waits for it).
std::string wait_serving(const std::string& address, std::chrono::milliseconds deadline, int child = -1);
// One Health call on a fresh channel (its own subchannel, so no reconnect back-off carries over
// from an earlier probe of a process that was not there yet).
grpc::Status probe_health(const std::string& address, std::chrono::milliseconds timeout,
                          moraine::control::HealthReply& reply);

}  // namespace moraine::group
