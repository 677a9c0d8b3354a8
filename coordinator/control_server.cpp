#include "coordinator/control_server.h"

#include <algorithm>
#include <stdexcept>
#include <thread>
#include <sys/wait.h>
#include <unistd.h>

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

ControlServer::ControlServer(moraine::control::Role role, std::string instance, std::string address)
    : role_(role), instance_(std::move(instance)), address_(std::move(address)) {}

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
  // A socket file left by a killed predecessor would make the bind fail.
  if (address_.rfind("unix:", 0) == 0) ::unlink(address_.substr(5).c_str());
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address_, grpc::InsecureServerCredentials());
  builder.RegisterService(this);
  for (grpc::Service* s : extra_services_) builder.RegisterService(s);
  server_ = builder.BuildAndStart();
  if (!server_) throw std::runtime_error(instance_ + ": cannot serve gRPC on " + address_);
}

void ControlServer::stop() {
  if (!server_) return;
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  server_.reset();
  if (address_.rfind("unix:", 0) == 0) ::unlink(address_.substr(5).c_str());
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
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto stub = moraine::control::Control::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    moraine::control::HealthReply reply;
    const grpc::Status st = stub->Health(&ctx, {}, &reply);
    if (st.ok() && reply.state() == moraine::control::SERVING) return {};
    last = st.ok() ? "state " + moraine::control::ServingState_Name(reply.state()) + " " + reply.detail()
                   : st.error_message();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return address + ": not serving within the deadline (" + last + ")";
}

}  // namespace moraine::group
