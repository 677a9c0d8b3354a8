// moraine-supervisor: starts the group (coordinator first: it creates the shared memory and the
// manifest the workers start from; then the gpu_worker, the cpu_expert_workers and the
// io_worker), waits for every Health to say SERVING, probes Health every --health-interval and
// kills a process silent for --health-timeout, restarts a worker that dies (the whole group when
// it is the coordinator, whose shared memory the workers map), and on
// SIGINT/SIGTERM (what `moraine-supervisor stop` sends) stops everything: workers, then the
// coordinator, which removes its shared memory; anything a killed coordinator left is reclaimed
// here too.
//   moraine-supervisor start -m MODEL [--vram BYTES] [--ram BYTES] [--cpu-workers N] [--socket-dir DIR]
//                            [--config FILE]
//   moraine-supervisor stop [--socket-dir DIR]
#include <fcntl.h>
#include <sched.h>
#include <sys/prctl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "common/fileio/atomic_file.h"
#include "common/shm/shm_segment.h"
#include "coordinator/control_server.h"
#include "coordinator/group_layout.h"
#include "coordinator/health_watch.h"
#include "coordinator/private_socket.h"
#include "coordinator/process_util.h"

namespace {

using namespace moraine;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string model, socket_dir = "/tmp/moraine", bin_dir, handoff = "doorbell", log_dir, logits_dump;
  // Placement, passed to the coordinator. vram empty: "unlimited" with the CUDA backend, "dense"
  // (no experts on the gpu_worker) with the CPU backend, whose "VRAM" is the same RAM the
  // cpu_expert_workers compute from.
  std::string vram, ram = "unlimited", census;
  std::string file_cache;   // the coordinator's --file-cache; empty: its default
  std::string disk_rate;    // the coordinator's --disk-rate; empty: its default (measured)
  bool no_census = false;
  int vram_adapt_every = 8;
  int reserve_cores = -1;   // cores left out of the cpu workers' pins; -1: 1 with --backend cuda, else 0
  bool pin_control_plane = true;   // coordinator, gpu_worker and io_worker on the reserved cores
  std::vector<std::string> cpu_worker_args;   // appended to every cpu_expert_worker's command line
  std::vector<std::string> gpu_worker_args;   // appended to the gpu_worker's
  std::vector<std::string> coordinator_args;  // appended to the coordinator's
  int64_t ctx = 0;
  int cpu_workers = 2, max_tokens = 0, gpu_threads = 0, device = 0;   // max_tokens 0: the coordinator's choice
  int long_step_rows = -1;   // -1: the coordinator's default (8192 with --backend cuda, none with cpu)
  std::string backend = "cpu";
  std::string kv_type;   // the coordinator's --kv-type; empty: its default (f16 with cuda, f32 with cpu)
  std::string cache_ram;   // the coordinator's --cache-ram; empty: its default
  int parallel = 0, turn_tokens = 0;   // the coordinator's --parallel / --turn-tokens; 0: its default
  // The group stops when this process is gone (`moraine serve` passes its own pid: a serve killed
  // with SIGKILL cannot stop its group, which otherwise kept running with its shared memory).
  int exit_with = 0;
  double ready_timeout_s = 120;
  // Health probes of every process (0: none); one silent for health_timeout_s is killed and
  // restarted. max_restarts: restarts of one process within a minute before the group stops.
  double health_interval_s = 1, health_timeout_s = 10;
  int max_restarts = 5;
};

struct Child {
  Child(std::string n, std::vector<std::string> a) : name(std::move(n)), argv(std::move(a)) {}
  std::string name;          // instance name
  std::vector<std::string> argv;
  pid_t pid = -1;
  std::vector<Clock::time_point> restarts;
  std::vector<int> cpus;     // CPU affinity set before exec (inherited by every thread); empty: any
};

std::string find_binary(const Options& o, const std::string& name, const char* subdir) {
  std::vector<fs::path> dirs;
  if (!o.bin_dir.empty()) dirs.push_back(o.bin_dir);
  const fs::path self = fs::read_symlink("/proc/self/exe").parent_path();
  dirs.push_back(self);
  dirs.push_back(self.parent_path() / subdir);   // the build tree: build/<subdir>/<name>
  for (const fs::path& d : dirs) {
    if (fs::exists(d / name)) return (d / name).string();
  }
  throw std::runtime_error("cannot find " + name + " beside " + self.string() + " (use --bin-dir)");
}

pid_t spawn(const Child& c, const std::string& log_dir) {
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed for " + c.name);
  if (pid == 0) {
    const std::string log = log_dir + "/" + c.name + ".log";
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    std::vector<char*> argv;
    for (const std::string& a : c.argv) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    // Restore default signal handling: the supervisor's handlers do not belong to the child.
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    // A supervisor SIGKILLed cannot stop its group: each process gets SIGTERM then (and stops as
    // on `stop`); before, the whole group ran on, orphaned (ServeFaults.SupervisorKilled...).
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);   // it died before the prctl
    if (!c.cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int cpu : c.cpus) CPU_SET(cpu, &set);
      // Best effort: a container may forbid some CPUs; the child then runs unpinned (its log says so).
      if (sched_setaffinity(0, sizeof(set), &set) != 0) std::perror("supervisor: sched_setaffinity");
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

// Stops children in the order given: SIGTERM, wait up to the grace period, then SIGKILL.
void stop_children(std::vector<Child*> order) {
  for (Child* c : order) {
    if (c->pid <= 0) continue;
    kill(c->pid, SIGTERM);
    const auto until = Clock::now() + std::chrono::seconds(10);
    int status = 0;
    while (waitpid(c->pid, &status, WNOHANG) == 0) {
      if (Clock::now() > until) {
        std::cerr << "supervisor: " << c->name << " ignored SIGTERM; killing\n";
        kill(c->pid, SIGKILL);
        waitpid(c->pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    c->pid = -1;
  }
}

int start(const Options& o) {
  if (o.model.empty()) throw std::invalid_argument("start: -m MODEL is required");
  if (o.cpu_workers < 1) throw std::invalid_argument("--cpu-workers must be >= 1");
  group::ensure_private_dir(o.socket_dir);
  const std::string log_dir = o.log_dir.empty() ? o.socket_dir : o.log_dir;
  const std::string pid_file = o.socket_dir + "/supervisor.pid";
  {
    std::ifstream in(pid_file);
    pid_t other = 0;
    if (in >> other && other > 0 && group::process_running(other)) {
      throw std::runtime_error("a supervisor (pid " + std::to_string(other) + ") already runs the group in " + o.socket_dir);
    }
  }
  fileio::write_file_atomic(pid_file, std::to_string(getpid()) + "\n", 0600);
  group::install_stop_signals();
  std::remove(group::manifest_path(o.socket_dir).c_str());   // a stale one would mislead workers
  // The supervisor answers Health too: SERVING once every process of the group is, so a client
  // (or a test that is about to kill a worker) waits for the whole group with one probe.
  group::ControlServer control(control::ROLE_SUPERVISOR, group::kSupervisorInstance,
                               group::control_address(o.socket_dir, group::kSupervisorInstance));
  group::StageRecorder& starts = control.add_stage("process_start");
  // Restarts since the group started (never reset), so that a client such as moraine-bench can
  // tell that a run lost a worker.
  std::atomic<uint64_t> restarts_total{0};
  control.set_stats_hook([&](control::StatsReply& r) { (*r.mutable_counters())["restarts"] = restarts_total.load(); });
  control.set_state(control::STARTING);
  control.start();

  Child coord{group::kCoordinatorInstance,
              {find_binary(o, "moraine-coordinator", "coordinator"), "-m", o.model, "--socket-dir", o.socket_dir,
               "--cpu-workers", std::to_string(o.cpu_workers), "--max-tokens", std::to_string(o.max_tokens),
               "--handoff", o.handoff, "--vram", o.vram.empty() ? (o.backend == "cuda" ? "unlimited" : "dense") : o.vram, "--ram", o.ram, "--ctx", std::to_string(o.ctx), "--backend", o.backend}};
  if (!o.census.empty()) {
    coord.argv.push_back("--census");
    coord.argv.push_back(o.census);
  }
  if (o.no_census) coord.argv.push_back("--no-census");
  if (!o.file_cache.empty()) coord.argv.insert(coord.argv.end(), {"--file-cache", o.file_cache});
  if (!o.disk_rate.empty()) coord.argv.insert(coord.argv.end(), {"--disk-rate", o.disk_rate});
  if (o.long_step_rows >= 0) coord.argv.insert(coord.argv.end(), {"--long-step-rows", std::to_string(o.long_step_rows)});
  for (auto [flag, v] : {std::pair{"--parallel", o.parallel}, std::pair{"--turn-tokens", o.turn_tokens}}) {
    if (v <= 0) continue;
    coord.argv.push_back(flag);
    coord.argv.push_back(std::to_string(v));
  }
  if (!o.cache_ram.empty()) {
    coord.argv.push_back("--cache-ram");
    coord.argv.push_back(o.cache_ram);
  }
  if (!o.kv_type.empty()) {
    coord.argv.push_back("--kv-type");
    coord.argv.push_back(o.kv_type);
  }
  coord.argv.push_back("--vram-adapt-every");
  coord.argv.push_back(std::to_string(o.vram_adapt_every));
  Child gpu{group::kGpuWorkerInstance,
            {find_binary(o, "moraine-gpu-worker", "gpu_worker"), "--socket-dir", o.socket_dir, "--backend", o.backend,
             "--device", std::to_string(o.device), "--threads", std::to_string(o.gpu_threads)}};
  if (!o.logits_dump.empty()) {
    coord.argv.push_back("--logits-dump");
    coord.argv.push_back(o.logits_dump);
  }
  std::vector<Child> cpus;
  // Split the cores evenly; one worker per NUMA node is the production shape, this is the
  // one-node layout that lets two workers be tested on a small box. With the CUDA backend the
  // first core is left to the gpu_worker's host thread, which drives every layer: when the cpu
  // workers' pinned threads hold every core, a layer's pool barrier waits behind it.
  const int all_cores = static_cast<int>(std::thread::hardware_concurrency());
  const int reserve = std::clamp(o.reserve_cores >= 0 ? o.reserve_cores : (o.backend == "cuda" ? 1 : 0), 0,
                                 std::max(0, all_cores - 1));
  const int n_cores = all_cores - reserve;
  const int per = std::max(1, n_cores / o.cpu_workers);
  const std::string cpu_bin = find_binary(o, "moraine-cpu-expert-worker", "cpu_expert_worker");
  for (int i = 0; i < o.cpu_workers; ++i) {
    const int lo = (i * per) % std::max(1, n_cores);
    const std::string list =
        std::to_string(reserve + lo) + "-" + std::to_string(reserve + std::min(n_cores - 1, lo + per - 1));
    cpus.emplace_back(group::cpu_worker_instance(i),
                      std::vector<std::string>{cpu_bin, "--socket-dir", o.socket_dir, "--index", std::to_string(i), "--cpus", list});
  }
  // The io_worker fills arena slots of file-resident experts for the cpu_expert_workers.
  Child io{group::kIoWorkerInstance, {find_binary(o, "moraine-io-worker", "io_worker"), "--socket-dir", o.socket_dir}};
  // Reserving a core is not enough: unpinned, the gpu_worker's threads (the host thread spins
  // through a whole hand-off step), the coordinator's and the io_worker's float onto the cpu
  // workers' pinned pool CPUs, and a layer's job list waits behind the descheduled pool thread.
  // So the control plane is pinned to the reserved cores.
  if (reserve > 0 && o.pin_control_plane) {
    std::vector<int> control_cpus(static_cast<size_t>(reserve));
    for (int c = 0; c < reserve; ++c) control_cpus[static_cast<size_t>(c)] = c;
    coord.cpus = gpu.cpus = io.cpus = control_cpus;
  }
  for (Child& c : cpus) c.argv.insert(c.argv.end(), o.cpu_worker_args.begin(), o.cpu_worker_args.end());
  gpu.argv.insert(gpu.argv.end(), o.gpu_worker_args.begin(), o.gpu_worker_args.end());
  coord.argv.insert(coord.argv.end(), o.coordinator_args.begin(), o.coordinator_args.end());
  std::vector<Child*> workers{&gpu};
  for (Child& c : cpus) workers.push_back(&c);
  workers.push_back(&io);
  std::vector<Child*> stop_order = workers;
  stop_order.push_back(&coord);

  const auto deadline = std::chrono::milliseconds(static_cast<int64_t>(o.ready_timeout_s * 1000));
  auto fail = [&](const std::string& why) {
    std::cerr << "supervisor: " << why << "\n";
    stop_children(stop_order);
    shm::reclaim_dead_segments(group::group_prefix_for(o.socket_dir));
    std::remove(pid_file.c_str());
    return 1;
  };
  const auto t0 = Clock::now();
  auto started = [&] { starts.record(0, 0, 0, std::chrono::duration<double, std::micro>(Clock::now() - t0).count()); };
  group::HealthWatch health(std::chrono::milliseconds(static_cast<int64_t>(o.health_interval_s * 1000)),
                            std::chrono::milliseconds(static_cast<int64_t>(o.health_timeout_s * 1000)));
  auto watch = [&](const Child& c, bool serving_now) {
    health.watch(c.name, group::control_address(o.socket_dir, c.name), Clock::now() + deadline, serving_now);
  };
  // The coordinator first (it makes the shared memory and the manifest), then the workers;
  // the empty string when every process serves.
  auto launch_group = [&]() -> std::string {
    coord.pid = spawn(coord, log_dir);
    if (std::string e = group::wait_serving(group::control_address(o.socket_dir, coord.name), deadline, coord.pid); !e.empty()) {
      return e;
    }
    started();
    watch(coord, true);
    for (Child* c : workers) c->pid = spawn(*c, log_dir);
    for (Child* c : workers) {
      if (std::string e = group::wait_serving(group::control_address(o.socket_dir, c->name), deadline, c->pid); !e.empty()) {
        return e;
      }
      started();
      watch(*c, true);
    }
    return {};
  };
  if (std::string e = launch_group(); !e.empty()) return fail(e);
  control.set_state(control::SERVING);
  std::cout << "supervisor: group serving in " << o.socket_dir << " (" << o.cpu_workers << " cpu workers)" << std::endl;

  // A restart counted against the process's limit; false (and said) when it is used up.
  auto may_restart = [&](Child& c) {
    const auto now = Clock::now();
    std::erase_if(c.restarts, [&](Clock::time_point t) { return now - t > std::chrono::minutes(1); });
    if (static_cast<int>(c.restarts.size()) >= o.max_restarts) {
      std::cerr << "supervisor: " << c.name << " died " << c.restarts.size()
                << " times within a minute (--max-restarts); stopping the group\n";
      return false;
    }
    c.restarts.push_back(now);
    restarts_total.fetch_add(1);
    return true;
  };
  // The coordinator owns the shared memory the workers map, so its restart is the group's:
  // workers stopped, its segments reclaimed, then a fresh start that plans again from the census.
  auto restart_group = [&]() -> bool {
    control.set_state(control::STARTING, "restarting the group after the coordinator died");
    for (Child* c : workers) health.unwatch(c->name);
    health.unwatch(coord.name);
    stop_children(workers);
    shm::reclaim_dead_segments(group::group_prefix_for(o.socket_dir));
    std::remove(group::manifest_path(o.socket_dir).c_str());
    if (std::string e = launch_group(); !e.empty()) {
      std::cerr << "supervisor: the group did not restart: " << e << "\n";
      return false;
    }
    control.set_state(control::SERVING);
    std::cerr << "supervisor: group serving again after the coordinator's restart\n";
    return true;
  };

  int rc = 0;
  const uint64_t exit_with_ticks = o.exit_with > 0 ? shm::process_start_ticks(static_cast<uint32_t>(o.exit_with)) : 0;
  auto next_owner_check = Clock::now(), next_health_check = Clock::now();
  std::vector<Child*> everyone = workers;
  everyone.push_back(&coord);
  while (!group::signal_received()) {
    if (o.exit_with > 0 && Clock::now() >= next_owner_check) {
      next_owner_check = Clock::now() + std::chrono::milliseconds(250);
      if (!shm::process_alive(static_cast<uint32_t>(o.exit_with), exit_with_ticks)) {
        std::cerr << "supervisor: pid " << o.exit_with << " (--exit-with) is gone; stopping the group\n";
        break;
      }
    }
    if (Clock::now() >= next_health_check) {
      next_health_check = Clock::now() + std::chrono::milliseconds(100);
      for (const group::HealthWatch::Silent& q : health.silent()) {
        auto it = std::find_if(everyone.begin(), everyone.end(), [&](Child* c) { return c->name == q.name; });
        if (it == everyone.end() || (*it)->pid <= 0) continue;
        std::cerr << "supervisor: " << q.name << " (pid " << (*it)->pid << ") "
                  << (q.never_answered ? "never answered Health in " : "has not answered Health for ") << q.seconds
                  << " s; killing it\n";
        health.unwatch(q.name);
        kill((*it)->pid, SIGKILL);   // reaped below, and restarted like any death
      }
    }
    int status = 0;
    const pid_t dead = waitpid(-1, &status, WNOHANG);
    if (dead <= 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    if (dead == coord.pid) {
      coord.pid = -1;
      std::cerr << "supervisor: the coordinator died (status " << status << "); restarting the group\n";
      if (!may_restart(coord) || !restart_group()) {
        rc = 1;
        break;
      }
      continue;
    }
    for (Child* c : workers) {
      if (c->pid != dead) continue;
      c->pid = -1;
      health.unwatch(c->name);
      // A worker that saw its coordinator go first: the group's restart below starts it again.
      siginfo_t info{};
      if (coord.pid > 0 && waitid(P_PID, static_cast<id_t>(coord.pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
          info.si_pid == coord.pid) {
        std::cerr << "supervisor: " << c->name << " (pid " << dead << ") exited after the coordinator\n";
        continue;
      }
      if (!may_restart(*c)) {
        rc = 1;
        break;
      }
      std::cerr << "supervisor: " << c->name << " (pid " << dead << ") died (status " << status << "); restarting\n";
      c->pid = spawn(*c, log_dir);
      watch(*c, false);   // restarted: it has --ready-timeout to answer first
      started();
    }
    if (rc != 0) break;
  }
  control.set_state(control::DRAINING, "stopping");
  stop_children(stop_order);
  control.stop();
  // A coordinator that was killed could not remove its segments.
  shm::reclaim_dead_segments(group::group_prefix_for(o.socket_dir));
  std::remove(pid_file.c_str());
  std::remove(group::manifest_path(o.socket_dir).c_str());
  std::cerr << "supervisor: stopped\n";
  return rc;
}

int stop(const std::string& socket_dir) {
  const std::string pid_file = socket_dir + "/supervisor.pid";
  std::ifstream in(pid_file);
  pid_t pid = 0;
  if (!(in >> pid) || pid <= 0) {
    std::cerr << "moraine-supervisor stop: no supervisor pid in " << pid_file << "\n";
    return 1;
  }
  if (kill(pid, SIGTERM) != 0) {
    std::cerr << "moraine-supervisor stop: supervisor " << pid << " is not running\n";
    std::remove(pid_file.c_str());
    return 1;
  }
  const auto until = Clock::now() + std::chrono::seconds(60);
  // The supervisor's parent may not have reaped it yet: a zombie has stopped.
  while (group::process_running(pid) && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (group::process_running(pid)) {
    std::cerr << "moraine-supervisor stop: supervisor " << pid << " still running after 60 s\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moraine-supervisor: start, watch and stop a moraine process group"};
  app.require_subcommand(1);
  Options o;
  // CLI11 (2.1) reads a config file only for the top-level app; `start --config FILE` reaches it
  // through fallthrough, and the file's [start] section (or start.KEY) sets start's options.
  app.set_config("--config", "", "TOML/INI file: a [start] section with any of start's options (vram = \"12G\")");
  CLI::App* st = app.add_subcommand("start", "start the group and supervise it (foreground)");
  st->fallthrough();
  st->add_option("-m,--model", o.model, "GGUF model file");
  st->add_option("--cpu-workers", o.cpu_workers, "cpu_expert_workers to run");
  st->add_option("--socket-dir", o.socket_dir, "directory for sockets, manifest, logs");
  st->add_option("--bin-dir", o.bin_dir, "where the moraine executables are");
  st->add_option("--handoff", o.handoff, "doorbell or zmq")->check(CLI::IsMember({"doorbell", "zmq"}));
  // A later --max-tokens / --long-step-rows wins (moraine-bench passes its own first).
  st->add_option("--max-tokens", o.max_tokens, "rows of one step (prefill chunk), or of one window of a long step (default 0: the coordinator's "
                 "choice, 512 or with --backend cuda's long steps up to 4096 as --vram allows)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  st->add_option("--long-step-rows", o.long_step_rows,
                 "rows of a long prefill step, which the gpu_worker runs layer by layer over windows of --max-tokens rows "
                 "so staged experts cross PCIe once per long step (default: 8192 with --backend cuda, none with cpu; 0: none)")
      ->check(CLI::NonNegativeNumber)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  st->add_option("--vram", o.vram, "GPU memory budget, what the gpu_worker may hold on the card: dense + KV + (cuda) its context and scratch first, then experts (12G, 512M, unlimited, dense; default: unlimited with --backend cuda, dense with cpu)");
  st->add_option("--ram", o.ram, "RAM budget of the expert arena; experts beyond it stay in the file (unlimited)");
  st->add_option("--file-cache", o.file_cache,
                 "of --ram, what the cache of file-resident experts takes when some stay in the file (default: a quarter)");
  st->add_option("--disk-rate", o.disk_rate,
                 "disk read rate (bytes/s, e.g. 1.5G) for the plan's disk bound line (default: measured at start by a short O_DIRECT read)");
  st->add_option("--census", o.census, "expert popularity counts (JSON), read for placement and merged into by the gpu_worker (default MODEL.census.json)");
  st->add_flag("--no-census", o.no_census, "the gpu_worker writes no census");
  st->add_option("--vram-adapt-every", o.vram_adapt_every,
                 "steps between swaps of popular experts into VRAM while running (0: keep the placement's set)")
      ->check(CLI::NonNegativeNumber);
  st->add_option("--reserve-cores", o.reserve_cores,
                 "cores the cpu workers leave free (default: 1 with --backend cuda, for the gpu_worker's host thread; else 0)")
      ->check(CLI::NonNegativeNumber);
  st->add_flag("!--no-pin-control-plane", o.pin_control_plane,
               "leave the coordinator, gpu_worker and io_worker unpinned (default: pinned to the reserved cores)");
  st->add_option("--cpu-worker-arg", o.cpu_worker_args,
                 "an extra argument for every cpu_expert_worker (repeat; e.g. --cpu-worker-arg=--spin-us=500)")
      ->allow_extra_args(false);
  st->add_option("--gpu-worker-arg", o.gpu_worker_args,
                 "an extra argument for the gpu_worker (repeat; e.g. --gpu-worker-arg=--device-takes-from=3)")
      ->allow_extra_args(false);
  st->add_option("--coordinator-arg", o.coordinator_args,
                 "an extra argument for the coordinator (repeat; e.g. --coordinator-arg=--step-channel=zmq)")
      ->allow_extra_args(false);
  st->add_option("--ctx", o.ctx, "context to plan KV memory for (0: min(4096, the model's))");
  st->add_option("--backend", o.backend, "the gpu_worker's backend: cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  st->add_option("--kv-type", o.kv_type,
                 "KV cache element type: f16 (default with --backend cuda, as llama.cpp's) or f32 (default, and the "
                 "only one, with cpu); the coordinator charges it to --vram, the gpu_worker holds it")
      ->check(CLI::IsMember({"f16", "f32"}));
  st->add_option("--exit-with", o.exit_with, "stop the group when the process with this pid is gone (moraine serve passes its own)")
      ->check(CLI::PositiveNumber);
  st->add_option("--parallel", o.parallel,
                 "requests the coordinator runs at once, taking turns on the gpu_worker (1: one after another)")
      ->check(CLI::Range(1, 256));
  st->add_option("--turn-tokens", o.turn_tokens, "tokens a request's turn runs before it yields to a waiting one (16)")
      ->check(CLI::Range(1, 1 << 20));
  st->add_option("--cache-ram", o.cache_ram,
                 "host memory for earlier conversations' saved KV cache and state, so that continuing any of them "
                 "prefills only the new tokens (default 8G; 0: only the last one is reused)");
  st->add_option("--device", o.device, "GPU index for --backend cuda");
  st->add_option("--gpu-threads", o.gpu_threads, "CPU backend threads of the gpu_worker (0 = all)");
  st->add_option("--log-dir", o.log_dir, "per-process logs (default: the socket dir)");
  st->add_option("--logits-dump", o.logits_dump, "coordinator writes each sampled row's logits here (tests)");
  st->add_option("--ready-timeout", o.ready_timeout_s, "seconds to wait for every Health");
  st->add_option("--health-interval", o.health_interval_s,
                 "seconds between Health probes of every process of the group (0: none)")
      ->check(CLI::NonNegativeNumber);
  st->add_option("--health-timeout", o.health_timeout_s,
                 "seconds a process may leave Health unanswered before it is killed and restarted")
      ->check(CLI::PositiveNumber);
  st->add_option("--max-restarts", o.max_restarts,
                 "restarts of one process within a minute before the group is stopped and the failure reported")
      ->check(CLI::Range(0, 1000));
  CLI::App* sp = app.add_subcommand("stop", "stop the group started in --socket-dir");
  sp->add_option("--socket-dir", o.socket_dir, "group socket directory");
  CLI11_PARSE(app, argc, argv);
  try {
    return st->parsed() ? start(o) : stop(o.socket_dir);
  } catch (const std::exception& e) {
    std::cerr << "moraine-supervisor: " << e.what() << "\n";
    return 1;
  }
}
