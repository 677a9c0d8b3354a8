#pragma once
// Request/reply of job descriptors over ZeroMQ ipc://. A worker binds a JobServer on its endpoint;
// the coordinator connects a JobClient. Every wait is bounded: a peer that died or hangs turns
// into a timeout error naming the endpoint, never a hang. A bad request (malformed, truncated,
// oversized, several frames, out-of-range offsets) gets a JOB_BAD_REQUEST reply saying why,
// and the server carries on.
#include <chrono>
#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <zmq.hpp>

#include "common/messaging/job_codec.h"
#include "common/messaging/job_validation.h"
#include "proto/jobs.pb.h"

namespace moraine::messaging {

enum class ServeResult {
  kHandled,    // valid job, handler ran, reply sent
  kRejected,   // bad request, error reply sent
  kIdle,       // nothing arrived within the timeout
};

class JobServer {
 public:
  // Fills `reply` (status, done_seq, ...). An exception from the handler becomes JOB_FAILED.
  using Handler = std::function<void(const moraine::jobs::JobEnvelope&, moraine::jobs::JobReply&)>;

  JobServer(zmq::context_t& context, const std::string& endpoint, JobLimits limits,
            std::size_t max_message_bytes = kDefaultMaxJobBytes);
  // Closes the socket and removes the socket file of an ipc:// endpoint (libzmq leaves it).
  ~JobServer();
  JobServer(const JobServer&) = delete;
  JobServer& operator=(const JobServer&) = delete;

  ServeResult serve_one(const Handler& handler, std::chrono::milliseconds timeout);
  // Why the last request was rejected (empty after a handled one).
  const std::string& last_error() const { return last_error_; }
  const std::string& endpoint() const { return endpoint_; }

 private:
  void send_reply();

  zmq::socket_t socket_;
  std::string endpoint_;
  JobLimits limits_;
  std::size_t max_message_bytes_;
  // One byte longer than the limit: a longer message arrives truncated and is reported oversized
  // with its real size, without ever allocating for it.
  std::vector<std::byte> receive_buffer_;
  std::string send_buffer_;
  moraine::jobs::JobEnvelope request_;   // reused across requests
  moraine::jobs::JobReply reply_;
  std::string last_error_;
};

class JobClient {
 public:
  JobClient(zmq::context_t& context, const std::string& endpoint,
            std::size_t max_reply_bytes = 64 * 1024);

  // Sends `request` and waits up to `timeout` for its reply. Returns an empty string when a reply
  // arrived (its status may still be an error), else what went wrong (timeout = peer dead/stuck).
  std::string call(const moraine::jobs::JobEnvelope& request, moraine::jobs::JobReply& reply,
                   std::chrono::milliseconds timeout);
  // call in two halves, so that the caller can work while the peer serves the request: send()
  // returns once it is queued, receive() waits up to `timeout` for the reply to request seq
  // `seq` (the same error strings as call; after a timeout the next send() may go out).
  std::string send(const moraine::jobs::JobEnvelope& request, std::chrono::milliseconds timeout);
  std::string receive(moraine::jobs::JobReply& reply, std::uint64_t seq, std::chrono::milliseconds timeout);
  // Sends raw bytes as the request frame (tests and fuzzing: malformed input).
  std::string call_raw(std::span<const std::byte> frame, moraine::jobs::JobReply& reply,
                       std::chrono::milliseconds timeout);
  const std::string& endpoint() const { return endpoint_; }

 private:
  std::string exchange(std::span<const std::byte> frame, moraine::jobs::JobReply& reply,
                       std::chrono::milliseconds timeout);
  std::string check_seq(const moraine::jobs::JobReply& reply, std::uint64_t seq) const;   // "" when it answers seq
  std::string send_frame(std::span<const std::byte> frame, std::chrono::milliseconds timeout);
  // `shown`: the timeout the error message names (a call's whole one).
  std::string receive_reply(moraine::jobs::JobReply& reply, std::chrono::milliseconds timeout, std::chrono::milliseconds shown);

  zmq::socket_t socket_;
  std::string endpoint_;
  std::vector<std::byte> receive_buffer_;
  std::string send_buffer_;
};

}  // namespace moraine::messaging
