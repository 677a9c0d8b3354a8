// Small process-level helpers shared by the group's executables.
#pragma once
#include <chrono>
#include <string>

#include "common/messaging/job_channel.h"
#include <vector>

namespace moraine::group {

// "0-3,8,10-11" -> {0,1,2,3,8,10,11}; throws std::invalid_argument naming the bad item.
std::vector<int> parse_cpu_list(const std::string& list);

// Whether pid exists and has not exited (a zombie waiting for its parent counts as exited).
bool process_running(int pid);

// Routes SIGINT/SIGTERM to a flag the main loop polls (signal_received()).
void install_stop_signals();
bool signal_received();

// JobServer::serve_one that treats a signal interrupting the wait (SIGTERM on its way to the
// main loop) as an idle turn instead of an error.
messaging::ServeResult serve_one_job(messaging::JobServer& server, const messaging::JobServer::Handler& handler,
                                     std::chrono::milliseconds timeout);

}  // namespace moraine::group
