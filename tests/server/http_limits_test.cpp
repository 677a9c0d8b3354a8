// The HTTP front end's limits and its security, in process and without a group (what is
// checked here is answered before a request reaches the coordinator): it binds 127.0.0.1 by
// default; --api-key guards every endpoint but /health; a body over --max-body is a 413 naming it,
// chunked or not; a connection over --max-connections gets a 429 with Retry-After and
// Connection: close; stop strings are bounded in number and length; a model name is only
// matched, never opened.
#include <httplib.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "coordinator/stop_strings.h"
#include "server/http_server.h"
#include "server/openai_api.h"

namespace moraine::server {
namespace {

using nlohmann::json;
const std::string kKey = "limits-key-0123456789";

// An HttpServer listening on a thread, stopped at the end.
struct Running {
  explicit Running(HttpOptions o) {
    if (o.model_ids.empty()) o.model_ids = {"test-model"};
    o.port = 0;
    o.socket_dir = "/nonexistent-moraine-socket-dir";   // no group: nothing here may need one
    server = std::make_unique<HttpServer>(o);
    port = server->bind();
    listener = std::thread([this] { server->listen(); });
  }
  ~Running() {
    server->drain_and_stop(std::chrono::milliseconds(100));
    listener.join();
  }
  httplib::Client client(const std::string& key = kKey) const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(10, 0);
    if (!key.empty()) c.set_default_headers({{"Authorization", "Bearer " + key}});
    return c;
  }
  std::unique_ptr<HttpServer> server;
  int port = 0;
  std::thread listener;
};

HttpOptions keyed() {
  HttpOptions o;
  o.api_key = kKey;
  return o;
}

json error_of(const httplib::Result& r) {
  return r ? json::parse(r->body, nullptr, false)["error"] : json();
}

// The local addresses LISTENing on `port` in /proc/net/tcp (hex "0100007F" is 127.0.0.1) and tcp6.
std::vector<std::string> listening_addresses(int port) {
  std::vector<std::string> out;
  char want[8];
  std::snprintf(want, sizeof want, "%04X", port);
  for (const char* table : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      std::istringstream ss(line);
      std::string slot, local, remote, state;
      ss >> slot >> local >> remote >> state;
      const size_t colon = local.find(':');
      if (state == "0A" && local.substr(colon + 1) == want) out.push_back(local.substr(0, colon));
    }
  }
  return out;
}

// A stop that comes before the listener thread listens ends that listener too (cpp-httplib's stop()
// alone does nothing before listen: the listener then accepted for good, and Running's destructor
// hung in 2 of ~7 runs of this file).
TEST(HttpLimits, AStopBeforeListenEndsTheListener) {
  HttpOptions o;
  o.model_ids = {"test-model"};
  o.port = 0;
  o.socket_dir = "/nonexistent-moraine-socket-dir";
  HttpServer server(o);
  server.bind();
  server.drain_and_stop(std::chrono::milliseconds(10));
  std::promise<void> done;
  std::future<void> finished = done.get_future();
  std::thread listener([&] {
    server.listen();
    done.set_value();
  });
  const bool ended = finished.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  if (!ended) server.drain_and_stop(std::chrono::milliseconds(10));   // it listens by now: this stop takes
  listener.join();
  EXPECT_TRUE(ended) << "listen() after drain_and_stop kept serving";
}

TEST(HttpLimits, BindsLoopbackUnlessTold) {
  EXPECT_EQ(HttpOptions{}.host, "127.0.0.1");
  Running s{HttpOptions{}};
  EXPECT_EQ(listening_addresses(s.port), std::vector<std::string>{"0100007F"});
}

TEST(HttpLimits, TheApiKeyGuardsEveryEndpointButHealth) {
  Running s{keyed()};
  struct Call {
    std::string method, path;
  };
  const std::vector<Call> guarded = {{"GET", "/v1/models"},  {"GET", "/models"},           {"GET", "/metrics"},
                                     {"POST", "/v1/chat/completions"}, {"POST", "/chat/completions"},
                                     {"POST", "/v1/completions"},      {"POST", "/completions"},
                                     {"GET", "/no-such-endpoint"},     {"OPTIONS", "/v1/models"}};
  // None, wrong, a prefix, one byte longer, another scheme: all the same 401.
  for (const std::string& auth : std::vector<std::string>{std::string(), "Bearer nope", "Bearer " + kKey.substr(0, kKey.size() - 1),
                                  "Bearer " + kKey + "0", "Basic " + kKey, kKey}) {
    for (const Call& c : guarded) {
      httplib::Client cl = s.client("");
      httplib::Headers h;
      if (!auth.empty()) h.emplace("Authorization", auth);
      httplib::Result r = c.method == "GET"    ? cl.Get(c.path.c_str(), h)
                          : c.method == "POST" ? cl.Post(c.path.c_str(), h, "{}", "application/json")
                                               : cl.Options(c.path.c_str(), h);
      ASSERT_TRUE(r) << c.method << " " << c.path;
      EXPECT_EQ(r->status, 401) << c.method << " " << c.path << " with '" << auth << "'";
      EXPECT_EQ(error_of(r)["code"], "invalid_api_key") << r->body;
    }
  }
  httplib::Client open = s.client("");
  const auto h = open.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 503) << "/health needs no key (503: no group is loading here)";
  httplib::Client good = s.client();
  EXPECT_EQ(good.Get("/v1/models")->status, 200);
  EXPECT_EQ(good.Get("/metrics")->status, 200);
  EXPECT_EQ(good.Post("/v1/chat/completions", "{}", "application/json")->status, 503);   // past the key: not ready
}

TEST(HttpLimits, ABodyOverMaxBodyIsA413NamingIt) {
  HttpOptions o = keyed();
  o.max_body_bytes = 1024;
  Running s{o};
  httplib::Client c = s.client();
  const std::string big(2000, 'a');
  const auto whole = c.Post("/v1/chat/completions", big, "application/json");
  ASSERT_TRUE(whole);
  EXPECT_EQ(whole->status, 413);
  EXPECT_NE(error_of(whole)["message"].get<std::string>().find("--max-body 1024 bytes"), std::string::npos) << whole->body;
  EXPECT_EQ(error_of(whole)["code"], "request_too_large");
  // Chunked (no Content-Length): httplib alone would read any size.
  const auto chunked_of = [](const std::string& body) {
    return [body](size_t offset, httplib::DataSink& sink) {
      if (offset < body.size()) {
        sink.write(body.data() + offset, std::min<size_t>(256, body.size() - offset));
      } else {
        sink.done();
      }
      return true;
    };
  };
  httplib::Client c2 = s.client();
  const auto over = c2.Post("/v1/chat/completions", chunked_of(std::string(64 * 1024, 'a')), "application/json");
  ASSERT_TRUE(over);
  EXPECT_EQ(over->status, 413) << over->body;
  EXPECT_NE(over->body.find("--max-body 1024"), std::string::npos) << over->body;
  // Under the limit, chunked: read whole and passed on (503: no group here to answer it).
  httplib::Client c3 = s.client();
  const auto under = c3.Post("/v1/chat/completions", chunked_of(std::string(900, ' ') + "{}"), "application/json");
  ASSERT_TRUE(under);
  EXPECT_EQ(under->status, 503) << under->body;
}

// Connects and sends nothing: the connection holds one of the server's connection threads.
int idle_connection(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a), 0);
  return fd;
}

// Sends one raw request and reads its whole response (headers and a Content-Length body, 3 s
// at most), then closes.
std::string raw_exchange(int port, const std::string& request) {
  const int fd = idle_connection(port);
  EXPECT_EQ(::write(fd, request.data(), request.size()), static_cast<ssize_t>(request.size()));
  timeval tv{3, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string got;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) {
    got.append(buf, static_cast<size_t>(n));
    const size_t end = got.find("\r\n\r\n"), len = got.find("Content-Length: ");
    if (end != std::string::npos && len != std::string::npos && got.size() >= end + 4 + std::stoul(got.substr(len + 16))) break;
  }
  ::close(fd);
  return got;
}

TEST(HttpLimits, AConnectionOverMaxConnectionsGetsA429AndIsToldToClose) {
  HttpOptions o = keyed();
  o.parallel = 1;
  o.queue = 1;
  o.max_connections = 3;
  Running s{o};
  std::vector<int> held;
  for (int i = 0; i < 3; ++i) held.push_back(idle_connection(s.port));
  // Asked until the held ones are all accepted (a loaded machine may take a while to).
  std::string get;
  for (int i = 0; i < 30 && get.rfind("HTTP/1.1 429", 0) != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    get = raw_exchange(s.port, "GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + kKey + "\r\n\r\n");
  }
  EXPECT_EQ(get.rfind("HTTP/1.1 429", 0), 0u) << get;
  EXPECT_NE(get.find("Retry-After: 1\r\n"), std::string::npos) << get;
  EXPECT_NE(get.find("Connection: close\r\n"), std::string::npos) << "the client must not keep it alive: " << get;
  EXPECT_NE(get.find("too_many_connections"), std::string::npos) << get;
  EXPECT_NE(get.find("3 connections are open (--max-connections)"), std::string::npos) << get;
  const std::string body = "{\"messages\": []}";
  const std::string post = raw_exchange(s.port,
                                        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + kKey +
                                            "\r\nContent-Type: application/json\r\nContent-Length: " +
                                            std::to_string(body.size()) + "\r\n\r\n" + body);
  EXPECT_EQ(post.rfind("HTTP/1.1 429", 0), 0u) << post;
  EXPECT_NE(post.find("Connection: close\r\n"), std::string::npos) << post;
  const std::string health = raw_exchange(s.port, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(health.rfind("HTTP/1.1 503", 0), 0u) << "/health is answered over the limit too: " << health;
  for (int fd : held) ::close(fd);
  // Room again once those connections are gone.
  httplib::Client c = s.client();
  int status = -1;
  for (int i = 0; i < 50 && status != 200; ++i) {
    if (i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const auto r = c.Get("/v1/models");
    status = r ? r->status : -1;
  }
  EXPECT_EQ(status, 200);
}

TEST(HttpLimits, MaxConnectionsMustLeaveRoomForTheQueue) {
  HttpOptions o;
  o.model_ids = {"m"};
  o.parallel = 2;
  o.queue = 8;
  o.max_connections = 10;
  try {
    HttpServer s(o);
    ADD_FAILURE() << "accepted --max-connections 10 with --parallel 2 --queue 8";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--max-connections 10"), std::string::npos) << e.what();
  }
  o.max_connections = 0;   // the default: the queue's, with room to spare
  HttpServer s(o);
  EXPECT_EQ(s.options().max_connections, 2 + 8 + kSpareConnections);
}

ApiError refusal_of(const json& body) {
  try {
    parse_request(body.dump(), Endpoint::kCompletions, {"m"});
  } catch (const ApiError& e) {
    return e;
  }
  return ApiError(0, "accepted");
}

TEST(HttpLimits, StopStringsAreBoundedInNumberAndLength) {
  json j = {{"prompt", "x"}, {"stop", std::vector<std::string>(group::kMaxStopStrings, std::string(group::kMaxStopBytes, 's'))}};
  EXPECT_EQ(parse_request(j.dump(), Endpoint::kCompletions, {"m"}).generate.sampling().stop_size(), 16);
  j["stop"] = std::vector<std::string>(group::kMaxStopStrings + 1, "s");
  ApiError e = refusal_of(j);
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.param, "stop");
  EXPECT_NE(std::string(e.what()).find("17 stop strings; at most 16"), std::string::npos) << e.what();
  j["stop"] = std::string(group::kMaxStopBytes + 1, 's');   // one string, not an array
  e = refusal_of(j);
  EXPECT_EQ(e.status, 400);
  EXPECT_NE(std::string(e.what()).find("513 bytes; at most 512"), std::string::npos) << e.what();
}

// Audit of "no request field reaches a file path": the model field is compared with the served
// names and nothing else (the server opens no file for a request; the coordinator gets no path).
TEST(HttpLimits, AModelNameIsOnlyMatched) {
  for (const std::string name : {"../../../../etc/passwd", "/etc/passwd", "test-model/../x", ""}) {
    const ApiError e = refusal_of({{"prompt", "x"}, {"model", name}});
    EXPECT_EQ(e.status, 404) << name;
    EXPECT_EQ(e.code, "model_not_found") << name;
  }
  const ApiRequest r = parse_request(json{{"prompt", "x"}, {"model", "m"}}.dump(), Endpoint::kCompletions, {"m"});
  EXPECT_EQ(r.generate.session_id(), "");
  EXPECT_EQ(r.generate.prompt(), "x");
}

}  // namespace
}  // namespace moraine::server
