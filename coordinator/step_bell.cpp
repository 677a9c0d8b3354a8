#include "coordinator/step_bell.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "common/shm/shm_segment.h"
#include "coordinator/group_layout.h"

namespace moraine::group {

using Clock = std::chrono::steady_clock;

namespace {

shm::Doorbell* step_bell(std::byte* exchange, const ExchangeLayout& xl, std::size_t i) {
  return shm::Doorbell::at(exchange + xl.region("step_bells").offset + i * sizeof(shm::Doorbell));
}

std::string gpu_worker_named(std::uint32_t pid) {
  return std::string(kGpuWorkerInstance) + " (pid " + std::to_string(pid) + ")";
}

}  // namespace

void write_step_reply(StepReply& reply, std::uint64_t seq, bool ok, std::int32_t token, const std::string& error) {
  reply.seq = seq;
  reply.ok = ok ? 1 : 0;
  reply.token = token;
  reply.error_bytes = static_cast<std::uint32_t>(std::min(error.size(), kStepErrorBytes));
  std::memcpy(reply.error, error.data(), reply.error_bytes);
}

StepBellClient::StepBellClient(std::byte* exchange, const ExchangeLayout& xl)
    : request_(step_bell(exchange, xl, 0)), done_(step_bell(exchange, xl, 1)),
      reply_(xl.region("step_reply").at<StepReply>(exchange)),
      server_(xl.region("step_server").at<StepServerRecord>(exchange)) {}

void StepBellClient::init() {
  shm::Doorbell::init_at(request_);
  shm::Doorbell::init_at(done_);
  server_->start_ticks.store(0, std::memory_order_relaxed);
  server_->pid.store(0, std::memory_order_release);
  write_step_reply(*reply_, 0, false, -1, "");
}

std::uint32_t StepBellClient::wait_for_server(Clock::time_point until) const {
  for (;;) {
    const std::uint32_t pid = server_->pid.load(std::memory_order_acquire);
    if (pid != 0 && shm::process_alive(pid, server_->start_ticks.load(std::memory_order_relaxed))) return pid;
    if (Clock::now() >= until) {
      throw std::runtime_error(pid == 0 ? std::string("no ") + kGpuWorkerInstance + " serves steps (none registered)"
                                        : gpu_worker_named(pid) + " is gone and no other serves steps");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

const StepReply& StepBellClient::call(std::uint64_t seq, std::chrono::milliseconds timeout, std::chrono::nanoseconds spin) {
  const auto until = Clock::now() + timeout;
  // The server that answered the last step is taken as alive without asking /proc (14.7 us per
  // look on the dev box, more than the rest of the hand-off): if it died since, the first
  // liveness slice of the wait below finds out.
  std::uint32_t pid = server_->pid.load(std::memory_order_acquire);
  if (pid == 0 || pid != answered_pid_) {
    pid = wait_for_server(until);
    answered_pid_ = 0;
  }
  const std::uint64_t ticks = server_->start_ticks.load(std::memory_order_relaxed);
  request_->ring(seq);
  for (;;) {
    const auto left = until - Clock::now();
    const auto slice = std::max<Clock::duration>(std::min<Clock::duration>(kLivenessSlice, left), Clock::duration::zero());
    if (done_->wait_for(seq, slice, spin) == shm::WaitResult::kReady) break;
    // The answer may have come just as the process went: look at the bell once more first.
    if (!shm::process_alive(pid, ticks) && done_->load() < seq)
      throw std::runtime_error(gpu_worker_named(pid) + " died during step " + std::to_string(seq));
    if (Clock::now() >= until && done_->load() < seq)
      throw std::runtime_error(gpu_worker_named(pid) + " did not answer step " + std::to_string(seq) + " within " +
                               std::to_string(timeout.count()) + " ms");
  }
  if (reply_->seq != seq)   // the done bell says seq, the reply another: a protocol fault, never expected
    throw std::runtime_error("the step reply is for step " + std::to_string(reply_->seq) + ", expected " + std::to_string(seq));
  answered_pid_ = pid;
  if (!reply_->ok) throw std::runtime_error(std::string(reply_->error, std::min<std::size_t>(reply_->error_bytes, kStepErrorBytes)));
  return *reply_;
}

StepBellServer::StepBellServer(std::byte* exchange, const ExchangeLayout& xl)
    : request_(step_bell(exchange, xl, 0)), done_(step_bell(exchange, xl, 1)),
      reply_(xl.region("step_reply").at<StepReply>(exchange)),
      server_(xl.region("step_server").at<StepServerRecord>(exchange)) {}

void StepBellServer::start() {
  // The coordinator rings only while a registered server is alive and waits for its answer, so
  // nothing rings between this read and the registration below unless it rang a predecessor.
  served_ = request_->load();
  if (served_ > done_->load()) {
    write_step_reply(*reply_, served_, false, -1,
                     std::string(kGpuWorkerInstance) + " restarted during step " + std::to_string(served_) +
                         " (the process that took it is gone)");
    done_->ring(served_);
  }
  const std::uint32_t pid = static_cast<std::uint32_t>(::getpid());
  server_->start_ticks.store(shm::process_start_ticks(pid), std::memory_order_relaxed);
  server_->pid.store(pid, std::memory_order_release);
}

std::uint64_t StepBellServer::next(std::chrono::nanoseconds timeout, std::chrono::nanoseconds spin) {
  if (request_->wait_for(served_ + 1, timeout, spin) != shm::WaitResult::kReady) return 0;
  served_ = request_->load();
  return served_;
}

void StepBellServer::answer(std::uint64_t seq, bool ok, std::int32_t token, const std::string& error) {
  write_step_reply(*reply_, seq, ok, token, error);
  done_->ring(seq);
}

void StepBellServer::withdraw() {
  const std::uint32_t pid = static_cast<std::uint32_t>(::getpid());
  std::uint32_t expected = pid;
  server_->pid.compare_exchange_strong(expected, 0, std::memory_order_acq_rel);
}

}  // namespace moraine::group
