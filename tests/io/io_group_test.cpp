// The io_worker as a member of the process group: the supervisor starts io_worker-0 (and says
// SERVING only once it is), restarts it when it dies, and stops it with the group.
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include <gtest/gtest.h>

#include "coordinator/control_server.h"
#include "coordinator/group_layout.h"
#include "coordinator/process_util.h"
#include "tests/group/group_harness.h"

namespace {

using namespace moraine;
using namespace std::chrono_literals;
constexpr const char* kInstance = "io_worker-0";

TEST(IoWorkerInGroup, StartedRestartedAndStoppedBySupervisor) {
  const std::string dir = group_test::temp_dir("io-group-model");
  group_test::GroupOptions o;
  o.model = group_test::convert_golden("qwen3moe_odd", "", dir);
  o.cpu_workers = 1;
  group_test::Group g(o);
  ASSERT_EQ(group::wait_serving(group::control_address(g.socket_dir(), kInstance), 10s), "");
  const pid_t first = g.instance_pid(kInstance);
  ASSERT_GT(first, 0);

  ASSERT_EQ(kill(first, SIGKILL), 0);
  pid_t second = -1;
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < until) {
    try {
      const pid_t p = g.instance_pid(kInstance);
      if (p != first && group::wait_serving(group::control_address(g.socket_dir(), kInstance), 1s).empty()) {
        second = p;
        break;
      }
    } catch (const std::exception&) {
      // between the old process's death and the new one's socket
    }
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_GT(second, 0) << "io_worker-0 was not restarted within 60 s";
  EXPECT_EQ(g.wait_all_serving(30s), "");

  g.stop();
  EXPECT_FALSE(group::process_running(second)) << "io_worker-0 outlived the group";
  std::filesystem::remove_all(dir);
}

}  // namespace
