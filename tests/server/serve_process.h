// `moraine serve` as a child of a test: started on port 0 with a socket directory of the test's,
// waited for ("listening on"), stopped with SIGTERM; a streamed or whole completion read back;
// the processes, sockets and shared memory a group leaves behind, found by its socket directory.
// Shared by the serve tests (serve_test, serve_fault_test, serve_load_test).
#pragma once
#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

namespace moraine::serve_test {

struct ServeProcess {
  std::string dir, model, socket_dir, log;
  pid_t pid = -1;
  int port = 0;   // 0 until it logged "listening on"
  std::string model_id;
  std::vector<int> health_while_loading;   // /health statuses seen before "listening on"
};

// Runs `moraine serve -m MODEL --port 0 --socket-dir DIR/sock ARGS...` with its output in
// DIR/serve.log and waits (up to `wait`) for "listening on"; s.port stays 0 when it did not come.
void launch_serve(ServeProcess& s, const std::string& dir, const std::string& model, const std::vector<std::string>& args,
                  std::chrono::seconds wait = std::chrono::seconds(120));
// SIGTERM, then SIGKILL to serve and its supervisor after `grace`; the exit status (-1: killed).
int stop_serve(ServeProcess& s, std::chrono::seconds grace = std::chrono::seconds(60));
std::string read_text(const std::string& path);

// What a completion request came back as.
struct Completion {
  int status = -1;           // HTTP status; -1: no answer (the connection failed or was cut)
  std::string text;          // the generated text (streamed: every event's text joined)
  std::string finish;        // finish_reason of the last choice
  bool done = false;         // streamed: "data: [DONE]" came
  std::string error_type, error_message;   // an error body, or a streamed error event
  std::string transport;     // status -1: httplib's error, by name
};
// POST /v1/completions with `body` (stream as the body says); the client gives up after `timeout`.
Completion complete(int port, const std::string& key, const std::string& body,
                    std::chrono::milliseconds timeout = std::chrono::seconds(120));

// Processes whose command line names `socket_dir` (serve, its supervisor, every worker): what a
// group leaves running. Each with its state letter from /proc (R, S, T for stopped, Z ...).
struct GroupProcess {
  pid_t pid;
  char state;
  std::string cmdline;
};
std::vector<GroupProcess> processes_naming(const std::string& socket_dir);
// The socket files (*.sock, *.jobs) in the directory, by name.
std::vector<std::string> socket_files(const std::string& socket_dir);
int64_t rss_kib(pid_t pid);   // VmRSS, -1 when the process is gone

}  // namespace moraine::serve_test
