#include "common/messaging/job_channel.h"

#include <unistd.h>

#include <chrono>
#include <exception>

namespace moraine::messaging {

namespace {
int to_ms(std::chrono::milliseconds timeout) {
  const auto ms = timeout.count();
  return ms < 0 ? 0 : (ms > INT32_MAX ? INT32_MAX : static_cast<int>(ms));
}
}  // namespace

JobServer::JobServer(zmq::context_t& context, const std::string& endpoint, JobLimits limits,
                     std::size_t max_message_bytes)
    : socket_(context, zmq::socket_type::rep),
      endpoint_(endpoint),
      limits_(std::move(limits)),
      max_message_bytes_(max_message_bytes),
      receive_buffer_(max_message_bytes + 1) {
  // On close, give the last reply a bounded time to leave: with linger 0 a worker that replied
  // and then shut down lost that reply (seen in moraine-handoff-bench), and with the default
  // (forever) a dead client could keep a closing worker alive.
  socket_.set(zmq::sockopt::linger, 200);
  // Beyond 16x the descriptor limit ZeroMQ drops the connection instead of buffering the frame;
  // between the limit and that, the sender gets an error reply (see serve_one).
  socket_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(max_message_bytes) * 16);
  try {
    socket_.bind(endpoint);
  } catch (const zmq::error_t& e) {
    throw std::runtime_error("job server: cannot bind " + endpoint + ": " + e.what());
  }
}

JobServer::~JobServer() {
  socket_.close();
  const std::string ipc = "ipc://";
  if (endpoint_.rfind(ipc, 0) == 0) ::unlink(endpoint_.c_str() + ipc.size());
}

void JobServer::send_reply() {
  send_buffer_.clear();
  reply_.SerializeToString(&send_buffer_);
  // A REP reply goes to the pipe of the request just received; it does not block unless the
  // peer vanished, and then linger 0 drops it.
  (void)socket_.send(zmq::buffer(send_buffer_), zmq::send_flags::dontwait);
}

ServeResult JobServer::serve_one(const Handler& handler, std::chrono::milliseconds timeout) {
  socket_.set(zmq::sockopt::rcvtimeo, to_ms(timeout));
  const auto received = socket_.recv(zmq::mutable_buffer(receive_buffer_.data(), receive_buffer_.size()));
  if (!received) return ServeResult::kIdle;

  reply_.Clear();
  last_error_.clear();
  std::size_t extra_frames = 0;
  while (socket_.get(zmq::sockopt::rcvmore)) {
    zmq::message_t rest;
    (void)socket_.recv(rest);
    ++extra_frames;
  }
  if (extra_frames > 0) {
    last_error_ = "job descriptor has " + std::to_string(extra_frames + 1) + " frames, expected one";
  } else if (received->untruncated_size > max_message_bytes_) {
    last_error_ = "job descriptor of " + std::to_string(received->untruncated_size) +
                  " bytes exceeds the limit of " + std::to_string(max_message_bytes_) + " bytes";
  } else {
    request_.Clear();
    last_error_ = decode_job(std::span(receive_buffer_.data(), received->size), max_message_bytes_, request_);
    if (last_error_.empty()) last_error_ = validate_job(request_, limits_);
  }
  if (!last_error_.empty()) {
    // The request's seq when it parsed that far, so the client can match the error to it.
    reply_.set_seq(request_.seq());
    reply_.set_status(moraine::jobs::JOB_BAD_REQUEST);
    reply_.set_error(last_error_);
    request_.Clear();
    send_reply();
    return ServeResult::kRejected;
  }
  reply_.set_seq(request_.seq());
  reply_.set_status(moraine::jobs::JOB_OK);
  const auto start = std::chrono::steady_clock::now();
  try {
    handler(request_, reply_);
  } catch (const std::exception& e) {
    reply_.set_status(moraine::jobs::JOB_FAILED);
    reply_.set_error(e.what());
  }
  reply_.set_seq(request_.seq());
  reply_.set_worker_us(static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start).count()));
  send_reply();
  return ServeResult::kHandled;
}

JobClient::JobClient(zmq::context_t& context, const std::string& endpoint, std::size_t max_reply_bytes)
    : socket_(context, zmq::socket_type::req), endpoint_(endpoint), receive_buffer_(max_reply_bytes + 1) {
  socket_.set(zmq::sockopt::linger, 0);
  // After a timeout a plain REQ socket refuses to send again; relaxed + correlate lets the next
  // call go out and discards a late reply to the abandoned request.
  socket_.set(zmq::sockopt::req_relaxed, 1);
  socket_.set(zmq::sockopt::req_correlate, 1);
  try {
    socket_.connect(endpoint);
  } catch (const zmq::error_t& e) {
    throw std::runtime_error("job client: cannot connect to " + endpoint + ": " + e.what());
  }
}

std::string JobClient::call(const moraine::jobs::JobEnvelope& request, moraine::jobs::JobReply& reply,
                            std::chrono::milliseconds timeout) {
  encode_job(request, send_buffer_);
  std::string error = exchange(std::as_bytes(std::span(send_buffer_.data(), send_buffer_.size())), reply, timeout);
  return error.empty() ? check_seq(reply, request.seq()) : error;
}

std::string JobClient::check_seq(const moraine::jobs::JobReply& reply, std::uint64_t seq) const {
  if (reply.seq() == seq) return {};
  return "reply from " + endpoint_ + " carries seq " + std::to_string(reply.seq()) + ", expected " + std::to_string(seq);
}

std::string JobClient::call_raw(std::span<const std::byte> frame, moraine::jobs::JobReply& reply,
                                std::chrono::milliseconds timeout) {
  return exchange(frame, reply, timeout);
}

std::string JobClient::send(const moraine::jobs::JobEnvelope& request, std::chrono::milliseconds timeout) {
  encode_job(request, send_buffer_);
  return send_frame(std::as_bytes(std::span(send_buffer_.data(), send_buffer_.size())), timeout);
}

std::string JobClient::receive(moraine::jobs::JobReply& reply, std::uint64_t seq, std::chrono::milliseconds timeout) {
  std::string error = receive_reply(reply, timeout, timeout);
  return error.empty() ? check_seq(reply, seq) : error;
}

std::string JobClient::exchange(std::span<const std::byte> frame, moraine::jobs::JobReply& reply,
                                std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  if (std::string error = send_frame(frame, timeout); !error.empty()) return error;
  // Rounded up: ZeroMQ timeouts are whole milliseconds, and rounding down returned before the
  // caller's timeout had passed.
  return receive_reply(reply, std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()), timeout);
}

std::string JobClient::send_frame(std::span<const std::byte> frame, std::chrono::milliseconds timeout) {
  socket_.set(zmq::sockopt::sndtimeo, to_ms(timeout));
  if (!socket_.send(zmq::const_buffer(frame.data(), frame.size()), zmq::send_flags::none)) {
    return "could not send a job to " + endpoint_ + " within " + std::to_string(timeout.count()) + " ms";
  }
  return {};
}

std::string JobClient::receive_reply(moraine::jobs::JobReply& reply, std::chrono::milliseconds timeout,
                                     std::chrono::milliseconds shown) {
  socket_.set(zmq::sockopt::rcvtimeo, to_ms(timeout));
  const auto received = socket_.recv(zmq::mutable_buffer(receive_buffer_.data(), receive_buffer_.size()));
  if (!received) {
    return "no reply from " + endpoint_ + " within " + std::to_string(shown.count()) + " ms (peer dead or stuck)";
  }
  if (received->untruncated_size >= receive_buffer_.size()) {
    return "reply from " + endpoint_ + " of " + std::to_string(received->untruncated_size) +
           " bytes exceeds the limit of " + std::to_string(receive_buffer_.size() - 1) + " bytes";
  }
  reply.Clear();
  std::string error = decode_reply(std::span(receive_buffer_.data(), received->size), receive_buffer_.size(), reply);
  if (!error.empty()) return "bad reply from " + endpoint_ + ": " + error;
  return {};
}

}  // namespace moraine::messaging
