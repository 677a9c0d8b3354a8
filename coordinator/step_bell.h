// A step handed from the coordinator to the gpu_worker through the exchange segment: the
// coordinator writes the tokens and the StepHeader (group_layout.h), rings the step request
// doorbell with the step's sequence number and waits on the step done doorbell; the gpu_worker
// runs the step, writes a StepReply and rings done. This replaces a LayerStep / JobReply round
// trip over ZeroMQ per step (protobuf both ways, two ipc hops with epoll wake-ups: ~0.14 ms per
// decode token on the H200 machine, 5% of an all-in-VRAM step); ZeroMQ stays for what is not per
// step (pings, malformed-job replies, the --step-channel zmq fallback).
//
// Faults, as over ZeroMQ: every wait is bounded and a dead gpu_worker is an error naming it, never
// a hang. The gpu_worker serving the bells registers its pid (with its start time, so a reused
// pid does not count) in the StepServerRecord; the coordinator rings only when a registered server
// is alive (waiting for one up to its deadline: a restart loads the model first; the server that
// answered the previous step counts as alive without a look), and while it waits for the answer
// it checks, every kLivenessSlice, that the server it rang is still alive.
// A restarted gpu_worker re-syncs before it registers: a request its predecessor took and never
// answered (request bell ahead of done bell) gets an error reply, so the coordinator's step fails
// with a clear message and is re-issued from a reset as before; then it serves from the request
// bell's current value.
#pragma once
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/shm/doorbell.h"

namespace moraine::group {

struct ExchangeLayout;
struct StepReply;

// Which process serves the step doorbells now (0: none registered).
struct StepServerRecord {
  std::atomic<std::uint32_t> pid;          // written last, with release: ticks are valid once seen
  std::uint32_t reserved;
  std::atomic<std::uint64_t> start_ticks;  // shm::process_start_ticks of pid
};

// How often a waiting side looks at whether the other side is still there.
inline constexpr std::chrono::milliseconds kLivenessSlice{100};

class StepBellClient {   // the coordinator's side
 public:
  // The exchange must be mapped for the client's life; init() once, by the segment's creator.
  StepBellClient(std::byte* exchange, const ExchangeLayout& xl);
  void init();
  // Rings step `seq` (tokens and StepHeader already written) and waits for its StepReply, at most
  // `timeout` in all (including waiting for a gpu_worker to register). Spins `spin` on the done
  // bell before it sleeps. Throws std::runtime_error (no server in time, the server died during
  // the step, no answer in time, or the step failed: the gpu_worker's error text).
  const StepReply& call(std::uint64_t seq, std::chrono::milliseconds timeout, std::chrono::nanoseconds spin);

 private:
  std::uint32_t wait_for_server(std::chrono::steady_clock::time_point until) const;

  shm::Doorbell* request_;
  shm::Doorbell* done_;
  StepReply* reply_;
  StepServerRecord* server_;
  std::uint32_t answered_pid_ = 0;   // the server that answered the last step
};

class StepBellServer {   // the gpu_worker's side
 public:
  StepBellServer(std::byte* exchange, const ExchangeLayout& xl);
  // Re-syncs with the bells (answers a request a dead predecessor took, with an error) and
  // registers this process as the server.
  void start();
  // The next step's sequence number once its request rings within `timeout` (spinning `spin`
  // first); 0 when none did.
  std::uint64_t next(std::chrono::nanoseconds timeout, std::chrono::nanoseconds spin);
  // The StepReply of step `seq` (done: token as StepReply::token; failed: error), then rings done.
  void answer(std::uint64_t seq, bool ok, std::int32_t token, const std::string& error);
  // At exit: no longer registered (the coordinator then waits for the next one).
  void withdraw();

 private:
  shm::Doorbell* request_;
  shm::Doorbell* done_;
  StepReply* reply_;
  StepServerRecord* server_;
  std::uint64_t served_ = 0;   // the last request taken
};

// Fills `reply` (the exchange's, or any): used by both channels.
void write_step_reply(StepReply& reply, std::uint64_t seq, bool ok, std::int32_t token, const std::string& error);

}  // namespace moraine::group
