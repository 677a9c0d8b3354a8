// Fault injection through `moraine serve` (issue 31 item 1), on the CPU backend and the built-in
// model (models/moraine-tiny-qwen3next.gguf): while completions stream, a process of the group is
// SIGKILLed, or frozen (SIGSTOP) and thawed, or frozen and left for the supervisor's Health watch
// to kill, at a random point, N times per kind: the coordinator, the gpu_worker, each
// cpu_expert_worker, the io_worker and the HTTP front end (the `moraine serve` process itself,
// which the test starts again after a kill, as a service manager would). Checked for each event:
// every in-flight request completes with the fault-free run's text or fails with a 503 (status or
// streamed error event) that names the process that went; the group serves the fault-free text
// again within kRecoveryBound; afterwards exactly one process of each kind runs (none stopped),
// and the socket directory and /dev/shm hold what they held before. Counts and recovery times
// are printed. The schedule (order, action, when) comes from a seed, printed first.
//   MORAINE_FAULT_SEED=S        the schedule's seed (default 31)
//   MORAINE_FAULT_ROUNDS=N      events per kind (default 8: 48 events, 99 s on 2 cores); the
//                               issue's 20 (120 events, 267 s on 2 cores under other load):
//     MORAINE_FAULT_ROUNDS=20 build/tests/server/serve_fault_test
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <thread>

#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include "coordinator/group_layout.h"
#include "proto/control.grpc.pb.h"
#include "tests/group/group_harness.h"
#include "tests/server/serve_process.h"

namespace moraine::serve_test {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr const char* kKey = "fault-key";
constexpr int kCpuWorkers = 2, kClients = 3, kTokens = 64;
// Health probes every 0.2 s; a process silent for 5 s is killed (group_health_test's margin for
// a loaded 2-core CI box: a process killed for slowness during another kind's event would make
// that event's 503 name the wrong process).
constexpr double kHealthTimeoutS = 5;
// Measured on 2 cores (seed 31, 20 per kind, 120 events, load average 8 from other builds):
// p50 0.85 s, max 5.76 s (a frozen process: 5 s of silence, then its restart); the bound leaves
// the restart 10 s on a loaded CI box.
constexpr double kRecoveryBoundS = 15;
const std::vector<std::string> kPrompts = {"The river flows", "def fibonacci(n):", "Once upon a time there", "1, 2, 3, 4,"};
const std::string kProbePrompt = "A list is a mutable sequence";

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

std::string body(const std::string& prompt, int n, bool stream) {
  return json{{"prompt", prompt}, {"max_tokens", n}, {"temperature", 0}, {"ignore_eos", true}, {"stream", stream}}.dump();
}

enum class Action { kKill, kFreezeThaw, kFreezeLeft };
const char* action_name(Action a) {
  return a == Action::kKill ? "SIGKILL" : a == Action::kFreezeThaw ? "SIGSTOP+SIGCONT" : "SIGSTOP (left)";
}

struct Event {
  std::string kind;   // an instance name, or "serve"
  Action action;
  int delay_ms, thaw_ms;
};

// N events per kind in a seeded order, the kind's actions taken in turn from a random first one
// (so that 3 per kind give each action once); the point of the fault is a seeded fraction of
// `span_ms`, the fault-free time of the event's requests. The front end is not left frozen: no
// one watches it (a service manager's job, not the group's).
std::vector<Event> schedule(const std::vector<std::string>& kinds, int n, uint32_t seed, int span_ms) {
  std::mt19937 rng(seed);
  std::vector<Event> out;
  for (const std::string& k : kinds) {
    const std::vector<Action> turn = k == "serve" ? std::vector<Action>{Action::kKill, Action::kFreezeThaw}
                                                  : std::vector<Action>{Action::kKill, Action::kFreezeThaw, Action::kFreezeLeft};
    const size_t first = rng() % turn.size();
    for (int i = 0; i < n; ++i)
      out.push_back({k, turn[(first + static_cast<size_t>(i)) % turn.size()], static_cast<int>(rng() % static_cast<uint32_t>(span_ms)),
                     100 + static_cast<int>(rng() % 900)});
  }
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

// Every instance's pid from its Health once all answer SERVING (empty map after `wait`).
std::map<std::string, pid_t> group_pids(const std::string& socket_dir, const std::vector<std::string>& instances,
                                        std::chrono::seconds wait) {
  const auto until = Clock::now() + wait;
  while (Clock::now() < until) {
    std::map<std::string, pid_t> pids;
    for (const std::string& inst : instances) {
      auto stub = control::Control::NewStub(
          grpc::CreateChannel(group::control_address(socket_dir, inst), grpc::InsecureChannelCredentials()));
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + 1s);
      control::HealthReply r;
      if (stub->Health(&ctx, {}, &r).ok() && r.state() == control::SERVING) pids[inst] = static_cast<pid_t>(r.pid());
    }
    if (pids.size() == instances.size()) return pids;
    std::this_thread::sleep_for(50ms);
  }
  return {};
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5))];
}

struct KindCounts {
  std::map<Action, int> actions;
  int completed = 0, failed_503 = 0, lost_with_front_end = 0, wrong = 0;
  std::vector<double> recovery_s;
};

// One in-flight request's outcome, counted: the fault-free text, a 503 naming the kind's process
// ("cpu_expert_worker-1" is a "cpu_expert_worker"), or a connection of a killed front end; any
// other is a failure.
void count_answer(const Event& ev, int i, const Completion& c, const std::string& want, KindCounts& kc,
                  std::map<std::string, std::string>& messages) {
  const bool whole = c.status == 200 && c.error_type.empty() && c.finish == "length" && (i == 2 || c.done);
  if (whole && c.text == want) {
    ++kc.completed;
  } else if (whole) {
    ++kc.wrong;
    ADD_FAILURE() << "request " << i << " completed with other text than the fault-free run's:\n  got  '" << c.text
                  << "'\n  want '" << want << "'";
  } else if (c.status == 503 || (c.status == 200 && c.error_type == "service_unavailable")) {
    ++kc.failed_503;
    messages[ev.kind] = c.error_message;
    const std::string named = ev.kind.substr(0, ev.kind.find('-'));
    EXPECT_NE(c.error_message.find(named), std::string::npos) << "request " << i << ": a 503 that does not name the " << named
                                                              << ": " << c.error_message;
  } else if (c.status == -1 && ev.kind == "serve" && ev.action == Action::kKill) {
    ++kc.lost_with_front_end;   // its connection was the killed process's
  } else {
    ADD_FAILURE() << "request " << i << ": status " << c.status << " (" << c.transport << "), error '" << c.error_type << ": "
                  << c.error_message << "', finish '" << c.finish << "', done " << c.done << ", text '" << c.text << "'";
  }
}

// The counts by kind as a table and one JSON line (`summary` plus "kinds").
void print_counts(const std::vector<std::string>& kinds, std::map<std::string, KindCounts>& counts,
                  const std::map<std::string, std::string>& messages, json summary) {
  std::printf("\n%-20s %5s %5s %5s %9s %6s %6s %6s %9s %9s\n", "kind", "kill", "stop", "left", "completed", "503", "lost",
              "wrong", "rec p50 s", "rec max s");
  std::vector<double> all;
  for (const std::string& k : kinds) {
    KindCounts& c = counts[k];
    all.insert(all.end(), c.recovery_s.begin(), c.recovery_s.end());
    std::printf("%-20s %5d %5d %5d %9d %6d %6d %6d %9.2f %9.2f\n", k.c_str(), c.actions[Action::kKill], c.actions[Action::kFreezeThaw],
                c.actions[Action::kFreezeLeft], c.completed, c.failed_503, c.lost_with_front_end, c.wrong,
                percentile(c.recovery_s, 0.5), percentile(c.recovery_s, 1.0));
    summary["kinds"][k] = {{"sigkill", c.actions[Action::kKill]}, {"sigstop_sigcont", c.actions[Action::kFreezeThaw]},
                           {"sigstop_left", c.actions[Action::kFreezeLeft]}, {"completed", c.completed},
                           {"failed_503", c.failed_503}, {"lost_with_front_end", c.lost_with_front_end},
                           {"recovery_p50_s", percentile(c.recovery_s, 0.5)}, {"recovery_max_s", percentile(c.recovery_s, 1.0)}};
  }
  for (const auto& [k, m] : messages) std::printf("a 503 after %s: %s\n", k.c_str(), m.c_str());
  std::printf("recovery over all %zu events: p50 %.2f s, max %.2f s (bound %.0f s); %.0f s in all\n", all.size(),
              percentile(all, 0.5), percentile(all, 1.0), kRecoveryBoundS, summary["seconds"].get<double>());
  std::printf("fault summary: %s\n", summary.dump().c_str());
}

class ServeFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = group_test::temp_dir("serve-faults");
    model_ = (fs::path(MORAINE_SOURCE_DIR) / "models" / "moraine-tiny-qwen3next.gguf").string();
    ASSERT_TRUE(fs::exists(model_)) << model_;
    instances_ = {group::kCoordinatorInstance, group::kGpuWorkerInstance, group::kIoWorkerInstance};
    for (int i = 0; i < kCpuWorkers; ++i) instances_.push_back(group::cpu_worker_instance(i));
  }
  void TearDown() override {
    stop_serve(serve_, 30s);
    for (const GroupProcess& p : processes_naming(dir_ + "/sock")) kill(p.pid, SIGKILL);   // a failed test's leftovers
    if (!HasFailure()) fs::remove_all(dir_);
  }
  void start() {
    launch_serve(serve_, dir_, model_,
                 {"--api-key", kKey, "--cpu-workers", std::to_string(kCpuWorkers), "--parallel", "2", "--queue", "16", "--ctx", "256",
                  "--supervisor-arg=--gpu-threads=1", "--supervisor-arg=--no-census", "--supervisor-arg=--health-interval=0.2",
                  "--supervisor-arg=--health-timeout=" + std::to_string(kHealthTimeoutS),
                  // 20 events per kind come faster than --max-restarts' default 5 a minute allows.
                  "--supervisor-arg=--max-restarts=1000"});
  }
  // The probe's fault-free text back from the group, or the time ran out (false).
  bool serves_again(double bound_s) {
    const auto until = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(bound_s * 1000));
    while (Clock::now() < until) {
      const Completion c = complete(serve_.port, kKey, body(kProbePrompt, 8, false), 10s);
      if (c.status == 200 && c.text == probe_ref_) return true;
      if (c.status == 200) ADD_FAILURE() << "the probe's text changed: '" << c.text << "', fault-free '" << probe_ref_ << "'";
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }
  // After recovery: one process of each kind (serve, supervisor, the instances), none stopped,
  // and the sockets and shared memory of the start; they may take a moment to settle.
  void expect_nothing_left(const std::string& when) {
    const size_t want = 2 + instances_.size();
    std::vector<GroupProcess> ps;
    bool settled = false;
    for (int i = 0; i < 200 && !settled; ++i) {
      ps = processes_naming(serve_.socket_dir);
      settled = ps.size() == want && std::none_of(ps.begin(), ps.end(), [](const GroupProcess& p) { return p.state == 'T' || p.state == 'Z'; }) &&
                socket_files(serve_.socket_dir) == sockets_ && group_test::shm_files(shm_prefix_).size() == shm_count_;
      if (!settled) std::this_thread::sleep_for(50ms);
    }
    if (settled) return;
    std::string list;
    for (const GroupProcess& p : ps) list += "\n  " + std::to_string(p.pid) + " " + p.state + " " + p.cmdline;
    std::string socks;
    for (const std::string& s : socket_files(serve_.socket_dir)) socks += " " + s;
    ADD_FAILURE() << when << ": " << ps.size() << " processes (want " << want << "):" << list << "\nsockets:" << socks << "\nshm: "
                  << group_test::shm_files(shm_prefix_).size() << " segments (want " << shm_count_ << ")";
  }

  std::string dir_, model_, probe_ref_, shm_prefix_;
  std::vector<std::string> instances_, sockets_;
  size_t shm_count_ = 0;
  ServeProcess serve_;
};

TEST_F(ServeFaults, EveryProcessKilledOrFrozenMidStream) {
  const uint32_t seed = static_cast<uint32_t>(env_int("MORAINE_FAULT_SEED", 31));
  const int rounds = env_int("MORAINE_FAULT_ROUNDS", 8);
  std::printf("fault injection: seed %u (MORAINE_FAULT_SEED), %d events per kind (MORAINE_FAULT_ROUNDS)\n", seed, rounds);
  start();
  ASSERT_GT(serve_.port, 0) << read_text(serve_.log);
  // The fault-free run: each prompt's text, whole and streamed alike.
  std::map<std::string, std::string> ref;
  for (const std::string& p : kPrompts) {
    const Completion whole = complete(serve_.port, kKey, body(p, kTokens, false));
    const Completion streamed = complete(serve_.port, kKey, body(p, kTokens, true));
    ASSERT_EQ(whole.status, 200) << whole.error_message;
    ASSERT_TRUE(streamed.done && streamed.finish == "length") << streamed.error_message;
    ASSERT_EQ(streamed.text, whole.text) << p;
    ref[p] = whole.text;
  }
  probe_ref_ = complete(serve_.port, kKey, body(kProbePrompt, 8, false)).text;
  ASSERT_FALSE(probe_ref_.empty());
  shm_prefix_ = group::group_prefix_for(serve_.socket_dir);
  shm_count_ = group_test::shm_files(shm_prefix_).size();
  sockets_ = socket_files(serve_.socket_dir);
  ASSERT_GT(shm_count_, 0u);
  expect_nothing_left("at the start");

  std::vector<std::string> kinds = instances_;
  kinds.push_back("serve");
  // How long an event's requests take without a fault: the span its fault lands in.
  const auto t_span = Clock::now();
  {
    std::vector<std::thread> clients;
    for (int i = 0; i < kClients; ++i)
      clients.emplace_back([&, i] { complete(serve_.port, kKey, body(kPrompts[static_cast<size_t>(i) % kPrompts.size()], kTokens, i != 2)); });
    for (std::thread& t : clients) t.join();
  }
  const int span_ms = std::max(1, static_cast<int>(std::chrono::duration<double, std::milli>(Clock::now() - t_span).count()));
  std::printf("fault-free: %d requests of %d tokens at once take %d ms, the span each fault lands in\n", kClients, kTokens, span_ms);
  const std::vector<Event> events = schedule(kinds, rounds, seed, span_ms);
  std::map<std::string, KindCounts> counts;
  std::map<std::string, std::string> messages;   // a 503's message, by kind (one example each)
  const auto t_all = Clock::now();
  for (size_t ei = 0; ei < events.size(); ++ei) {
    const Event& ev = events[ei];
    SCOPED_TRACE("event " + std::to_string(ei) + " (seed " + std::to_string(seed) + "): " + action_name(ev.action) + " " + ev.kind);
    const std::map<std::string, pid_t> pids = group_pids(serve_.socket_dir, instances_, 30s);
    ASSERT_FALSE(pids.empty()) << "the group is not all serving before the event";
    const pid_t victim = ev.kind == "serve" ? serve_.pid : pids.at(ev.kind);
    KindCounts& kc = counts[ev.kind];
    ++kc.actions[ev.action];

    std::mt19937 pick(seed + static_cast<uint32_t>(ei));
    std::vector<Completion> answers(kClients);
    std::vector<std::string> asked(kClients);
    std::vector<std::thread> clients;
    for (int i = 0; i < kClients; ++i) {
      asked[i] = kPrompts[pick() % kPrompts.size()];
      // One of them whole (non-streaming): its failure is an HTTP status, not an event.
      clients.emplace_back([&, i] { answers[i] = complete(serve_.port, kKey, body(asked[i], kTokens, i != 2), 60s); });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(ev.delay_ms));
    const auto t_fault = Clock::now();
    ASSERT_EQ(kill(victim, ev.action == Action::kKill ? SIGKILL : SIGSTOP), 0) << ev.kind << " pid " << victim;
    if (ev.action == Action::kFreezeThaw) {
      std::this_thread::sleep_for(std::chrono::milliseconds(ev.thaw_ms));
      kill(victim, SIGCONT);
    }
    if (ev.kind == "serve" && ev.action == Action::kKill) {
      for (std::thread& t : clients) t.join();
      waitpid(victim, nullptr, 0);
      serve_.pid = -1;
      // The supervisor sees serve gone (--exit-with) and stops the group: nothing may stay.
      std::vector<GroupProcess> left;
      for (int i = 0; i < 600; ++i) {
        left = processes_naming(serve_.socket_dir);
        if (left.empty() && group_test::shm_files(shm_prefix_).empty()) break;
        std::this_thread::sleep_for(50ms);
      }
      ASSERT_TRUE(left.empty()) << left.size() << " processes of the group outlived serve's SIGKILL by 30 s: " << left[0].cmdline;
      ASSERT_TRUE(group_test::shm_files(shm_prefix_).empty()) << "shared memory outlived serve's SIGKILL";
      start();
      ASSERT_GT(serve_.port, 0) << "serve did not start again: " << read_text(serve_.log);
    } else {
      for (std::thread& t : clients) t.join();
    }
    const bool recovered = serves_again(kRecoveryBoundS);
    const double recovery = std::chrono::duration<double>(Clock::now() - t_fault).count();
    EXPECT_TRUE(recovered) << "the group did not serve again within " << kRecoveryBoundS << " s";
    kc.recovery_s.push_back(recovery);

    for (int i = 0; i < kClients; ++i) count_answer(ev, i, answers[i], ref[asked[i]], kc, messages);
    expect_nothing_left("after the event");
    std::printf("event %3zu: %-15s %-19s at %3d ms: served again in %.2f s\n", ei, action_name(ev.action), ev.kind.c_str(),
                ev.delay_ms, recovery);
    if (HasFatalFailure()) return;
  }
  const double total_s = std::chrono::duration<double>(Clock::now() - t_all).count();

  print_counts(kinds, counts, messages, json{{"seed", seed}, {"rounds", rounds}, {"seconds", total_s}});

  // Stopped: every process, socket and segment goes.
  EXPECT_EQ(stop_serve(serve_), 0);
  EXPECT_TRUE(processes_naming(serve_.socket_dir).empty());
  EXPECT_TRUE(socket_files(serve_.socket_dir).empty());
  EXPECT_TRUE(group_test::shm_files(shm_prefix_).empty());
}

// The front end's channel after a coordinator SIGKILLed mid-stream: its connection attempts
// timed out waiting for the new coordinator's SETTINGS for ~8 s (3 of 3 runs) while a fresh
// client got through at once; a failed call now gets the front end a channel of its own.
TEST_F(ServeFaults, CoordinatorKilledMidStreamIsServedWithinASecondOfItsRestart) {
  start();
  ASSERT_GT(serve_.port, 0) << read_text(serve_.log);
  probe_ref_ = complete(serve_.port, kKey, body(kProbePrompt, 8, false)).text;
  for (int round = 0; round < 3; ++round) {
    const std::map<std::string, pid_t> pids = group_pids(serve_.socket_dir, instances_, 30s);
    ASSERT_FALSE(pids.empty());
    std::vector<Completion> answers(kClients);
    std::vector<std::thread> clients;
    for (int i = 0; i < kClients; ++i)
      clients.emplace_back([&, i] { answers[i] = complete(serve_.port, kKey, body(kPrompts[0], kTokens, true), 60s); });
    std::this_thread::sleep_for(200ms);
    ASSERT_EQ(kill(pids.at(group::kCoordinatorInstance), SIGKILL), 0);
    for (std::thread& t : clients) t.join();
    const std::map<std::string, pid_t> again = group_pids(serve_.socket_dir, instances_, 30s);
    ASSERT_FALSE(again.empty()) << "the group did not restart";
    const auto t0 = Clock::now();
    ASSERT_TRUE(serves_again(10));
    const double after = std::chrono::duration<double>(Clock::now() - t0).count();
    std::printf("round %d: served %.2f s after the restarted group answered Health\n", round, after);
    EXPECT_LT(after, 1.5) << "the front end did not reconnect to the restarted coordinator";
  }
}

// Whether every process of the group and its shared memory are gone within `wait`.
bool all_gone(const std::string& socket_dir, std::chrono::seconds wait) {
  const auto until = Clock::now() + wait;
  const std::string prefix = group::group_prefix_for(socket_dir);
  while (Clock::now() < until) {
    if (processes_naming(socket_dir).empty() && group_test::shm_files(prefix).empty()) return true;
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

// serve stopped after its socket directory lost supervisor.pid (a /tmp cleaner): the stop went
// through `moraine-supervisor stop`, which needs that file; the supervisor was SIGKILLed 60 s
// later and the coordinator and workers ran on, orphaned.
TEST_F(ServeFaults, StopWithoutThePidFileLeavesNothing) {
  start();
  ASSERT_GT(serve_.port, 0) << read_text(serve_.log);
  ASSERT_TRUE(fs::remove(serve_.socket_dir + "/supervisor.pid"));
  const auto t0 = Clock::now();
  EXPECT_EQ(stop_serve(serve_, 30s), 0);
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("serve stopped in %.2f s without supervisor.pid\n", took);
  EXPECT_LT(took, 20);
  const std::vector<GroupProcess> left = processes_naming(serve_.socket_dir);
  EXPECT_TRUE(all_gone(serve_.socket_dir, 10s)) << left.size() << " processes left, the first: " << (left.empty() ? "" : left[0].cmdline);
}

// The supervisor SIGKILLed: serve sees its group gone and exits; the group's processes get
// SIGTERM from their parent's death (PR_SET_PDEATHSIG) and go, with the shared memory. Before,
// they ran on with no supervisor.
TEST_F(ServeFaults, SupervisorKilledTakesItsGroupAlong) {
  start();
  ASSERT_GT(serve_.port, 0) << read_text(serve_.log);
  pid_t supervisor = 0;
  std::ifstream(serve_.socket_dir + "/supervisor.pid") >> supervisor;
  ASSERT_GT(supervisor, 0);
  ASSERT_EQ(kill(supervisor, SIGKILL), 0);
  int status = 0;
  pid_t done = 0;
  for (int i = 0; i < 400 && done == 0; ++i) {
    done = waitpid(serve_.pid, &status, WNOHANG);
    if (done == 0) std::this_thread::sleep_for(50ms);
  }
  ASSERT_EQ(done, serve_.pid) << "serve went on without its supervisor";
  serve_.pid = -1;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  const std::vector<GroupProcess> left = processes_naming(serve_.socket_dir);
  EXPECT_TRUE(all_gone(serve_.socket_dir, 20s)) << left.size() << " processes left, the first: " << (left.empty() ? "" : left[0].cmdline);
}

}  // namespace
}  // namespace moraine::serve_test
