#include "coordinator/group_launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <stdexcept>
#include <thread>

#include "coordinator/control_server.h"
#include "coordinator/group_layout.h"

namespace moraine::group {
namespace {

pid_t spawn(const LaunchOptions& o, const std::vector<std::string>& args) {
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork for " + o.supervisor + " failed");
  if (pid == 0) {
    if (o.own_process_group) setpgid(0, 0);
    signal(SIGINT, SIG_DFL);    // the caller's handlers do not belong to the supervisor
    signal(SIGTERM, SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    if (!o.log_path.empty()) {
      const int fd = ::open(o.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
      }
    }
    for (const auto& [k, v] : o.env) setenv(k.c_str(), v.c_str(), 1);
    std::vector<std::string> a = args;
    std::vector<char*> argv;
    for (auto& s : a) argv.push_back(s.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

// Waits for pid to exit; false if it is still running at the deadline.
bool wait_exit(pid_t pid, std::chrono::milliseconds deadline) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

}  // namespace

LaunchedGroup::LaunchedGroup(LaunchOptions o) : o_(std::move(o)) {
  std::vector<std::string> args = {o_.supervisor, "start", "--socket-dir", o_.socket_dir};
  args.insert(args.end(), o_.start_args.begin(), o_.start_args.end());
  pid_ = spawn(o_, args);
  // wait_serving stops early when the supervisor exits (it refused its arguments, a process
  // failed to start), so a failure is reported at once rather than after the whole timeout.
  const std::string error = wait_serving(control_address(o_.socket_dir, kSupervisorInstance), o_.ready_timeout, pid_);
  if (!error.empty()) {
    stop();
    throw std::runtime_error("the group did not come up (" + error + ")" +
                             (o_.log_path.empty() ? std::string() : "; see " + o_.log_path));
  }
}

LaunchedGroup::~LaunchedGroup() {
  try {
    stop();
  } catch (...) {
  }
}

void LaunchedGroup::stop() {
  if (pid_ <= 0) return;
  // SIGTERM to the pid it knows, as `moraine-supervisor stop` sends it to the one in
  // supervisor.pid: with that file gone (a /tmp cleaner, a removed socket dir) the stop
  // command failed, the supervisor was SIGKILLed 60 s later and its group left running
  // (serve_fault_test's StopWithoutThePidFileLeavesNothing).
  kill(pid_, SIGTERM);
  if (!wait_exit(pid_, std::chrono::seconds(60))) {
    // Its own process group holds its children too (until they are in another, as after a crash).
    kill(o_.own_process_group ? -pid_ : pid_, SIGKILL);
    wait_exit(pid_, std::chrono::seconds(10));
  }
  pid_ = -1;
}

}  // namespace moraine::group
