#include "server/chat_client.h"

#include <httplib.h>
#include <signal.h>

#include <atomic>
#include <iostream>

#include <nlohmann/json.hpp>

namespace moraine::server {
namespace {

using nlohmann::json;

volatile sig_atomic_t g_interrupted = 0;
extern "C" void on_interrupt(int) { g_interrupted = 1; }

// SIGINT sets a flag the streaming reader polls; SA_RESTART keeps a pending getline reading.
void install_interrupt() {
  struct sigaction sa {};
  sa.sa_handler = on_interrupt;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
}

// One turn: streams the answer to `out` and returns its text (what arrived before a Ctrl-C).
std::string ask(httplib::Client& cli, const std::string& prefix, const ChatOptions& o, const json& messages,
                std::ostream& out, std::string& error) {
  json body = {{"messages", messages}, {"stream", true}, {"temperature", o.temperature}};
  if (o.max_tokens > 0) body["max_tokens"] = o.max_tokens;
  httplib::Headers headers;
  if (!o.api_key.empty()) headers.emplace("Authorization", "Bearer " + o.api_key);
  std::string answer, pending, error_body;
  int status = 0;
  g_interrupted = 0;
  httplib::Request req;
  req.method = "POST";
  req.path = prefix + "/v1/chat/completions";
  req.headers = headers;
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.response_handler = [&](const httplib::Response& r) {
    status = r.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (g_interrupted) return false;   // closing the connection cancels the request on the server
    if (status != 200) {
      error_body.append(data, n);
      return true;
    }
    pending.append(data, n);
    for (size_t nl; (nl = pending.find("\n\n")) != std::string::npos;) {
      const std::string ev = pending.substr(0, nl);
      pending.erase(0, nl + 2);
      if (ev.rfind("data: ", 0) != 0) continue;
      const std::string payload = ev.substr(6);
      if (payload == "[DONE]") continue;
      const json j = json::parse(payload, nullptr, false);
      if (j.contains("error")) {
        error = j["error"].value("message", payload);
        continue;
      }
      if (!j.contains("choices") || j["choices"].empty()) continue;
      const json& delta = j["choices"][0]["delta"];
      if (delta.contains("content") && delta["content"].is_string()) {
        const std::string piece = delta["content"].get<std::string>();
        answer += piece;
        out << piece << std::flush;
      }
    }
    return !g_interrupted;
  };
  const httplib::Result res = cli.send(req);
  if (g_interrupted) {
    out << "\n[stopped]" << std::endl;
    return answer;
  }
  if (!res) {
    error = "the server did not answer (" + httplib::to_string(res.error()) + ")";
  } else if (status != 200) {
    const json j = json::parse(error_body, nullptr, false);
    error = "HTTP " + std::to_string(status) + ": " +
            (j.is_object() && j.contains("error") ? j["error"].value("message", error_body) : error_body);
  }
  out << std::endl;
  return answer;
}

}  // namespace

int run_chat(ChatOptions o, std::istream& in, std::ostream& out) {
  std::unique_ptr<ServeSession> session;
  if (o.url.empty()) {
    if (!o.serve) throw std::invalid_argument("chat: give --url URL or -m MODEL");
    o.serve->http.host = "127.0.0.1";
    o.serve->http.port = 0;
    session = std::make_unique<ServeSession>(*o.serve);
    o.url = session->url();
  }
  std::string base = o.url, prefix;
  while (!base.empty() && base.back() == '/') base.pop_back();
  if (base.size() > 3 && base.compare(base.size() - 3, 3, "/v1") == 0) base.resize(base.size() - 3);
  // scheme://host:port, then any path prefix the server sits under
  const size_t scheme = base.find("://");
  const size_t slash = base.find('/', scheme == std::string::npos ? 0 : scheme + 3);
  if (slash != std::string::npos) {
    prefix = base.substr(slash);
    base.resize(slash);
  }
  httplib::Client cli(base);
  cli.set_read_timeout(600, 0);
  install_interrupt();
  json messages = json::array();
  if (!o.system.empty()) messages.push_back({{"role", "system"}, {"content", o.system}});
  out << "moraine chat: " << o.url << " (Ctrl-C stops an answer, Ctrl-D or /exit quits, /reset forgets the conversation)"
      << std::endl;
  for (std::string line;;) {
    out << "> " << std::flush;
    g_interrupted = 0;
    if (!std::getline(in, line)) break;
    if (line == "/exit" || line == "/quit") break;
    if (line == "/reset") {
      messages = json::array();
      if (!o.system.empty()) messages.push_back({{"role", "system"}, {"content", o.system}});
      continue;
    }
    if (line.empty()) continue;
    messages.push_back({{"role", "user"}, {"content", line}});
    std::string error;
    const std::string answer = ask(cli, prefix, o, messages, out, error);
    if (!error.empty()) {
      std::cerr << "moraine chat: " << error << std::endl;
      messages.erase(messages.end() - 1);   // the turn did not happen
      continue;
    }
    messages.push_back({{"role", "assistant"}, {"content", answer}});
  }
  out << std::endl;
  if (session) session->stop();
  return 0;
}

}  // namespace moraine::server
