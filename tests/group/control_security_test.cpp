// The group's sockets belong to its user (coordinator/private_socket.h): a socket directory is
// made 0700 or refused when others may enter it or it is not this user's, whichever process
// meets it first (the supervisor, or a coordinator / worker started by hand); a control server
// closes the connection of a peer of another uid (SO_PEERCRED) unanswered. Run as root, a forked
// child that drops to another uid is the other user; otherwise the checks are tested directly.
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include "coordinator/control_server.h"
#include "coordinator/group_layout.h"
#include "coordinator/private_socket.h"
#include "proto/control.grpc.pb.h"
#include "tests/group/group_harness.h"

namespace moraine::group_test {
namespace {

namespace fs = std::filesystem;
const fs::path kBuild = MORAINE_BUILD_DIR;
constexpr uid_t kOtherUid = 65534;   // nobody

unsigned mode_of(const std::string& p) {
  struct stat st{};
  EXPECT_EQ(::lstat(p.c_str(), &st), 0) << p;
  return st.st_mode & 07777;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

TEST(PrivateDir, AMissingOneIsMade0700) {
  const std::string base = temp_dir("private");
  const std::string dir = base + "/a/b/sock";
  group::ensure_private_dir(dir);
  EXPECT_EQ(mode_of(dir), 0700u);
  EXPECT_EQ(group::private_dir_problem(dir), "");
  group::ensure_private_dir(dir);   // and an existing private one is used as it is
  fs::remove_all(base);
}

TEST(PrivateDir, OneOthersMayEnterIsRefusedByName) {
  const std::string dir = temp_dir("private");
  for (const unsigned mode : {0755u, 0710u, 0701u, 0770u}) {
    ASSERT_EQ(::chmod(dir.c_str(), mode), 0);
    const std::string why = message_of([&] { group::ensure_private_dir(dir); });
    EXPECT_NE(why.find(dir), std::string::npos) << why;
    EXPECT_NE(why.find("group or other"), std::string::npos) << why;
    EXPECT_EQ(mode_of(dir), mode) << "the check must not quietly change the mode";
  }
  fs::remove_all(dir);
}

TEST(PrivateDir, ASymlinkOrAFileIsRefused) {
  const std::string base = temp_dir("private");
  const std::string target = base + "/target", link = base + "/link", file = base + "/file";
  group::ensure_private_dir(target);
  fs::create_symlink(target, link);
  std::ofstream(file) << "x";
  EXPECT_NE(message_of([&] { group::ensure_private_dir(link); }).find("symbolic link"), std::string::npos);
  EXPECT_NE(message_of([&] { group::ensure_private_dir(file); }).find("not a directory"), std::string::npos);
  fs::remove_all(base);
}

TEST(PrivateDir, AnotherUsersIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to make a directory of another uid";
  const std::string dir = temp_dir("private");
  if (::chown(dir.c_str(), kOtherUid, static_cast<gid_t>(-1)) != 0) GTEST_SKIP() << "root without CAP_CHOWN here";
  const std::string why = message_of([&] { group::ensure_private_dir(dir); });
  EXPECT_NE(why.find(dir), std::string::npos) << why;
  EXPECT_NE(why.find("owned by uid " + std::to_string(kOtherUid)), std::string::npos) << why;
  fs::remove_all(dir);
}

TEST(PeerCheck, TheSameUidPassesAnotherDoesNot) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  EXPECT_EQ(group::peer_problem(sv[0], ::geteuid()), "");
  const std::string why = group::peer_problem(sv[0], ::geteuid() + 1);
  EXPECT_NE(why.find("runs as uid " + std::to_string(::geteuid())), std::string::npos) << why;
  ::close(sv[0]);
  ::close(sv[1]);
  const int fd = ::open("/dev/null", O_RDONLY);
  EXPECT_NE(group::peer_problem(fd, ::geteuid()).find("no peer credentials"), std::string::npos);
  ::close(fd);
}

TEST(ControlSocket, ARefusedDirectoryStopsTheServerBeforeItBinds) {
  const std::string dir = temp_dir("ctl");
  ASSERT_EQ(::chmod(dir.c_str(), 0755), 0);
  const std::string why = message_of([&] {
    group::ControlServer s(control::ROLE_COORDINATOR, "coordinator", group::control_address(dir, "coordinator"));
  });
  EXPECT_NE(why.find("refusing the socket directory " + dir), std::string::npos) << why;
  EXPECT_FALSE(fs::exists(dir + "/coordinator.sock"));
  fs::remove_all(dir);
}

bool health_ok(const std::string& address) {
  auto stub = control::Control::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  control::HealthReply reply;
  return stub->Health(&ctx, {}, &reply).ok() && reply.pid() == static_cast<uint32_t>(::getpid());
}

// Connects to `path` as a raw client and sends HTTP/2's client preface and an empty SETTINGS
// frame: a gRPC server answers with its own SETTINGS frame; one that refused the peer closes.
// Returns the bytes read before the close or 2 s (-1: no connection).
ssize_t preface_answer(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  const char preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";
  // MSG_NOSIGNAL: a server that already closed the connection is an answer, not a SIGPIPE.
  if (::send(fd, preface, sizeof preface - 1, MSG_NOSIGNAL) < 0) {
    ::close(fd);
    return 0;
  }
  timeval tv{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char buf[256];
  const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
  ::close(fd);
  return n < 0 ? 0 : n;
}

TEST(ControlSocket, APeerOfAnotherUidIsClosedUnanswered) {
  const std::string dir = temp_dir("ctl");
  const std::string address = group::control_address(dir, "coordinator");
  group::ControlServer server(control::ROLE_COORDINATOR, "coordinator", address);
  server.set_state(control::SERVING);
  server.start();
  const std::string path = address.substr(5);
  EXPECT_EQ(mode_of(path) & 0777, 0600u);
  ASSERT_TRUE(health_ok(address)) << "a client of the same uid must be served";
  EXPECT_GT(preface_answer(path), 0) << "a raw client of the same uid must get the server's SETTINGS";
  EXPECT_EQ(server.refused_peers(), 0u);
  if (::geteuid() != 0) GTEST_SKIP() << "not root: no second uid to connect as (PeerCheck tests the check itself)";
  // Opened up on purpose, so that the other uid reaches the socket and only the peer check stands.
  ASSERT_EQ(::chmod(dir.c_str(), 0711), 0);
  ASSERT_EQ(::chmod(path.c_str(), 0666), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    if (::setgid(kOtherUid) != 0 || ::setuid(kOtherUid) != 0) _exit(2);
    const ssize_t n = preface_answer(path);
    _exit(n == 0 ? 0 : n < 0 ? 3 : 4);   // 0: connected, then closed without a byte
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  if (WEXITSTATUS(status) == 2) GTEST_SKIP() << "root without CAP_SETUID here: no second uid";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: could not connect, 4: answered";
  EXPECT_EQ(server.refused_peers(), 1u);
  EXPECT_TRUE(health_ok(address)) << "the server still serves its own user";
  server.stop();
  fs::remove_all(dir);
}

// A process of the group started by hand meets the socket directory first: each refuses one that
// is not private, naming it, and makes a missing one 0700 (then fails later for want of a model
// or a manifest, which is not what this checks).
TEST(ControlSocket, EveryProcessStartedByHandChecksItsDirectory) {
  const std::string base = temp_dir("byhand");
  const std::vector<std::pair<std::string, std::string>> binaries = {
      {"coordinator/moraine-coordinator", "-m " + base + "/none.gguf"},
      {"cpu_expert_worker/moraine-cpu-expert-worker", "--index 0"},
      {"io_worker/moraine-io-worker", ""},
      {"gpu_worker/moraine-gpu-worker", ""},
  };
  int i = 0;
  for (const auto& [bin, args] : binaries) {
    const std::string open_dir = base + "/open" + std::to_string(i), fresh = base + "/fresh" + std::to_string(i++);
    fs::create_directories(open_dir);
    ASSERT_EQ(::chmod(open_dir.c_str(), 0755), 0);
    const auto [rc, out] = run_command(shell_quote((kBuild / bin).string()) + " " + args + " --socket-dir " +
                                       shell_quote(open_dir) + " 2>&1");
    EXPECT_NE(rc, 0) << bin << ": " << out;
    EXPECT_NE(out.find("refusing the socket directory " + open_dir), std::string::npos) << bin << ": " << out;
    EXPECT_TRUE(fs::is_empty(open_dir)) << bin << " wrote into a refused directory";
    const auto [rc2, out2] = run_command(shell_quote((kBuild / bin).string()) + " " + args + " --socket-dir " +
                                         shell_quote(fresh) + " 2>&1");
    EXPECT_NE(rc2, 0) << bin << ": " << out2;
    ASSERT_TRUE(fs::is_directory(fresh)) << bin << ": " << out2;
    EXPECT_EQ(mode_of(fresh), 0700u) << bin;
  }
  fs::remove_all(base);
}

// The supervisor and `moraine serve` check a given --socket-dir before they start anything.
TEST(ControlSocket, TheSupervisorAndServeRefuseAnOpenDirectory) {
  const std::string base = temp_dir("byhand");
  const std::string open_dir = base + "/open", model = base + "/model.gguf";
  fs::create_directories(open_dir);
  ASSERT_EQ(::chmod(open_dir.c_str(), 0755), 0);
  std::ofstream(model) << "not read";
  for (const std::string& cmd : std::vector<std::string>{"coordinator/moraine-supervisor start -m " + model + " --bin-dir " + (kBuild / "coordinator").string(),
                                "coordinator/moraine serve --port 0 -m " + model}) {
    const auto [rc, out] = run_command((kBuild / cmd).string() + " --socket-dir " + shell_quote(open_dir) + " 2>&1");
    EXPECT_NE(rc, 0) << cmd << ": " << out;
    EXPECT_NE(out.find("refusing the socket directory " + open_dir + ": its mode is 0755"), std::string::npos) << cmd << ": " << out;
    EXPECT_TRUE(fs::is_empty(open_dir)) << cmd << " wrote into a refused directory";
  }
  fs::remove_all(base);
}

}  // namespace
}  // namespace moraine::group_test
