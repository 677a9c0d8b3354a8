// Starts a process group the way a user does (moraine-supervisor start ...), waits until the
// supervisor reports SERVING (it does once every process does: never a fixed sleep), and stops
// it again (moraine-supervisor stop, then waits for the supervisor to exit). Used by tools that
// drive a group they own (moraine-bench's group engine) and by the group tests.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

namespace moraine::group {

struct LaunchOptions {
  std::string supervisor;            // the moraine-supervisor executable (or deploy/moraine-supervisor)
  std::string socket_dir;            // must exist
  std::vector<std::string> start_args;  // after "start": -m MODEL, --cpu-workers N, --vram ...
  std::string log_path;              // the supervisor's stdout+stderr (appended); empty: inherit
  std::vector<std::pair<std::string, std::string>> env;  // set in the supervisor's environment
  std::chrono::milliseconds ready_timeout{std::chrono::seconds(120)};
  // The supervisor in a process group of its own, so that a terminal's Ctrl-C reaches only the
  // caller, which then stops the group in order (moraine serve drains its requests first).
  bool own_process_group = false;
};

class LaunchedGroup {
 public:
  // Throws std::runtime_error when the group does not come up in time (the log path is named;
  // the group is stopped first).
  explicit LaunchedGroup(LaunchOptions o);
  ~LaunchedGroup();   // stop(); never throws
  LaunchedGroup(const LaunchedGroup&) = delete;
  LaunchedGroup& operator=(const LaunchedGroup&) = delete;

  void stop();        // idempotent; SIGKILLs the supervisor if it has not exited within 60 s
  pid_t supervisor_pid() const { return pid_; }
  const LaunchOptions& options() const { return o_; }

 private:
  LaunchOptions o_;
  pid_t pid_ = -1;
};

}  // namespace moraine::group
