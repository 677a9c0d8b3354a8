#include "coordinator/control_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <stdexcept>
#include <thread>
#include <utility>

#include <grpcpp/server_posix.h>

#include "coordinator/private_socket.h"

namespace moraine::group {

using moraine::control::ServingState;

StageRecorder::StageRecorder(std::string name) : name_(std::move(name)), window_(kWindow), sort_scratch_(kWindow) {}

void StageRecorder::record(std::uint64_t tokens, std::uint64_t experts, std::uint64_t bytes,
                           double latency_us) {
  std::lock_guard lock(mu_);
  tokens_ += tokens;
  experts_ += experts;
  bytes_ += bytes;
  ++steps_;
  std::size_t b = 0;
  while (latency_us > kBoundsUs[b]) ++b;
  ++counts_[b];
  sum_us_ += latency_us;
  max_us_ = std::max(max_us_, latency_us);
  window_[window_next_] = latency_us;
  window_next_ = (window_next_ + 1) % kWindow;
  window_fill_ = std::min(window_fill_ + 1, kWindow);
}

void StageRecorder::set_queue_depth(std::uint64_t depth) {
  std::lock_guard lock(mu_);
  depth_ = depth;
  max_depth_ = std::max(max_depth_, depth);
}

void StageRecorder::fill(moraine::control::StageStats& out, bool reset) {
  std::lock_guard lock(mu_);
  out.set_name(name_);
  out.set_tokens(tokens_);
  out.set_steps(steps_);
  out.set_queue_depth(depth_);
  out.set_max_queue_depth(max_depth_);
  out.set_experts_computed(experts_);
  out.set_bytes_read(bytes_);
  moraine::control::LatencyHistogram& h = *out.mutable_latency();
  for (std::size_t i = 0; i < kBoundsUs.size(); ++i) {
    h.add_upper_bounds_us(i + 1 == kBoundsUs.size() ? 1e300 : kBoundsUs[i]);
    h.add_counts(counts_[i]);
  }
  h.set_samples(steps_);
  h.set_sum_us(sum_us_);
  h.set_max_us(max_us_);
  if (window_fill_ > 0) {
    std::copy_n(window_.begin(), window_fill_, sort_scratch_.begin());
    const auto first = sort_scratch_.begin();
    const auto last = first + static_cast<std::ptrdiff_t>(window_fill_);
    std::sort(first, last);
    auto pct = [&](double p) { return first[static_cast<std::ptrdiff_t>(p * static_cast<double>(window_fill_ - 1))]; };
    h.set_p50_us(pct(0.50));
    h.set_p90_us(pct(0.90));
    h.set_p99_us(pct(0.99));
  }
  if (reset) {
    tokens_ = steps_ = experts_ = bytes_ = max_depth_ = 0;
    counts_.fill(0);
    sum_us_ = max_us_ = 0;
    window_next_ = window_fill_ = 0;
  }
}

namespace {
std::string unix_path(const std::string& address) { return address.rfind("unix:", 0) == 0 ? address.substr(5) : std::string(); }
}  // namespace

ControlServer::ControlServer(moraine::control::Role role, std::string instance, std::string address)
    : role_(role), instance_(std::move(instance)), address_(std::move(address)) {
  const std::string path = unix_path(address_);
  if (!path.empty()) ensure_private_dir(std::filesystem::path(path).parent_path().string());
}

ControlServer::~ControlServer() { stop(); }

StageRecorder& ControlServer::add_stage(const std::string& name) {
  stages_.push_back(std::make_unique<StageRecorder>(name));
  return *stages_.back();
}

void ControlServer::set_stats_hook(std::function<void(moraine::control::StatsReply&)> hook) {
  std::lock_guard lock(mu_);
  hook_ = std::move(hook);
}

void ControlServer::start() {
  const std::string path = unix_path(address_);
  grpc::ServerBuilder builder;
  // Not a unix socket (a test's TCP port): gRPC listens itself, without the peer check.
  if (path.empty()) builder.AddListeningPort(address_, grpc::InsecureServerCredentials());
  builder.RegisterService(this);
  for (grpc::Service* s : extra_services_) builder.RegisterService(s);
  server_ = builder.BuildAndStart();
  if (!server_) throw std::runtime_error(instance_ + ": cannot serve gRPC on " + address_);
  if (!path.empty()) listen_unix(path);
}

void ControlServer::listen_unix(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) throw std::runtime_error(instance_ + ": socket path too long: " + path);
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ::unlink(path.c_str());   // a socket file left by a killed predecessor would make the bind fail
  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (listen_fd_ < 0 || wake_fd_ < 0 || ::bind(listen_fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 ||
      ::chmod(path.c_str(), 0600) != 0 || ::listen(listen_fd_, 128) != 0) {
    const std::string err = std::strerror(errno);
    stop();
    throw std::runtime_error(instance_ + ": cannot serve gRPC on " + address_ + ": " + err);
  }
  acceptor_ = std::thread([this] { accept_loop(); });
}

// gRPC's own unix listener gives a server no way to see a connection's peer: this loop accepts,
// checks SO_PEERCRED and hands the accepted socket to gRPC (AddInsecureChannelFromFd).
void ControlServer::accept_loop() {
  const uid_t self = ::geteuid();
  while (true) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (::poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      std::cerr << instance_ << ": control socket poll: " << std::strerror(errno) << std::endl;
      return;
    }
    if (p[1].revents) return;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;   // EAGAIN, or a peer that went away before it was accepted
    if (const std::string why = peer_problem(fd, self); !why.empty()) {
      ++refused_;
      std::cerr << instance_ << ": refused a control connection: " << why << std::endl;
      ::close(fd);
      continue;
    }
    grpc::AddInsecureChannelFromFd(server_.get(), fd);   // gRPC owns fd from here
  }
}

void ControlServer::stop() {
  if (wake_fd_ >= 0) {
    const std::uint64_t one = 1;
    if (::write(wake_fd_, &one, sizeof one) < 0) std::perror("control server: eventfd write");
  }
  if (acceptor_.joinable()) acceptor_.join();
  for (int* fd : {&listen_fd_, &wake_fd_})
    if (*fd >= 0) ::close(std::exchange(*fd, -1));
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    server_.reset();
  }
  if (const std::string path = unix_path(address_); !path.empty()) ::unlink(path.c_str());
}

void ControlServer::set_state(ServingState state, std::string detail) {
  std::lock_guard lock(mu_);
  state_ = state;
  detail_ = std::move(detail);
}

void ControlServer::request_shutdown() {
  {
    std::lock_guard lock(mu_);
    shutdown_ = true;
  }
  cv_.notify_all();
}

bool ControlServer::wait_shutdown(std::chrono::milliseconds d) {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, d, [&] { return shutdown_.load(); });
  return shutdown_.load();
}

std::uint64_t ControlServer::uptime_us() const {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                        std::chrono::steady_clock::now() - started_).count());
}

grpc::Status ControlServer::Health(grpc::ServerContext*, const moraine::control::HealthRequest*,
                                   moraine::control::HealthReply* reply) {
  std::lock_guard lock(mu_);
  reply->set_state(state_);
  reply->set_role(role_);
  reply->set_pid(static_cast<std::uint32_t>(::getpid()));
  reply->set_instance(instance_);
  reply->set_uptime_us(uptime_us());
  reply->set_detail(detail_);
  return grpc::Status::OK;
}

grpc::Status ControlServer::Stats(grpc::ServerContext*, const moraine::control::StatsRequest* req,
                                  moraine::control::StatsReply* reply) {
  reply->set_role(role_);
  reply->set_instance(instance_);
  reply->set_uptime_us(uptime_us());
  for (auto& s : stages_) s->fill(*reply->add_stages(), req->reset());
  std::function<void(moraine::control::StatsReply&)> hook;
  {
    std::lock_guard lock(mu_);
    hook = hook_;
  }
  if (hook) hook(*reply);
  return grpc::Status::OK;
}

grpc::Status ControlServer::Shutdown(grpc::ServerContext*, const moraine::control::ShutdownRequest*,
                                     moraine::control::ShutdownReply*) {
  set_state(moraine::control::DRAINING, "shutdown requested");
  request_shutdown();
  return grpc::Status::OK;
}

void ControlServer::set_in_flight_hook(std::function<std::uint64_t()> in_flight) {
  std::lock_guard lock(mu_);
  in_flight_ = std::move(in_flight);
}

bool ControlServer::accepting() {
  std::lock_guard lock(mu_);
  return state_ == moraine::control::SERVING;
}

grpc::Status ControlServer::Drain(grpc::ServerContext* ctx, const moraine::control::DrainRequest* req,
                                  moraine::control::DrainReply* reply) {
  std::function<std::uint64_t()> in_flight;
  {
    std::lock_guard lock(mu_);
    if (state_ != moraine::control::STOPPED) {
      state_ = moraine::control::DRAINING;
      detail_ = "drain requested";
    }
    in_flight = in_flight_;
  }
  // deadline_ms 0 means none; the client's own deadline (or cancelling) still ends the wait.
  const auto until = req->deadline_ms() > 0 ? std::chrono::steady_clock::now() + std::chrono::milliseconds(req->deadline_ms())
                                            : std::chrono::steady_clock::time_point::max();
  std::uint64_t busy = in_flight ? in_flight() : 0;
  while (busy > 0 && std::chrono::steady_clock::now() < until && !ctx->IsCancelled() && !shutdown_requested()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    busy = in_flight();
  }
  reply->set_jobs_in_flight(busy);
  reply->set_drained(busy == 0);
  if (busy == 0) set_state(moraine::control::STOPPED, "drained");
  return grpc::Status::OK;
}

grpc::Status ControlServer::Configure(grpc::ServerContext*, const moraine::control::ConfigureRequest*,
                                      moraine::control::ConfigureReply*) {
  return {grpc::StatusCode::UNIMPLEMENTED, instance_ + " is configured by its flags at start (moraine-supervisor start --config FILE)"};
}

grpc::Status ControlServer::Load(grpc::ServerContext*, const moraine::control::LoadRequest*, moraine::control::LoadReply*) {
  return {grpc::StatusCode::UNIMPLEMENTED, instance_ + " loads the model given by -m / the group manifest at start"};
}

grpc::Status probe_health(const std::string& address, std::chrono::milliseconds timeout,
                          moraine::control::HealthReply& reply) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto stub = moraine::control::Control::NewStub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  return stub->Health(&ctx, {}, &reply);
}

std::string wait_serving(const std::string& address, std::chrono::milliseconds deadline, int child) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  const std::string path = address.rfind("unix:", 0) == 0 ? address.substr(5) : std::string();
  std::string last = "no answer";
  while (std::chrono::steady_clock::now() < until) {
    // A process that failed to start (bad budgets, missing model) will never serve.
    siginfo_t info{};
    if (child > 0 && ::waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
        info.si_pid == child) {
      return address + ": the process exited (status " + std::to_string(info.si_status) +
             ") before serving; its log says why";
    }
    // A process still loading has no socket yet. Probing it anyway would put the channel into
    // gRPC's reconnect back-off (1 s, 1.6 s, 2.6 s ...; seen adding ~5 s to a group start), so
    // wait for the file, then probe on a fresh channel with its own subchannel each time.
    if (!path.empty() && ::access(path.c_str(), F_OK) != 0) {
      last = "no socket " + path;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    moraine::control::HealthReply reply;
    const grpc::Status st = probe_health(address, std::chrono::milliseconds(500), reply);
    if (st.ok() && reply.state() == moraine::control::SERVING) return {};
    last = st.ok() ? "state " + moraine::control::ServingState_Name(reply.state()) + " " + reply.detail()
                   : st.error_message();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return address + ": not serving within the deadline (" + last + ")";
}

}  // namespace moraine::group
