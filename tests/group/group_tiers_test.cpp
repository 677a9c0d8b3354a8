// The process group with budgets that put experts in all three tiers (coordinator/placement.h):
// VRAM-tier experts computed by the gpu_worker's backend, RAM-tier ones by their cpu worker from
// the arena, FILE-tier ones read by io_worker-0 into the worker's staging slots on demand. The
// greedy tokens and every sampled row's logits must equal the reference executor's bit for bit,
// and `moraine stats` must show every process (io_worker-0 included) doing work.
#include <gtest/gtest.h>

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <cstdio>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/model/model.h"
#include "coordinator/control_server.h"
#include "coordinator/group_layout.h"
#include "coordinator/placement.h"
#include "tests/group/group_harness.h"

namespace moraine::group_test {
namespace {

namespace fs = std::filesystem;

struct Case {
  std::string model;
  std::string weights;   // "f32" or "kmix"
  std::string handoff;
  bool census = false;   // a random popularity census beside the model
  // gpu_worker --device-takes-from (0: its default): 1 has the device take one RAM-tier expert of
  // every hand-off layer with a miss (Backend::handoff_take_expert; the CPU backend computes it
  // from the arena bytes it is given), so the protocol runs on every decode step.
  int device_takes_from = 0;
  std::string name() const {
    return param_name(model) + "_" + weights + "_" + handoff + (census ? "_census" : "") + (device_takes_from > 0 ? "_device_takes" : "");
  }
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name(); }

// Budgets for about a quarter of each layer's experts in VRAM and, of the rest, as many in RAM
// as leave some in the file. The RAM budget is searched with the planner itself, from large to
// small, because the staging slots the FILE tier needs come out of it too (on the 3- and
// 4-expert models only a few budgets give all three tiers). The group's own plan file is
// checked afterwards.
std::pair<std::string, std::string> three_tier_budgets(const std::string& model_path, int n_cpu_workers) {
  const model::Model m = model::Model::load(model_path);
  group::PlacementInput in;
  in.sizes = group::model_sizes(m, group::planned_context(m, 0));
  in.n_cpu_workers = n_cpu_workers;
  const group::ModelSizes& s = in.sizes;
  const uint64_t per_layer = static_cast<uint64_t>(std::max<int64_t>(1, s.n_expert / 4));
  in.vram_budget = s.dense_bytes + s.kv_bytes;
  uint64_t max_slot = 0;
  for (int64_t il = 0; il < s.n_layer; ++il) {
    in.vram_budget += per_layer * s.expert_bytes[static_cast<size_t>(il)];
    max_slot = std::max(max_slot, s.expert_slot_bytes[static_cast<size_t>(il)]);
  }
  for (int64_t slots = s.n_layer * s.n_expert; slots > 0; --slots) {
    in.ram_budget = static_cast<uint64_t>(slots) * max_slot + max_slot / 2;
    try {
      const group::PlacementPlan p = group::plan_placement(in);
      if (p.vram.experts > 0 && p.ram.experts > 0 && p.file.experts > 0) {
        return {std::to_string(in.vram_budget), std::to_string(in.ram_budget)};
      }
    } catch (const std::invalid_argument&) {
      // too small for the staging slots: smaller budgets are too
      break;
    }
  }
  throw std::runtime_error("no RAM budget puts experts of " + model_path + " in all three tiers");
}

class GroupTiers : public ::testing::TestWithParam<Case> {};

TEST_P(GroupTiers, ThreeTiersMatchReferenceAndEveryStageCounts) {
  const Case& c = GetParam();
  constexpr int kTokens = 12;
  const auto [dir, model, prompt, ref] = golden_case(c.model, c.weights, "tiers", kTokens);

  GroupOptions o;
  o.model = model;
  o.handoff = c.handoff;
  o.logits_dump = dir + "/logits.f32";
  std::tie(o.vram, o.ram) = three_tier_budgets(model, o.cpu_workers);
  if (c.device_takes_from > 0) o.extra_args.push_back("--gpu-worker-arg=--device-takes-from=" + std::to_string(c.device_takes_from));
  group::Census census;
  if (c.census) {
    const model::Model m = model::Model::load(model);
    census = group::Census::uniform(m.hp.n_layer, m.hp.n_expert);
    std::mt19937_64 rng(4242);
    for (auto& layer : census.counts) {
      for (auto& n : layer) n = rng() % 1000;
    }
    o.census = dir + "/census.json";
    census.write(o.census);
  }
  Group g(o);

  // The plan every process follows: three tiers, and with a census the most popular experts
  // of each layer in VRAM.
  const model::Model m = model::Model::load(model);
  const group::PlacementPlan plan =
      group::PlacementPlan::read(group::placement_path(g.socket_dir()), group::model_sizes(m, 0));
  ASSERT_GT(plan.vram.experts, 0);
  ASSERT_GT(plan.ram.experts, 0);
  ASSERT_GT(plan.file.experts, 0);
  if (c.census) {
    for (int64_t il = 0; il < plan.n_layer; ++il) {
      uint64_t worst_vram = UINT64_MAX, best_other = 0;
      for (int64_t e = 0; e < plan.n_expert; ++e) {
        const uint64_t n = census.counts[static_cast<size_t>(il)][static_cast<size_t>(e)];
        if (plan.at(il, e) == group::Tier::kVram) worst_vram = std::min(worst_vram, n);
        else best_other = std::max(best_other, n);
      }
      EXPECT_GE(worst_vram, best_other) << "layer " << il;
    }
  }

  const Generation gen = generate(g.socket_dir(), prompt, kTokens);
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, ref.ids);
  const std::vector<float> got = read_logits_dump(o.logits_dump, ref.logits.size());
  ASSERT_FALSE(::testing::Test::HasFailure());
  const size_t first_diff = first_bit_difference(got, ref.logits);
  EXPECT_EQ(first_diff, got.size()) << "logit " << first_diff << ": group " << got[first_diff] << " vs reference "
                                    << ref.logits[first_diff];

  // Every stage of every process counted work; the tiers each computed experts.
  const fs::path cli = fs::path(MORAINE_BUILD_DIR) / "coordinator" / "moraine";
  auto [rc, out] = run_command(shell_quote(cli.string()) + " stats --json --socket-dir " + shell_quote(g.socket_dir()));
  ASSERT_EQ(rc, 0) << out;
  const nlohmann::json all = nlohmann::json::parse(out);
  std::set<std::string> seen;
  uint64_t experts_ram = 0, experts_file = 0, file_bytes = 0, experts_vram = 0, experts_taken = 0;
  uint64_t guessed = 0, guessed_right = 0, needed = 0;
  for (const auto& p : all) {
    const std::string inst = p["instance"].get<std::string>();
    seen.insert(inst);
    ASSERT_FALSE(p["stages"].empty()) << p.dump();
    if (p["role"] == "ROLE_SUPERVISOR") continue;   // counts process starts, no tokens
    for (const auto& s : p["stages"]) {
      EXPECT_GT(s["steps"].get<uint64_t>(), 0u) << inst << " " << s.dump();
      EXPECT_GT(s["p50_us"].get<double>(), 0.0) << inst << " " << s.dump();
      if (p["role"] == "ROLE_IO_WORKER") {
        EXPECT_GT(s["bytes_read"].get<uint64_t>(), 0u) << inst << " " << s.dump();
      } else {
        EXPECT_GT(s["tokens"].get<uint64_t>(), 0u) << inst << " " << s.dump();
      }
    }
    const auto& cn = p.value("counters", nlohmann::json::object());
    if (p["role"] == "ROLE_CPU_EXPERT_WORKER") {
      experts_ram += cn.at("experts_ram").get<uint64_t>();
      experts_file += cn.at("experts_file").get<uint64_t>();
      file_bytes += cn.at("file_bytes_fetched").get<uint64_t>();
      guessed += cn.at("prefetch_guessed").get<uint64_t>();
      guessed_right += cn.at("prefetch_guessed_right").get<uint64_t>();
      needed += cn.at("prefetch_needed").get<uint64_t>();
    } else if (p["role"] == "ROLE_GPU_WORKER") {
      experts_vram += cn.at("experts_vram").get<uint64_t>();
      experts_taken += cn.at("experts_device_taken").get<uint64_t>();
      // Per layer: every layer routed the same slots; some of them on the device, never more.
      uint64_t first_slots = 0, vram_slots = 0;
      for (int64_t il = 0; il < plan.n_layer; ++il) {
        char name[40];
        std::snprintf(name, sizeof name, "layer_%03lld_slots", static_cast<long long>(il));
        const uint64_t slots = cn.at(name).get<uint64_t>();
        std::snprintf(name, sizeof name, "layer_%03lld_vram_slots", static_cast<long long>(il));
        const uint64_t on_device = cn.at(name).get<uint64_t>();
        if (il == 0) first_slots = slots;
        EXPECT_EQ(slots, first_slots) << "layer " << il;
        EXPECT_LE(on_device, slots) << "layer " << il;
        vram_slots += on_device;
      }
      EXPECT_GT(first_slots, 0u);
      EXPECT_GT(vram_slots, 0u);
      // Decode steps with cpu-worker experts go out whole (backend.h handoff_*; the CPU backend
      // emulates the device with a thread).
      EXPECT_GT(cn.at("handoff_steps").get<uint64_t>(), 0u);
    } else if (p["role"] == "ROLE_COORDINATOR") {
      EXPECT_EQ(cn.at("placement_vram_experts").get<uint64_t>(), static_cast<uint64_t>(plan.vram.experts));
      EXPECT_EQ(cn.at("placement_ram_experts").get<uint64_t>(), static_cast<uint64_t>(plan.ram.experts));
      EXPECT_EQ(cn.at("placement_file_experts").get<uint64_t>(), static_cast<uint64_t>(plan.file.experts));
    }
  }
  for (const char* inst : {"supervisor", "coordinator", "gpu_worker-0", "cpu_expert_worker-0", "cpu_expert_worker-1",
                           "io_worker-0"}) {
    EXPECT_TRUE(seen.count(inst)) << inst << " missing from " << out;
  }
  EXPECT_GT(experts_vram, 0u);
  EXPECT_GT(experts_ram, 0u);
  EXPECT_GT(experts_file, 0u);
  EXPECT_GT(file_bytes, 0u);
  if (c.device_takes_from == 1) {
    EXPECT_GT(experts_taken, 0u);
  }
  // On the doorbell path the idle pools prefetched their guesses of the next layer's quantized
  // experts (the default router guess) at decode; right ones are a part of both what was guessed
  // and what was asked for. (Float experts go to the reference kernel: nothing to prefetch.)
  if (c.handoff == "doorbell" && c.weights != "f32") {
    EXPECT_GT(guessed, 0u);
  }
  EXPECT_LE(guessed_right, guessed);
  EXPECT_LE(guessed_right, needed);
  // The table form shows the placement.
  std::tie(rc, out) = run_command(shell_quote(cli.string()) + " stats --socket-dir " + shell_quote(g.socket_dir()));
  ASSERT_EQ(rc, 0) << out;
  for (const char* row : {"VRAM", "RAM", "FILE", "io_worker-0"}) EXPECT_NE(out.find(row), std::string::npos) << out;
  g.stop();
  fs::remove_all(dir);
}

// The default budgets (--vram unlimited): every expert is the gpu_worker's, the cpu workers and
// the io_worker compute and read nothing, and the tokens are still the reference's.
TEST(GroupTiersDefault, UnlimitedVramPutsEveryExpertOnTheGpuWorker) {
  const std::string dir = temp_dir("tiers-default");
  const std::string model = convert_golden("qwen3next_odd", "", dir);
  const std::vector<int32_t> prompt = golden_prompt("qwen3next_odd");
  const ReferenceRun ref = reference_greedy(model, prompt, 8);
  GroupOptions o;
  o.model = model;
  o.vram = "unlimited";
  Group g(o);
  const model::Model m = model::Model::load(model);
  const group::PlacementPlan plan =
      group::PlacementPlan::read(group::placement_path(g.socket_dir()), group::model_sizes(m, 0));
  EXPECT_EQ(plan.vram.experts, m.hp.n_layer * m.hp.n_expert);
  const Generation gen = generate(g.socket_dir(), prompt, 8);
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, ref.ids);
  const fs::path cli = fs::path(MORAINE_BUILD_DIR) / "coordinator" / "moraine";
  auto [rc, out] = run_command(shell_quote(cli.string()) + " stats --json --socket-dir " + shell_quote(g.socket_dir()));
  ASSERT_EQ(rc, 0) << out;
  for (const auto& p : nlohmann::json::parse(out)) {
    const auto& cn = p.value("counters", nlohmann::json::object());
    if (p["role"] == "ROLE_GPU_WORKER") {
      EXPECT_GT(cn.at("experts_vram").get<uint64_t>(), 0u);
    }
    if (p["role"] == "ROLE_CPU_EXPERT_WORKER") {
      EXPECT_EQ(cn.at("experts_ram").get<uint64_t>() + cn.at("experts_file").get<uint64_t>(), 0u) << p.dump();
    }
  }
  g.stop();
  fs::remove_all(dir);
}

// The CPUs a process may run on, from /proc (Cpus_allowed_list, e.g. "0" or "1-15").
std::string allowed_cpus(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("Cpus_allowed_list:", 0) == 0) {
      const size_t at = line.find_first_not_of(" \t", line.find(':') + 1);
      return at == std::string::npos ? "" : line.substr(at);
    }
  }
  return "(no status for pid " + std::to_string(pid) + ")";
}

// With a reserved core the control plane (coordinator, gpu_worker, io_worker) is pinned to it, and
// the cpu workers' pool keeps the other cores to itself (unpinned, the gpu_worker's spinning host
// thread landed on pool CPUs: 12G decode on the H200 went from 72.8 to 128.7 tok/s when pinned);
// --no-pin-control-plane leaves the control plane where the supervisor runs.
TEST(GroupTiersDefault, ControlPlaneIsPinnedToTheReservedCores) {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  ASSERT_GE(cores, 2) << "the test needs two CPUs (CI has two)";
  const std::string dir = temp_dir("tiers-pinned");
  const std::string model = convert_golden("qwen3moe_odd", "", dir);
  const std::vector<int32_t> prompt = golden_prompt("qwen3moe_odd");
  const ReferenceRun ref = reference_greedy(model, prompt, 4);
  const std::string pool_cpus = cores == 2 ? "1" : "1-" + std::to_string(cores - 1);
  for (bool pin : {true, false}) {
    GroupOptions o;
    o.model = model;
    o.cpu_workers = 1;
    o.extra_args = {"--reserve-cores", "1"};
    if (!pin) o.extra_args.push_back("--no-pin-control-plane");
    Group g(o);
    const std::string supervisor_cpus = allowed_cpus(g.supervisor_pid());
    for (const char* instance : {group::kCoordinatorInstance, group::kGpuWorkerInstance, group::kIoWorkerInstance}) {
      EXPECT_EQ(allowed_cpus(g.instance_pid(instance)), pin ? "0" : supervisor_cpus) << instance << (pin ? " pinned" : " unpinned");
    }
    EXPECT_EQ(allowed_cpus(g.instance_pid(group::cpu_worker_instance(0))), pool_cpus);
    const Generation gen = generate(g.socket_dir(), prompt, 4);
    ASSERT_TRUE(gen.error.empty()) << gen.error;
    EXPECT_EQ(gen.ids, ref.ids) << (pin ? "pinned" : "unpinned");
    g.stop();
  }
  fs::remove_all(dir);
}

// A VRAM budget below the dense part: the group does not come up, and the coordinator's log
// says why with the numbers.
TEST(GroupTiersDefault, TooSmallVramIsAClearStartError) {
  const std::string dir = temp_dir("tiers-small");
  const std::string model = convert_golden("qwen3moe_odd", "", dir);
  GroupOptions o;
  o.model = model;
  o.vram = "1K";
  o.socket_dir = dir + "/sock";
  fs::create_directories(o.socket_dir);
  fs::permissions(o.socket_dir, fs::perms::owner_all, fs::perm_options::replace);   // the group's: 0700
  EXPECT_THROW(Group g(o), std::runtime_error);
  std::ifstream log(o.socket_dir + "/coordinator.log");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("--vram 1.00 KiB (1024 bytes) is too small for the dense weights"), std::string::npos) << text;
  fs::remove_all(dir);
}

// io_worker-0 killed between two generations: the supervisor restarts it, the cpu workers'
// next fetches reach the new process, and the tokens are the same.
TEST(GroupTiersDefault, KilledIoWorkerIsRestartedAndFetchesResume) {
  const std::string dir = temp_dir("tiers-iokill");
  const std::string model = convert_golden("qwen3moe_odd", "", dir);
  const std::vector<int32_t> prompt = golden_prompt("qwen3moe_odd");
  const ReferenceRun ref = reference_greedy(model, prompt, 6);
  GroupOptions o;
  o.model = model;
  std::tie(o.vram, o.ram) = three_tier_budgets(model, o.cpu_workers);
  Group g(o);
  Generation gen = generate(g.socket_dir(), prompt, 6);
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, ref.ids);
  const pid_t io = g.instance_pid(group::kIoWorkerInstance);
  ASSERT_EQ(kill(io, SIGKILL), 0);
  // Health answers again once the restarted process serves (a new pid).
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  pid_t now = io;
  while (now == io && std::chrono::steady_clock::now() < until) {
    if (group::wait_serving(group::control_address(g.socket_dir(), group::kIoWorkerInstance), std::chrono::seconds(60)).empty()) {
      try {
        now = g.instance_pid(group::kIoWorkerInstance);
      } catch (const std::exception&) {
        // the old socket answered its last; try again
      }
    }
  }
  ASSERT_NE(now, io) << "io_worker-0 was not restarted";
  gen = generate(g.socket_dir(), prompt, 6);
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, ref.ids);
  g.stop();
  fs::remove_all(dir);
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (const char* m : {"qwen3moe_odd", "qwen3moe_k256", "qwen3next_odd", "qwen3next_k256"}) v.push_back({m, "f32", "doorbell"});
  v.push_back({"qwen3moe_k256", "kmix", "doorbell"});
  v.push_back({"qwen3moe_odd", "f32", "doorbell", true});
  v.push_back({"qwen3next_odd", "f32", "zmq", true});
  v.push_back({"qwen3moe_k256", "kmix", "doorbell", false, 1});
  v.push_back({"qwen3next_odd", "f32", "doorbell", true, 1});
  // gpt-oss (sinks, sliding window, biases, YaRN, top-k-then-softmax router, biased clamped
  // SwiGLU): Q4_K experts through the cpu workers' production kernels, the device's own and taken.
  v.push_back({"synth:gpt-oss-tiny", "kmix", "doorbell", false, 1});
  v.push_back({"tiny:glm4moe", "f32", "doorbell", false, 1});
  v.push_back({"tiny:deepseek2:v3", "f32", "doorbell", false, 1});
  v.push_back({"tiny:qwen35moe", "f32", "zmq", true});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Golden, GroupTiers, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name(); });

}  // namespace
}  // namespace moraine::group_test
