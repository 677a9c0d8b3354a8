#include "coordinator/process_util.h"

#include <cerrno>
#include <csignal>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace moraine::group {

std::vector<int> parse_cpu_list(const std::string& list) {
  std::vector<int> cpus;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      const size_t dash = item.find('-');
      const int lo = std::stoi(item.substr(0, dash), &used);
      const int hi = dash == std::string::npos ? lo : std::stoi(item.substr(dash + 1));
      if (lo < 0 || hi < lo || hi >= 4096) throw std::invalid_argument("range");
      for (int c = lo; c <= hi; ++c) cpus.push_back(c);
    } catch (const std::exception&) {
      throw std::invalid_argument("cpu list '" + list + "': '" + item + "' is not a cpu or a range");
    }
  }
  if (cpus.empty()) throw std::invalid_argument("cpu list '" + list + "' names no cpu");
  return cpus;
}

bool process_running(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t close = line.rfind(')');   // the command name may contain spaces and parentheses
  return close == std::string::npos || close + 2 >= line.size() || line[close + 2] != 'Z';
}

namespace {
volatile std::sig_atomic_t g_signal = 0;
extern "C" void on_stop_signal(int sig) { g_signal = sig; }
}  // namespace

void install_stop_signals() {
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
}

bool signal_received() { return g_signal != 0; }

messaging::ServeResult serve_one_job(messaging::JobServer& server, const messaging::JobServer::Handler& handler,
                                     std::chrono::milliseconds timeout) {
  try {
    return server.serve_one(handler, timeout);
  } catch (const zmq::error_t& e) {
    if (e.num() != EINTR) throw;
    return messaging::ServeResult::kIdle;
  }
}

}  // namespace moraine::group
