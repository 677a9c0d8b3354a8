// Fault injection into moraine-bench's process-group engine: while the bench is running its
// timed generations, the test SIGKILLs a cpu_expert_worker of the group the bench started. The
// supervisor restarts it and the coordinator re-issues the step, so the generation itself still
// completes - which is exactly why the bench must look for the fault: it has to exit 1, say it
// refuses to report numbers from a faulty run and why, and print no number at all.
#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "coordinator/group_layout.h"
#include "proto/control.grpc.pb.h"

#include "tests/bench/bench_test_support.h"

namespace {

namespace fs = std::filesystem;
using moraine::bench_test::Scratch;
using moraine::bench_test::slurp;
using Clock = std::chrono::steady_clock;

std::unique_ptr<moraine::control::Control::Stub> stub(const std::string& socket_dir, const std::string& instance) {
  return moraine::control::Control::NewStub(grpc::CreateChannel(moraine::group::control_address(socket_dir, instance),
                                                                grpc::InsecureChannelCredentials()));
}

// pid of a serving instance, or 0 while it is not (yet) reachable.
pid_t serving_pid(const std::string& socket_dir, const std::string& instance) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  moraine::control::HealthReply r;
  if (!stub(socket_dir, instance)->Health(&ctx, {}, &r).ok() || r.state() != moraine::control::SERVING) return 0;
  return static_cast<pid_t>(r.pid());
}

// Experts the instance computed since the bench last zeroed its counters.
uint64_t experts_computed(const std::string& socket_dir, const std::string& instance) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  moraine::control::StatsRequest req;
  moraine::control::StatsReply r;
  if (!stub(socket_dir, instance)->Stats(&ctx, req, &r).ok()) return 0;
  uint64_t n = 0;
  for (const char* c : {"experts_ram", "experts_file"}) {
    const auto it = r.counters().find(c);
    if (it != r.counters().end()) n += it->second;
  }
  return n;
}

TEST(BenchGroupFault, KilledCpuWorkerMidRunIsRefused) {
  Scratch s("moraine-bench-fault-");
  const std::string build = MORAINE_BUILD_DIR;
  const std::string model = (s.dir / "moe.gguf").string();
  ASSERT_EQ(std::system((build + "/tools/synth/moraine-synth --shape qwen3moe-tiny -o " + model +
                         " --zipf 1.0 --seed 11 2>" + (s.dir / "synth.err").string()).c_str()),
            0)
      << slurp(s.dir / "synth.err");
  const std::string sock = (s.dir / "sock").string();
  const fs::path out = s.dir / "bench.out", err = s.dir / "bench.err", rc = s.dir / "bench.rc";
  // Long enough (4 runs of 300 decode steps) that the kill lands well before the last run ends.
  const std::string bench = build + "/tools/bench/moraine-bench -m " + model +
                            " --engine group --cpu-workers 2 --socket-dir " + sock +
                            " -n 300 -p 5 -r 4 -t 2 --dram-probe-mib 64 --disk-probe-mib 8 --gpu-probe-mib 8 --json";
  ASSERT_EQ(std::system(("(" + bench + " >" + out.string() + " 2>" + err.string() + "; echo $? >" + rc.string() + ") &").c_str()), 0);

  // Wait until cpu_expert_worker-1 computes experts of a timed run, then kill it.
  const std::string victim = moraine::group::cpu_worker_instance(1);
  pid_t pid = 0;
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  while (Clock::now() < deadline && !fs::exists(rc)) {
    pid = serving_pid(sock, victim);
    if (pid > 0 && experts_computed(sock, victim) > 0) break;
    pid = 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_GT(pid, 0) << "the bench's cpu_expert_worker-1 never computed an expert (or the bench ended first)\n"
                    << slurp(err) << slurp(fs::path(sock) / "group.log");
  ASSERT_EQ(::kill(pid, SIGKILL), 0);

  while (!fs::exists(rc) || slurp(rc).empty()) {
    ASSERT_LT(Clock::now(), deadline + std::chrono::seconds(120)) << "the bench did not finish after the kill\n" << slurp(err);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(std::stoi(slurp(rc)), 1) << slurp(err);
  const std::string e = slurp(err);
  EXPECT_NE(e.find("refusing to report numbers from a faulty run"), std::string::npos) << e;
  // Which check sees it first depends on where in the run the kill lands: the supervisor's
  // restart count, the coordinator's re-issued step, a failed Generate, or the dead worker not
  // answering Stats before the next run.
  EXPECT_TRUE(e.find("worker restart") != std::string::npos || e.find("re-issued step") != std::string::npos ||
              e.find("Generate") != std::string::npos || e.find("died or is restarting") != std::string::npos)
      << "the refusal must say what went wrong: " << e;
  EXPECT_EQ(slurp(out), "") << "a refused run printed numbers";
}

}  // namespace
