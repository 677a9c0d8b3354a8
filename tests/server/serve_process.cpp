#include "tests/server/serve_process.h"

#include <httplib.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

namespace moraine::serve_test {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void launch_serve(ServeProcess& s, const std::string& dir, const std::string& model, const std::vector<std::string>& args,
                  std::chrono::seconds wait) {
  s.dir = dir;
  s.model = model;
  s.model_id = fs::path(model).stem().string();
  s.socket_dir = dir + "/sock";
  s.log = dir + "/serve.log";
  s.port = 0;
  s.health_while_loading.clear();
  std::vector<std::string> argv_s = {(fs::path(MORAINE_BUILD_DIR) / "coordinator" / "moraine").string(), "serve", "-m", model,
                                     "--port", "0", "--socket-dir", s.socket_dir};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  // Emptied here, not by the child: a log read before the child truncated it would give the
  // last run's port.
  ::close(::open(s.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600));
  s.pid = fork();
  if (s.pid == 0) {
    const int fd = ::open(s.log.c_str(), O_WRONLY | O_APPEND);
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<char*> argv;
    for (const std::string& a : argv_s) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  // Ready when it logs the line a user waits for; before that, /health on the port it loads on.
  const std::regex listening("listening on http://127\\.0\\.0\\.1:([0-9]+)");
  const std::regex loading("http://127\\.0\\.0\\.1:([0-9]+)/health answers 503");
  const auto until = Clock::now() + wait;
  while (s.port == 0 && Clock::now() < until) {
    const std::string text = read_text(s.log);
    std::smatch m;
    if (std::regex_search(text, m, listening)) {
      s.port = std::stoi(m[1]);
      break;
    }
    if (std::regex_search(text, m, loading)) {
      httplib::Client c("127.0.0.1", std::stoi(m[1]));
      if (const auto h = c.Get("/health")) s.health_while_loading.push_back(h->status);
    }
    if (waitpid(s.pid, nullptr, WNOHANG) == s.pid) {
      s.pid = -1;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

int stop_serve(ServeProcess& s, std::chrono::seconds grace) {
  if (s.pid <= 0) return -1;
  pid_t supervisor = 0;
  std::ifstream(s.socket_dir + "/supervisor.pid") >> supervisor;
  kill(s.pid, SIGTERM);
  int status = 0;
  pid_t done = 0;
  const auto until = Clock::now() + grace;
  while ((done = waitpid(s.pid, &status, WNOHANG)) == 0 && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (done == 0) {
    kill(s.pid, SIGKILL);
    waitpid(s.pid, nullptr, 0);
    if (supervisor > 0) kill(supervisor, SIGKILL);
    status = -1;
  }
  s.pid = -1;
  return status == -1 ? -1 : (WIFEXITED(status) ? WEXITSTATUS(status) : -1);
}

namespace {

// One SSE stream's events: text joined, the last finish_reason, an error event, [DONE].
void read_events(const std::string& sse, Completion& c) {
  std::istringstream in(sse);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("data: ", 0) != 0) continue;
    if (line == "data: [DONE]") {
      c.done = true;
      continue;
    }
    const json e = json::parse(line.substr(6), nullptr, false);
    if (e.contains("error")) {
      c.error_type = e["error"].value("type", "");
      c.error_message = e["error"].value("message", "");
      continue;
    }
    if (!e.contains("choices") || e["choices"].empty()) continue;
    const json& ch = e["choices"][0];
    c.text += ch.value("text", "");
    if (ch["finish_reason"].is_string()) c.finish = ch["finish_reason"];
  }
}

}  // namespace

Completion complete(int port, const std::string& key, const std::string& body, std::chrono::milliseconds timeout) {
  httplib::Client client("127.0.0.1", port);
  const auto secs = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  client.set_read_timeout(secs.count(), std::chrono::duration_cast<std::chrono::microseconds>(timeout - secs).count());
  client.set_connection_timeout(5, 0);
  if (!key.empty()) client.set_default_headers({{"Authorization", "Bearer " + key}});
  Completion c;
  const auto r = client.Post("/v1/completions", body, "application/json");
  if (!r) {
    c.transport = httplib::to_string(r.error());
    return c;
  }
  c.status = r->status;
  const json j = json::parse(r->body, nullptr, false);
  if (r->status == 200 && r->get_header_value("Content-Type").rfind("text/event-stream", 0) == 0) {
    read_events(r->body, c);
  } else if (j.is_object() && j.contains("error")) {
    c.error_type = j["error"].value("type", "");
    c.error_message = j["error"].value("message", "");
  } else if (j.is_object() && j.contains("choices") && !j["choices"].empty()) {
    c.text = j["choices"][0].value("text", "");
    if (j["choices"][0]["finish_reason"].is_string()) c.finish = j["choices"][0]["finish_reason"];
  }
  return c;
}

std::vector<GroupProcess> processes_naming(const std::string& socket_dir) {
  std::vector<GroupProcess> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name.empty() || !std::all_of(name.begin(), name.end(), ::isdigit)) continue;
    std::string cmd = read_text(e.path().string() + "/cmdline");
    std::replace(cmd.begin(), cmd.end(), '\0', ' ');
    // The directory as an argument of its own (DIR/sock must not match DIR/sock2).
    if ((cmd + " ").find(" " + socket_dir + " ") == std::string::npos) continue;
    const std::string stat = read_text(e.path().string() + "/stat");
    const size_t close = stat.rfind(')');
    const char state = close != std::string::npos && close + 2 < stat.size() ? stat[close + 2] : '?';
    out.push_back({static_cast<pid_t>(std::stoi(name)), state, cmd});
  }
  return out;
}

std::vector<std::string> socket_files(const std::string& socket_dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(socket_dir, ec))
    if (e.path().extension() == ".sock" || e.path().extension() == ".jobs") out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

int64_t rss_kib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  return -1;
}

}  // namespace moraine::serve_test
