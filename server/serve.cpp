#include "server/serve.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "common/chat/chat_template.h"
#include "common/chat/tool_call_parser.h"
#include "common/gguf/gguf.h"
#include "common/tokenizer/tokenizer.h"
#include "coordinator/private_socket.h"
#include "coordinator/process_util.h"

namespace moraine::server {
namespace {

namespace fs = std::filesystem;

std::string supervisor_path() {
  const fs::path self = fs::read_symlink("/proc/self/exe").parent_path();
  for (const fs::path& p : {self / "moraine-supervisor", self.parent_path() / "coordinator" / "moraine-supervisor"})
    if (fs::exists(p)) return p.string();
  throw std::runtime_error("cannot find moraine-supervisor beside " + self.string());
}

std::vector<std::string> start_args(const GroupStartOptions& g) {
  std::vector<std::string> a = {"-m", g.model, "--bin-dir", fs::path(supervisor_path()).parent_path().string()};
  const auto add = [&](const char* flag, const std::string& v) {
    if (!v.empty()) a.insert(a.end(), {flag, v});
  };
  add("--config", g.config);
  add("--vram", g.vram);
  add("--ram", g.ram);
  add("--backend", g.backend);
  add("--kv-type", g.kv_type);
  add("--cache-ram", g.cache_ram);
  if (g.cpu_workers >= 0) add("--cpu-workers", std::to_string(g.cpu_workers));
  if (g.max_tokens >= 0) add("--max-tokens", std::to_string(g.max_tokens));
  if (g.parallel >= 1) add("--parallel", std::to_string(g.parallel));
  add("--exit-with", std::to_string(::getpid()));   // a serve killed with SIGKILL takes its group along
  if (g.ctx >= 0) add("--ctx", std::to_string(g.ctx));
  a.insert(a.end(), g.supervisor_args.begin(), g.supervisor_args.end());
  return a;
}

// The last line each process logged: why a group that did not start did not.
std::string last_log_lines(const std::string& dir) {
  std::string out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().extension() != ".log" || e.path().stem() == "supervisor") continue;
    std::ifstream in(e.path());
    std::string line, last;
    while (std::getline(in, line))
      if (!line.empty()) last = line;
    if (!last.empty()) out += "\n  " + e.path().filename().string() + ": " + last;
  }
  return out;
}

// The GGUF's chat template, read as the coordinator reads it: the server needs it to know which
// tool-call format the model writes. Null when the file has none (the coordinator says why).
std::shared_ptr<const chat::ChatTemplate> load_chat_template(const std::string& model) {
  try {
    const gguf::GgufFile file = gguf::GgufFile::open(model);
    const tokenizer::Tokenizer tok = tokenizer::Tokenizer::from_gguf(file);
    std::string warning;
    if (auto t = chat::ChatTemplate::from_gguf(file, tok, &warning)) return std::make_shared<const chat::ChatTemplate>(std::move(*t));
  } catch (const std::exception& e) {
    std::cerr << "moraine serve: no chat template for tool calls (" << e.what() << ")\n";
  }
  return nullptr;
}

}  // namespace

ServeSession::ServeSession(ServeOptions o) : o_(std::move(o)) {
  if (o_.group.model.empty()) throw std::invalid_argument("serve: -m MODEL is required");
  if (!fs::exists(o_.group.model)) throw std::invalid_argument("serve: no model file " + o_.group.model);
  ::signal(SIGPIPE, SIG_IGN);   // a client that closes its socket mid-stream is a failed write, not a signal
  if (o_.group.socket_dir.empty()) {
    std::string tmpl = (fs::temp_directory_path() / "moraine-serve.XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("cannot make a socket directory under /tmp");
    o_.group.socket_dir = tmpl;
    own_socket_dir_ = true;
  }
  group::ensure_private_dir(o_.group.socket_dir);
  const fs::path model(o_.group.model);
  if (o_.http.model_ids.empty()) o_.http.model_ids = {model.stem().string(), model.filename().string(), o_.group.model};
  o_.http.socket_dir = o_.group.socket_dir;
  if (!o_.http.chat_template) o_.http.chat_template = load_chat_template(o_.group.model);
  if (o_.http.chat_template) {
    const chat::ToolCallFormat f = chat::detect_tool_call_format(o_.http.chat_template->source());
    std::cerr << "moraine serve: tool calls of requests with tools: "
              << (f == chat::ToolCallFormat::kQwen      ? "Qwen3 <tool_call> markup"
                  : f == chat::ToolCallFormat::kHarmony ? "gpt-oss harmony"
                                                        : "none (the template has no known format)")
              << std::endl;
  }
  http_ = std::make_unique<HttpServer>(o_.http);
  port_ = http_->bind();
  listener_ = std::thread([this] { http_->listen(); });
  std::cerr << "moraine serve: loading " << o_.group.model << " (the group in " << o_.group.socket_dir << "; " << url()
            << "/health answers 503 until it serves)" << std::endl;
  group::LaunchOptions lo;
  lo.supervisor = supervisor_path();
  lo.socket_dir = o_.group.socket_dir;
  lo.start_args = start_args(o_.group);
  lo.log_path = o_.group.log_path.empty() ? o_.group.socket_dir + "/supervisor.log" : o_.group.log_path;
  lo.ready_timeout = std::chrono::milliseconds(static_cast<int64_t>(o_.group.ready_timeout_s * 1000));
  lo.own_process_group = true;
  try {
    group_ = std::make_unique<group::LaunchedGroup>(lo);
  } catch (const std::exception& e) {
    own_socket_dir_ = false;   // kept: the processes' logs say why the group did not start
    stop();
    throw std::runtime_error(e.what() + last_log_lines(o_.group.socket_dir));
  }
  http_->set_ready(true);
}

ServeSession::~ServeSession() {
  try {
    stop();
  } catch (const std::exception& e) {
    std::cerr << "moraine serve: " << e.what() << "\n";
  }
}

std::string ServeSession::url() const { return "http://" + o_.http.host + ":" + std::to_string(port_); }

bool ServeSession::group_running() const {
  return group_ && group::process_running(group_->supervisor_pid());
}

void ServeSession::stop() {
  if (stopped_) return;
  stopped_ = true;
  if (http_) http_->drain_and_stop(std::chrono::seconds(60));
  if (listener_.joinable()) listener_.join();
  if (group_) group_->stop();   // the supervisor stops every process; the coordinator removes its shared memory
  group_.reset();
  if (own_socket_dir_) {
    std::error_code ec;
    fs::remove_all(o_.group.socket_dir, ec);
  }
}

int run_serve(ServeOptions o) {
  group::install_stop_signals();
  ServeSession s(std::move(o));
  std::cerr << "moraine serve: listening on " << s.url() << std::endl;
  int rc = 0;
  while (!group::signal_received()) {
    if (!s.group_running()) {
      std::cerr << "moraine serve: the group stopped (see the supervisor's log); stopping\n";
      rc = 1;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::cerr << "moraine serve: stopping (draining requests, then the group)" << std::endl;
  s.stop();
  std::cerr << "moraine serve: stopped" << std::endl;
  return rc;
}

}  // namespace moraine::server
