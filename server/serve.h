// `moraine serve`: the whole group (through moraine-supervisor, as `moraine-supervisor start`
// runs it) behind the HTTP front end. /health answers 503 while the group loads and 200 once it
// serves; on stop the server drains its requests, then the supervisor stops every process and
// removes the group's shared memory.
#pragma once
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/group_launcher.h"
#include "server/http_server.h"

namespace moraine::server {

// What `moraine serve` passes to `moraine-supervisor start`: only what was given, so that the
// config file's [start] section and the supervisor's defaults decide the rest.
struct GroupStartOptions {
  std::string model, socket_dir, config, vram, ram, backend, kv_type, cache_ram;
  int cpu_workers = -1, max_tokens = -1, parallel = -1;
  int64_t ctx = -1;
  std::vector<std::string> supervisor_args;   // any other `start` argument, verbatim
  std::string log_path;                       // the supervisor's output; empty: SOCKET_DIR/supervisor.log
  double ready_timeout_s = 600;
};

struct ServeOptions {
  GroupStartOptions group;
  HttpOptions http;
};

class ServeSession {
 public:
  // Binds the HTTP port (throws when it cannot), serves /health (503) and starts the group;
  // returns once the group serves (then /health is 200). Throws when the group does not start.
  explicit ServeSession(ServeOptions o);
  ~ServeSession();          // stop()
  void stop();              // drain, stop HTTP, stop the group, remove a socket dir it made
  int port() const { return port_; }
  std::string url() const;
  bool group_running() const;   // false once the supervisor has exited

 private:
  ServeOptions o_;
  bool own_socket_dir_ = false;
  int port_ = 0;
  std::unique_ptr<HttpServer> http_;
  std::thread listener_;
  std::unique_ptr<group::LaunchedGroup> group_;
  bool stopped_ = false;
};

// The foreground command: logs "listening on http://HOST:PORT" when ready, runs until
// SIGINT/SIGTERM (or the group stops), then stops. Returns the exit status.
int run_serve(ServeOptions o);

}  // namespace moraine::server
