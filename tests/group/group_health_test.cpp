// The supervisor's Health watch (issue 31 item 2): a frozen worker (SIGSTOP) is killed once it
// has left Health unanswered for --health-timeout and restarted, and the step it held completes
// with the reference's tokens; a frozen coordinator is killed and the whole group restarted (the
// workers map its shared memory), serving the same tokens again; a process that keeps dying is
// restarted --max-restarts times within a minute, then the group stops and says why.
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "coordinator/group_layout.h"
#include "tests/group/group_harness.h"

namespace moraine::group_test {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The pid serving `instance` once it is no longer `old` (a restart), or -1 after the deadline.
pid_t wait_new_pid(const Group& g, const std::string& instance, pid_t old, std::chrono::seconds deadline) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  while (std::chrono::steady_clock::now() < until) {
    try {
      const pid_t now = g.instance_pid(instance);
      if (now > 0 && now != old) return now;
    } catch (const std::exception&) {
      // Not answering yet: restarting.
    }
    std::this_thread::sleep_for(50ms);
  }
  return -1;
}

bool supervisor_exited(pid_t pid, std::chrono::seconds deadline) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  while (std::chrono::steady_clock::now() < until) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) return true;
    const size_t close = line.rfind(')');
    if (close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'Z') return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

class GroupHealth : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { case_ = new GoldenCase(golden_case("qwen3next_odd", "f32", "health", kTokens)); }
  static void TearDownTestSuite() {
    fs::remove_all(case_->dir);
    delete case_;
  }
  // Probes every 200 ms, a process silent for 5 s is killed (margin for a loaded 2-core CI box).
  static GroupOptions watched(std::vector<std::string> more = {}) {
    GroupOptions o;
    o.model = case_->model;
    o.extra_args = {"--health-interval", "0.2", "--health-timeout", "5"};
    o.extra_args.insert(o.extra_args.end(), more.begin(), more.end());
    return o;
  }
  static constexpr int kTokens = 10;
  static GoldenCase* case_;
};
GoldenCase* GroupHealth::case_ = nullptr;

TEST_F(GroupHealth, FrozenCpuWorkerIsKilledRestartedAndTheStepCompletes) {
  Group g(watched());
  const std::string name = group::cpu_worker_instance(1);
  const pid_t victim = g.instance_pid(name);
  ASSERT_EQ(kill(victim, SIGSTOP), 0);
  const auto t0 = std::chrono::steady_clock::now();
  const Generation gen = generate(g.socket_dir(), case_->prompt, kTokens);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, case_->ref.ids);
  EXPECT_GE(waited, 4.0) << "the generation cannot have finished while the worker was frozen";
  EXPECT_EQ(g.wait_all_serving(30s), "");
  EXPECT_NE(g.instance_pid(name), victim) << "the frozen worker was not replaced";
  const std::string log = read_text(g.socket_dir() + "/supervisor.log");
  EXPECT_NE(log.find(name + " (pid " + std::to_string(victim) + ") has not answered Health for"), std::string::npos) << log;
}

TEST_F(GroupHealth, FrozenCoordinatorIsKilledAndTheGroupRestarted) {
  Group g(watched());
  const pid_t coord = g.instance_pid(group::kCoordinatorInstance);
  const pid_t worker = g.instance_pid(group::kGpuWorkerInstance);
  ASSERT_EQ(kill(coord, SIGSTOP), 0);
  const pid_t fresh = wait_new_pid(g, group::kCoordinatorInstance, coord, 90s);
  ASSERT_GT(fresh, 0) << "no new coordinator: " << read_text(g.socket_dir() + "/supervisor.log");
  ASSERT_EQ(g.wait_all_serving(90s), "");
  EXPECT_NE(g.instance_pid(group::kGpuWorkerInstance), worker) << "the workers must restart with their coordinator";
  const Generation gen = generate(g.socket_dir(), case_->prompt, kTokens);
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, case_->ref.ids);
  const std::string log = read_text(g.socket_dir() + "/supervisor.log");
  EXPECT_NE(log.find("coordinator (pid " + std::to_string(coord) + ") has not answered Health for"), std::string::npos) << log;
  EXPECT_NE(log.find("group serving again after the coordinator's restart"), std::string::npos) << log;
}

TEST_F(GroupHealth, AProcessThatKeepsDyingStopsTheGroupWithAReason) {
  Group g(watched({"--max-restarts", "2"}));
  const pid_t sup = g.supervisor_pid();
  const std::string prefix = group::group_prefix_for(g.socket_dir());
  pid_t victim = g.instance_pid(group::kIoWorkerInstance);
  for (int round = 0; round < 2; ++round) {
    ASSERT_EQ(kill(victim, SIGKILL), 0);
    victim = wait_new_pid(g, group::kIoWorkerInstance, victim, 30s);
    ASSERT_GT(victim, 0) << "round " << round << ": " << read_text(g.socket_dir() + "/supervisor.log");
  }
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  EXPECT_TRUE(supervisor_exited(sup, 60s)) << "the supervisor went on restarting";
  const std::string log = read_text(g.socket_dir() + "/supervisor.log");
  EXPECT_NE(log.find(std::string(group::kIoWorkerInstance) + " died 2 times within a minute (--max-restarts)"),
            std::string::npos) << log;
  EXPECT_TRUE(shm_files(prefix).empty()) << "shared memory left behind by a group that stopped itself";
}

}  // namespace
}  // namespace moraine::group_test
