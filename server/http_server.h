// The OpenAI-compatible HTTP front end (cpp-httplib) of a running group: /v1/chat/completions,
// /v1/completions (whole or streamed as server-sent events), /v1/models, /health, /metrics.
// Each request becomes one Generate call on the coordinator's socket. At most `parallel`
// requests are admitted at once and `queue` more wait for a slot; beyond that a 429. At most
// `max_connections` connections are served at once; a request on one beyond them gets a 429
// (Retry-After, Connection: close). A request
// whose client goes away (streamed or not) cancels its Generate call (the coordinator stops at
// its next step).
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "proto/generate.grpc.pb.h"
#include "server/metrics.h"
#include "server/openai_api.h"

namespace moraine::chat {
class ChatTemplate;
}
namespace httplib {
class Server;
struct Request;
struct Response;
class DataSink;
}

namespace moraine::server {

// Connections beyond the admitted and queued requests' for /health, /metrics and the 429s of a
// full queue (--max-connections' default).
inline constexpr int kSpareConnections = 8;

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8080;              // 0: any free port (bind() says which)
  int parallel = 1;             // requests admitted at once
  int queue = 64;               // requests waiting for a slot; more get 429
  std::string api_key;          // non-empty: every endpoint but /health needs "Authorization: Bearer KEY"
  size_t max_body_bytes = 8u << 20;   // a larger request body (chunked or not) gets 413
  int max_connections = 0;      // connections served at once; 0: parallel + queue + kSpareConnections
  std::vector<std::string> model_ids;   // the names the model answers to; the first is reported
  std::string socket_dir;       // the group's (the coordinator's Generate socket is there)
  // The GGUF's chat template (the coordinator renders with the same): which tool-call format the
  // model writes. Null: none, generated text is content.
  std::shared_ptr<const chat::ChatTemplate> chat_template;
};

// Slots for `parallel` running requests and a bounded queue behind them.
class Admission {
 public:
  Admission(int parallel, int queue) : parallel_(parallel), queue_(queue) {}
  enum class Result { kAdmitted, kQueueFull, kDraining, kGone };
  // Blocks while queued; `wanted` is asked every 50 ms meanwhile (false: the client left, kGone).
  Result enter(const std::function<bool()>& wanted = {});
  void leave();
  void drain();                 // refuse new and queued requests
  bool wait_idle(std::chrono::milliseconds deadline);   // until nothing runs
  int64_t running() const;
  int64_t waiting() const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int parallel_, queue_, running_ = 0, waiting_ = 0;
  bool draining_ = false;
};

struct Exchange;          // one generation request (http_server.cpp)
class ConnectionWatch;    // whether its client is still connected (http_server.cpp)

class HttpServer {
 public:
  explicit HttpServer(HttpOptions o);
  ~HttpServer();
  int bind();                   // binds host:port; returns the port. Throws when it cannot.
  void listen();                // serves on the calling thread until stop()
  void set_ready(bool ready) { ready_ = ready; }   // /health: 200 once the group serves
  // Stops admitting (503), waits up to `deadline` for the admitted requests, stops listening.
  void drain_and_stop(std::chrono::milliseconds deadline);
  const HttpOptions& options() const { return o_; }

 private:
  void routes();
  // POST /v1/chat/completions and /v1/completions: parse, admit, start the Generate call, then
  // answer whole or stream (the chunk is the call's first).
  void generate(const httplib::Request& req, const std::string& body, httplib::Response& res, Endpoint endpoint);
  // Whether the request may go on (the key, the connection limit); else the refusal is in res.
  bool admit_connection(const httplib::Request& req, httplib::Response& res);
  ApiError body_too_large() const;   // the 413 that names --max-body
  void refuse_connection(const httplib::Request& req, httplib::Response& res);   // 429: over --max-connections
  void answer_whole(Exchange& x, generate::GenerateChunk& chunk, ConnectionWatch& client, httplib::Response& res);
  bool stream(Exchange& x, generate::GenerateChunk& chunk, httplib::DataSink& sink);
  // The coordinator's stub, and a fresh one (own channel) after a call found it unreachable.
  std::shared_ptr<generate::Coordinator::Stub> coordinator();
  void coordinator_unreachable();
  HttpOptions o_;
  std::mutex stub_mu_;
  std::shared_ptr<generate::Coordinator::Stub> stub_;
  std::chrono::steady_clock::time_point stub_made_{};
  std::unique_ptr<httplib::Server> http_;
  std::atomic<bool> ready_{false}, draining_{false};
  // cpp-httplib 0.11's stop() does nothing until listen_after_bind has marked the server running,
  // so a stop that came first left the listener accepting for good (http_limits_test hung in 2 of
  // ~7 runs, session 23): drain_and_stop waits for a listen() under way to be running, and a
  // listen() that starts after a stop returns at once.
  std::atomic<bool> stop_requested_{false}, listen_entered_{false}, listen_returned_{false};
  Admission admission_;
  Metrics metrics_;
};

}  // namespace moraine::server
