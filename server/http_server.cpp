#include "server/http_server.h"

#include <httplib.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <random>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include "coordinator/group_layout.h"
#include "proto/control.grpc.pb.h"
#include "proto/generate.grpc.pb.h"
#include "common/chat/chat_template.h"
#include "server/openai_api.h"

namespace moraine::server {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

// httplib 0.11 listens with a backlog of 5: 64 clients reconnecting after their keep-alive
// count overflowed it, and the kernel reset connections whose request was already sent (56 of
// 100k requests failed with a read error in the load test). Linux takes a second listen() on a
// listening socket as a new backlog.
class BackloggedServer : public httplib::Server {
 public:
  void widen_backlog(int n) { ::listen(svr_sock_, n); }
};

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) {
  if (e.retry_after_s > 0) res.set_header("Retry-After", std::to_string(e.retry_after_s));
  send_json(res, e.status, e.body());
}

ApiError retry_later(int status, const std::string& message, std::string code) {
  ApiError e(status, message, {}, {}, std::move(code));
  e.retry_after_s = 1;
  return e;
}

// Whether `given` is `expected` in a time that depends on expected's length only, not on where
// they first differ: the API key must not leak a byte at a time through response timing.
bool constant_time_equal(const std::string& given, const std::string& expected) {
  volatile unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i)
    diff = diff | static_cast<unsigned char>((i < given.size() ? given[i] : 0) ^ expected[i]);
  return diff == 0;
}

// Set on a thread of ConnectionPool's refusal pool: the connection it serves is over the limit.
thread_local bool t_over_connection_limit = false;

// httplib serves each accepted connection as one task until the connection closes, so counting
// running tasks counts open connections: up to `limit` go to the pool, one beyond it to a few
// refusal threads, where each request is answered 429 with Connection: close.
class ConnectionPool : public httplib::TaskQueue {
 public:
  ConnectionPool(size_t limit, size_t refusers) : limit_(limit), pool_(limit), refusers_(refusers) {}
  void enqueue(std::function<void()> fn) override {
    if (open_.fetch_add(1) >= limit_) {   // only the listening thread enqueues
      --open_;
      refusers_.enqueue([fn = std::move(fn)] {
        t_over_connection_limit = true;
        fn();
        t_over_connection_limit = false;
      });
      return;
    }
    pool_.enqueue([this, fn = std::move(fn)] {
      fn();
      --open_;
    });
  }
  void shutdown() override {
    pool_.shutdown();
    refusers_.shutdown();
  }

 private:
  std::atomic<size_t> open_{0};
  size_t limit_;
  httplib::ThreadPool pool_, refusers_;
};

std::string random_id(const char* prefix) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  char hex[25];
  std::snprintf(hex, sizeof hex, "%08llx%016llx", static_cast<unsigned long long>(rng() & 0xffffffffu),
                static_cast<unsigned long long>(rng()));
  return std::string(prefix) + hex;
}

// A Generate call's failure as the HTTP status a client can act on.
// `input`: the request's field the context limit is about (messages or prompt).
ApiError error_of(const grpc::Status& st, const std::string& input) {
  switch (st.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT: return ApiError(400, st.error_message());
    case grpc::StatusCode::OUT_OF_RANGE: return ApiError(400, st.error_message(), input, {}, "context_length_exceeded");
    case grpc::StatusCode::UNAVAILABLE: {
      // The front end's one peer is the coordinator: its socket refused or closed means that it
      // stopped, died or is restarting with the group (the supervisor restarts it).
      ApiError e(503, "the coordinator is not reachable: it stopped, died or is restarting (" + st.error_message() + "); retry it",
                 {}, {}, "service_unavailable");
      e.retry_after_s = 1;
      return e;
    }
    case grpc::StatusCode::CANCELLED: return ApiError(499, "the request was cancelled");
    case grpc::StatusCode::DEADLINE_EXCEEDED: return ApiError(503, "the model group did not answer in time");
    default:
      // A step that failed after its retries (a worker lost and not back in time): the group
      // recovers on its own; the request may be sent again.
      return ApiError(503, "the model group failed during the request (" + st.error_message() + "); retry it", {},
                      "service_unavailable");
  }
}

// One Generate call: the context that cancels it and its stream of chunks.
struct Call {
  std::shared_ptr<generate::Coordinator::Stub> stub;   // its channel outlives the call
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<generate::GenerateChunk>> reader;
  bool finished = false;
  grpc::Status finish() {
    finished = true;
    return reader->Finish();
  }
  ~Call() {
    if (reader && !finished) {   // a response never sent (the client left first): cancel it
      ctx.TryCancel();
      reader->Finish();
    }
  }
};

}  // namespace

// Whether the client of a request still holds its connection, for the requests whose answer is
// written only at the end (non-streaming): httplib 0.11 gives a handler no socket, so the socket
// is found once among this process's descriptors by the request's two ends, then polled for the
// peer's hang-up (POLLRDHUP) between tokens. A streamed request notices a failed write instead.
class ConnectionWatch {
 public:
  explicit ConnectionWatch(const httplib::Request& req) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("/proc/self/fd", ec)) {
      const int fd = std::atoi(e.path().filename().c_str());
      sockaddr_storage peer{}, self{};
      socklen_t pl = sizeof peer, sl = sizeof self;
      if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0) continue;
      if (::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &sl) != 0) continue;
      if (port_of(peer) == req.remote_port && port_of(self) == req.local_port) {
        fd_ = fd;
        break;
      }
    }
  }
  // False once the peer hung up; true while it is there (or its socket was not found).
  bool open() {
    if (fd_ < 0 || Clock::now() < next_) return true;
    next_ = Clock::now() + std::chrono::milliseconds(50);
    pollfd p{fd_, static_cast<short>(POLLRDHUP), 0};
    return ::poll(&p, 1, 0) <= 0 || !(p.revents & (POLLRDHUP | POLLHUP | POLLERR));
  }

 private:
  static int port_of(const sockaddr_storage& a) {
    if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
    if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
    return -1;
  }
  int fd_ = -1;
  Clock::time_point next_{};
};

namespace {

// The coordinator's counters and the gpu_worker's expert slots by tier, for /metrics.
void append_group_metrics(const std::string& socket_dir, std::string& out) {
  out += "# HELP moraine_group_counter a counter of a group process (moraine stats)\n# TYPE moraine_group_counter counter\n";
  uint64_t slots = 0, vram_slots = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(socket_dir, ec)) {
    if (e.path().extension() != ".sock") continue;
    const std::string inst = e.path().stem().string();
    auto stub = control::Control::NewStub(
        grpc::CreateChannel(group::control_address(socket_dir, inst), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    // Short: a stuck process must not hold a scrape for long (it is then left out of this one).
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    control::StatsReply r;
    if (!stub->Stats(&ctx, {}, &r).ok()) continue;
    for (const auto& [k, v] : r.counters()) {
      if (k.rfind("layer_", 0) == 0) {
        (k.find("_vram_slots") != std::string::npos ? vram_slots : slots) += v;
        continue;
      }
      out += "moraine_group_counter{instance=\"" + inst + "\",name=\"" + k + "\"} " + std::to_string(v) + "\n";
    }
  }
  out += "# HELP moraine_expert_slots_total routed-expert slots computed, by where the expert was\n"
         "# TYPE moraine_expert_slots_total counter\n";
  out += "moraine_expert_slots_total{tier=\"vram\"} " + std::to_string(vram_slots) + "\n";
  out += "moraine_expert_slots_total{tier=\"other\"} " + std::to_string(slots >= vram_slots ? slots - vram_slots : 0) + "\n";
}

}  // namespace

Admission::Result Admission::enter(const std::function<bool()>& wanted) {
  std::unique_lock l(mu_);
  if (draining_) return Result::kDraining;
  if (running_ < parallel_) {
    ++running_;
    return Result::kAdmitted;
  }
  if (waiting_ >= queue_) return Result::kQueueFull;
  ++waiting_;
  bool gone = false;
  while (!cv_.wait_for(l, std::chrono::milliseconds(50), [&] { return draining_ || running_ < parallel_; })) {
    if (wanted && !wanted()) {
      gone = true;
      break;
    }
  }
  --waiting_;
  if (gone) {
    cv_.notify_all();   // wait_idle may be waiting for the queue to empty
    return Result::kGone;
  }
  if (draining_) return Result::kDraining;
  ++running_;
  return Result::kAdmitted;
}

void Admission::leave() {
  {
    std::lock_guard l(mu_);
    --running_;
  }
  cv_.notify_all();
}

void Admission::drain() {
  {
    std::lock_guard l(mu_);
    draining_ = true;
  }
  cv_.notify_all();
}

bool Admission::wait_idle(std::chrono::milliseconds deadline) {
  std::unique_lock l(mu_);
  return cv_.wait_for(l, deadline, [&] { return running_ == 0 && waiting_ == 0; });
}

int64_t Admission::running() const {
  std::lock_guard l(mu_);
  return running_;
}
int64_t Admission::waiting() const {
  std::lock_guard l(mu_);
  return waiting_;
}

HttpServer::HttpServer(HttpOptions o)
    : o_(std::move(o)), http_(std::make_unique<BackloggedServer>()), admission_(o_.parallel, o_.queue) {
  if (o_.parallel < 1 || o_.queue < 0) throw std::invalid_argument("--parallel must be >= 1 and --queue >= 0");
  if (o_.model_ids.empty()) throw std::invalid_argument("the server needs a model id");
  if (o_.max_connections == 0) o_.max_connections = o_.parallel + o_.queue + kSpareConnections;
  // Fewer would refuse connections while the request queue still had room.
  if (o_.max_connections < o_.parallel + o_.queue + 1)
    throw std::invalid_argument("--max-connections " + std::to_string(o_.max_connections) + " must be above --parallel + --queue (" +
                                std::to_string(o_.parallel + o_.queue) + ")");
  // A thread per connection (httplib serves a connection on one thread until it closes).
  const size_t limit = static_cast<size_t>(o_.max_connections);
  http_->new_task_queue = [limit] { return new ConnectionPool(limit, 4); };
  http_->set_payload_max_length(o_.max_body_bytes);
  http_->set_read_timeout(30, 0);
  http_->set_write_timeout(30, 0);
  routes();
}

HttpServer::~HttpServer() = default;

int HttpServer::bind() {
  if (o_.port == 0) {
    const int port = http_->bind_to_any_port(o_.host);
    if (port <= 0) throw std::runtime_error("cannot bind an HTTP port on " + o_.host);
    static_cast<BackloggedServer&>(*http_).widen_backlog(1024);
    o_.port = port;
    return port;
  }
  if (!http_->bind_to_port(o_.host, o_.port))
    throw std::runtime_error("cannot listen on " + o_.host + ":" + std::to_string(o_.port) + " (in use, or not an address here)");
  static_cast<BackloggedServer&>(*http_).widen_backlog(1024);
  return o_.port;
}

void HttpServer::listen() {
  listen_entered_ = true;
  if (!stop_requested_) http_->listen_after_bind();
  listen_returned_ = true;
}

void HttpServer::drain_and_stop(std::chrono::milliseconds deadline) {
  draining_ = true;
  admission_.drain();
  if (!admission_.wait_idle(deadline)) std::cerr << "moraine serve: requests still running after the drain deadline\n";
  stop_requested_ = true;
  while (listen_entered_ && !listen_returned_ && !http_->is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  http_->stop();
}

std::shared_ptr<generate::Coordinator::Stub> HttpServer::coordinator() {
  std::lock_guard l(stub_mu_);
  return stub_;
}

// A channel of its own (not sharing gRPC's global subchannel), reconnecting within 0.1-1 s: after
// the coordinator's restart the old channel's connection attempts timed out waiting for the
// server's SETTINGS for ~8 s, while a new client connected at once (serve_fault_test; a restart
// takes ~0.3 s here). At most one new channel each 200 ms, whatever the number of failed calls.
void HttpServer::coordinator_unreachable() {
  std::lock_guard l(stub_mu_);
  if (stub_ && Clock::now() - stub_made_ < std::chrono::milliseconds(200)) return;
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  stub_ = generate::Coordinator::NewStub(grpc::CreateCustomChannel(
      group::control_address(o_.socket_dir, group::kCoordinatorInstance), grpc::InsecureChannelCredentials(), args));
  stub_made_ = Clock::now();
}

void HttpServer::routes() {
  coordinator_unreachable();   // the first stub

  // Before the body is read: a refused request costs no more than its headers.
  http_->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    return admit_connection(req, res) ? httplib::Server::HandlerResponse::Unhandled : httplib::Server::HandlerResponse::Handled;
  });
  // Errors httplib answers itself (unknown path, a body over the limit) in OpenAI's shape too.
  http_->set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 413) return send_error(res, body_too_large());
    const std::string what = res.status == 404 ? "no such endpoint: " + req.method + " " + req.path : "the request could not be handled";
    send_error(res, ApiError(res.status, what));
  });
  http_->set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, ApiError(500, "internal error: " + what));
  });

  http_->Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (draining_) return send_json(res, 503, {{"status", "draining"}});
    if (!ready_) return send_json(res, 503, {{"status", "loading"}});
    send_json(res, 200, {{"status", "ok"}});
  });
  http_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    metrics_.queue(admission_.running(), admission_.waiting());
    std::string text = metrics_.text();
    if (ready_) append_group_metrics(o_.socket_dir, text);
    res.set_content(text, "text/plain; version=0.0.4");
  });
  const auto models = [this](const httplib::Request&, httplib::Response& res) {
    json data = json::array();
    data.push_back({{"id", o_.model_ids.front()}, {"object", "model"}, {"created", 0}, {"owned_by", "moraine"}});
    send_json(res, 200, {{"object", "list"}, {"data", data}});
  };
  http_->Get("/v1/models", models);
  http_->Get("/models", models);

  // The body read here, not by httplib: httplib 0.11 bounds a body by Content-Length only, and
  // would buffer a chunked one of any size. One over the limit is read on (not kept) up to
  // kDrainBytes more, so that its client, still sending, reads the 413 instead of a reset.
  const auto post = [this](const char* path, Endpoint endpoint) {
    http_->Post(path, [this, endpoint](const httplib::Request& q, httplib::Response& r, const httplib::ContentReader& read) {
      constexpr size_t kDrainBytes = 16u << 20;
      std::string body;
      size_t total = 0;
      const bool ok = read([&](const char* data, size_t n) {
        total += n;
        if (total <= o_.max_body_bytes) body.append(data, n);
        return total <= o_.max_body_bytes + kDrainBytes;
      });
      if (total > o_.max_body_bytes || r.status == 413) {
        if (!ok) r.set_header("Connection", "close");   // the rest of the body is still coming
        return send_error(r, body_too_large());
      }
      if (!ok) return send_error(r, ApiError(400, "the request body could not be read"));
      if (t_over_connection_limit) return refuse_connection(q, r);
      generate(q, body, r, endpoint);
    });
  };
  post("/v1/chat/completions", Endpoint::kChat);
  post("/v1/completions", Endpoint::kCompletions);
  post("/chat/completions", Endpoint::kChat);
  post("/completions", Endpoint::kCompletions);
}

ApiError HttpServer::body_too_large() const {
  return ApiError(413, "the request body is larger than the server accepts (--max-body " + std::to_string(o_.max_body_bytes) + " bytes)",
                  {}, {}, "request_too_large");
}

void HttpServer::refuse_connection(const httplib::Request& req, httplib::Response& res) {
  // The client closes on this (httplib 0.11 lets a handler close no connection), and its retry
  // comes on a new connection, which the pool may have room for. Only once the request is read
  // whole: bytes left unread would be taken for the next request.
  res.set_header("Connection", "close");
  metrics_.request_done(req.path, 429);
  send_error(res, retry_later(429, "the server is busy: " + std::to_string(o_.max_connections) +
                                       " connections are open (--max-connections); retry later", "too_many_connections"));
}

bool HttpServer::admit_connection(const httplib::Request& req, httplib::Response& res) {
  // /health is cheap, and what a load balancer asks when the server is busy. A request with a
  // body is refused once its body is read (routes()).
  const bool has_body = req.has_header("Transfer-Encoding") || req.get_header_value<uint64_t>("Content-Length") > 0;
  if (t_over_connection_limit && req.path != "/health" && !has_body) {
    refuse_connection(req, res);
    return false;
  }
  if (o_.api_key.empty() || req.path == "/health") return true;
  if (constant_time_equal(req.get_header_value("Authorization"), "Bearer " + o_.api_key)) return true;
  send_error(res, ApiError(401, "a valid API key is required: Authorization: Bearer KEY", {}, {}, "invalid_api_key"));
  metrics_.request_done(req.path, 401);
  return false;
}

// One generation request from the HTTP side: what it asked, its Generate call, its ids.
struct Exchange {
  ApiRequest api;
  std::shared_ptr<Call> call;
  std::string id, name, input;   // name: the endpoint for metrics; input: messages or prompt
  int64_t created = 0;
  Clock::time_point t0;
  std::shared_ptr<void> slot;   // the admission slot, released when the last copy goes
};

void HttpServer::generate(const httplib::Request& req, const std::string& body, httplib::Response& res, Endpoint endpoint) {
  auto x = std::make_shared<Exchange>();
  x->t0 = Clock::now();
  x->name = endpoint == Endpoint::kChat ? "/v1/chat/completions" : "/v1/completions";
  x->input = endpoint == Endpoint::kChat ? "messages" : "prompt";
  const auto answer_error = [&](const ApiError& e) {
    send_error(res, e);
    metrics_.request_done(x->name, e.status);
  };
  if (!ready_ || draining_) return answer_error(ApiError(503, draining_ ? "the server is stopping" : "the model is still loading"));
  try {
    x->api = parse_request(body, endpoint, o_.model_ids);
    if (endpoint == Endpoint::kChat) {
      x->api.output = chat_output_format(o_.chat_template.get(), x->api.has_tools, x->api.generate.chat_json(),
                                         random_id("call_") + "_");
      // Harmony's markers are special tokens: the text must carry them for the parser.
      if (x->api.output.format == chat::ToolCallFormat::kHarmony) x->api.generate.mutable_sampling()->set_render_special(true);
    }
  } catch (const ApiError& e) {
    return answer_error(e);
  }
  ConnectionWatch client(req);   // a client that leaves while queued leaves the queue
  const Admission::Result admitted = admission_.enter([&] { return client.open(); });
  if (admitted == Admission::Result::kGone) {
    metrics_.request_done(x->name, 499);
    return;
  }
  if (admitted == Admission::Result::kQueueFull) {
    metrics_.rejected_queue_full();
    return answer_error(retry_later(429, "the server is busy: " + std::to_string(o_.parallel) + " requests running and " +
                                             std::to_string(o_.queue) + " queued (--parallel, --queue); retry later",
                                    "queue_full"));
  }
  if (admitted == Admission::Result::kDraining) return answer_error(ApiError(503, "the server is stopping"));
  x->slot = std::shared_ptr<void>(nullptr, [this](void*) { admission_.leave(); });
  x->call = std::make_shared<Call>();
  x->call->stub = coordinator();
  x->call->reader = x->call->stub->Generate(&x->call->ctx, x->api.generate);
  // The first chunk comes after the prefill: an error before it (the context, a bad field the
  // coordinator found) is still an HTTP status, streaming or not.
  auto first = std::make_shared<generate::GenerateChunk>();
  if (!x->call->reader->Read(first.get())) {
    const grpc::Status st = x->call->finish();
    if (st.error_code() == grpc::StatusCode::UNAVAILABLE) coordinator_unreachable();
    return answer_error(st.ok() ? ApiError(503, "the coordinator ended the request without an answer") : error_of(st, x->input));
  }
  x->id = random_id(endpoint == Endpoint::kChat ? "chatcmpl-" : "cmpl-");
  x->created = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  metrics_.first_token(seconds_since(x->t0));
  if (!x->api.stream) return answer_whole(*x, *first, client, res);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider("text/event-stream", [this, x, first](size_t, httplib::DataSink& sink) {
    const bool ok = stream(*x, *first, sink);
    x->slot.reset();
    return ok;
  });
}

void HttpServer::answer_whole(Exchange& x, generate::GenerateChunk& chunk, ConnectionWatch& client,
                              httplib::Response& res) {
  Generated g;
  std::string error;
  for (bool more = true; more; more = x.call->reader->Read(&chunk)) {
    if (!client.open()) {
      x.call->ctx.TryCancel();   // the client went away: the coordinator stops at its next step
      x.call->finish();
      metrics_.request_done(x.name, 499);
      return;
    }
    g.text += chunk.text();
    for (const auto& lp : chunk.logprobs()) g.logprobs.push_back(lp);
    if (!chunk.error().empty()) error = chunk.error();
    if (chunk.finish() != generate::FINISH_REASON_UNSPECIFIED) {
      g.finish = chunk.finish();
      g.timing = chunk.timing();
    }
  }
  const grpc::Status st = x.call->finish();
  if (st.error_code() == grpc::StatusCode::UNAVAILABLE) coordinator_unreachable();
  if (!st.ok() || !error.empty()) {
    const ApiError e = error_of(st.ok() ? grpc::Status(grpc::StatusCode::INTERNAL, error) : st, x.input);
    send_error(res, e);
    metrics_.request_done(x.name, e.status);
    return;
  }
  metrics_.tokens(g.timing.prompt_tokens(), g.timing.generated_tokens(), g.timing.cached_tokens());
  metrics_.request_seconds(seconds_since(x.t0));
  metrics_.request_done(x.name, 200);
  send_json(res, 200, response_json(x.api, x.id, x.created, g));
}

bool HttpServer::stream(Exchange& x, generate::GenerateChunk& chunk, httplib::DataSink& sink) {
  const auto event = [&](const json& j) {
    const std::string line = "data: " + j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
    return sink.write(line.data(), line.size());
  };
  bool first_event = true, ok = true;
  generate::GenerateTiming timing;
  std::string error;
  ChunkStream chunks(x.api, x.id, x.created);
  auto last = Clock::now();
  for (bool more = true; more && ok; more = x.call->reader->Read(&chunk)) {
    if (!chunk.error().empty()) {
      error = chunk.error();
      continue;
    }
    const std::vector<generate::TokenLogprob> lps(chunk.logprobs().begin(), chunk.logprobs().end());
    if (chunk.finish() != generate::FINISH_REASON_UNSPECIFIED) timing = chunk.timing();
    const json c = chunks.chunk(chunk.text(), lps, chunk.finish());
    if (c.is_null()) continue;   // text held back (it may begin a tool call)
    if (!first_event) metrics_.inter_token(seconds_since(last));
    last = Clock::now();
    ok = event(c);
    first_event = false;
  }
  if (!ok) {
    x.call->ctx.TryCancel();   // the client went away: the coordinator stops at its next step
    x.call->finish();
    metrics_.request_done(x.name, 499);
    return false;
  }
  const grpc::Status st = x.call->finish();
  if (st.error_code() == grpc::StatusCode::UNAVAILABLE) coordinator_unreachable();
  if (!st.ok() || !error.empty()) {
    event(error_of(st.ok() ? grpc::Status(grpc::StatusCode::INTERNAL, error) : st, x.input).body());
    metrics_.request_done(x.name, 503);
  } else {
    if (x.api.include_usage) event(stream_usage_json(x.api, x.id, x.created, timing));
    metrics_.tokens(timing.prompt_tokens(), timing.generated_tokens(), timing.cached_tokens());
    metrics_.request_seconds(seconds_since(x.t0));
    metrics_.request_done(x.name, 200);
  }
  const std::string done = "data: [DONE]\n\n";
  sink.write(done.data(), done.size());
  sink.done();
  return true;
}

}  // namespace moraine::server
