#pragma once
// Test helper: run a function in a forked child and wait for it with a bounded timeout (pidfd +
// poll, no sleeps), plus a pipe for "I am ready" / "go on" handshakes. Fork happens before any
// thread is created in the child's path (ZeroMQ contexts and gRPC start threads), so each side
// builds its own context after the fork.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>

namespace moraine::test {

// A one-way pipe with bounded reads.
class Pipe {
 public:
  Pipe() {
    if (pipe2(fds_, O_CLOEXEC) != 0) std::perror("pipe2");
  }
  ~Pipe() {
    close_read();
    close_write();
  }
  Pipe(const Pipe&) = delete;
  Pipe& operator=(const Pipe&) = delete;

  bool write_line(const std::string& text) {
    const std::string line = text + "\n";
    return ::write(fds_[1], line.data(), line.size()) == static_cast<ssize_t>(line.size());
  }
  // Reads up to '\n'; false on timeout or EOF.
  bool read_line(std::string& out, std::chrono::milliseconds timeout) {
    out.clear();
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{fds_[0], POLLIN, 0};
      const int ready = ::poll(&p, 1, static_cast<int>(left.count()));
      if (ready < 0 && errno == EINTR) continue;
      if (ready <= 0) return false;
      char c = 0;
      if (::read(fds_[0], &c, 1) != 1) return false;
      if (c == '\n') return true;
      out.push_back(c);
    }
  }
  void close_read() {
    if (fds_[0] >= 0) ::close(fds_[0]);
    fds_[0] = -1;
  }
  void close_write() {
    if (fds_[1] >= 0) ::close(fds_[1]);
    fds_[1] = -1;
  }

 private:
  int fds_[2] = {-1, -1};
};

class Child {
 public:
  // Runs body in a child; its return value is the exit status (an exception exits with 99).
  explicit Child(const std::function<int()>& body) {
    pid_ = fork();
    if (pid_ == 0) {
      int code = 98;
      try {
        code = body();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child: %s\n", e.what());
        code = 99;
      }
      std::fflush(nullptr);
      _exit(code);  // no atexit handlers, no destructors of the parent's objects
    }
    pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, pid_, 0));
  }
  ~Child() {
    if (!reaped_ && pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (pidfd_ >= 0) ::close(pidfd_);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }
  void kill_now() { kill(pid_, SIGKILL); }

  // Exit status, or -1 when the child did not exit within timeout (it is then killed),
  // or 128+signal when a signal ended it.
  int wait(std::chrono::milliseconds timeout) {
    if (pidfd_ >= 0) {
      pollfd p{pidfd_, POLLIN, 0};
      int ready;
      do {
        ready = ::poll(&p, 1, static_cast<int>(timeout.count()));
      } while (ready < 0 && errno == EINTR);
      if (ready == 0) {
        kill(pid_, SIGKILL);
        waitpid(pid_, nullptr, 0);
        reaped_ = true;
        return -1;
      }
    }
    int status = 0;
    waitpid(pid_, &status, 0);
    reaped_ = true;
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return -2;
  }

 private:
  pid_t pid_ = -1;
  int pidfd_ = -1;
  bool reaped_ = false;
};

// A group prefix unique to this test process, so parallel test runs do not collide.
inline std::string test_group_prefix(const char* tag) {
  return std::string("moraine-test-") + tag + "-" + std::to_string(getpid());
}

}  // namespace moraine::test
