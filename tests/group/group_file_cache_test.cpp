// The FILE tier's host cache in the process group (cpu_expert_worker/expert_cache.h): experts left
// in the model file are read by io_worker-0 into the cpu workers' file-cache slots, kept there
// for later tokens, evicted by heat when the slots run out, and read ahead of their layer from
// the next-layer guess (or a prefill step's whole layer). Tokens and logits stay the reference's
// bit for bit; the workers' counters show hits on a repeated request, evictions under a small
// cache, and read-ahead issued and used. Faults: an io_worker killed in the middle of a read is
// restarted and the generation completes; a shard cut short under the group fails the request
// naming the file, the range and the cause.
#include <gtest/gtest.h>

#include <signal.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "common/gguf/gguf.h"
#include "common/model/model.h"
#include "coordinator/control_server.h"
#include "coordinator/group_layout.h"
#include "coordinator/placement.h"
#include "proto/control.grpc.pb.h"
#include "tests/group/group_harness.h"

namespace moraine::group_test {
namespace {

namespace fs = std::filesystem;

// The two cpu workers' counters summed, asked of each over Control (not `moraine stats`, which
// would wait on a stopped io_worker).
std::map<std::string, uint64_t> cpu_counters(const std::string& socket_dir) {
  std::map<std::string, uint64_t> sum;
  for (int w = 0; w < 2; ++w) {
    auto stub = control::Control::NewStub(grpc::CreateChannel(group::control_address(socket_dir, group::cpu_worker_instance(w)),
                                                              grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    control::StatsReply reply;
    const grpc::Status st = stub->Stats(&ctx, {}, &reply);
    if (!st.ok()) throw std::runtime_error(group::cpu_worker_instance(w) + " Stats: " + st.error_message());
    for (const auto& [k, v] : reply.counters()) sum[k] += v;
  }
  return sum;
}

struct Budgets {
  std::string ram, file_cache;
  group::PlacementPlan plan;
};

// No expert in VRAM ("dense"), and either (hold_most) no RAM tier and a file cache one slot short
// of every expert a worker owns (a cache that holds the whole FILE tier would be a budget that
// fits the model: nothing would be FILE), or RAM for about a quarter of the experts and a file
// cache of only the staging slots (file cache 0: it must evict). Found with the planner itself;
// the group's plan is the same.
Budgets file_budgets(const std::string& model_path, int n_cpu_workers, bool hold_most) {
  const model::Model m = model::Model::load(model_path);
  group::PlacementInput in;
  in.sizes = group::model_sizes(m, group::planned_context(m, 0));
  in.n_cpu_workers = n_cpu_workers;
  in.vram_budget = in.sizes.dense_bytes + in.sizes.kv_bytes;
  const group::ModelSizes& s = in.sizes;
  const uint64_t slot = *std::max_element(s.expert_slot_bytes.begin(), s.expert_slot_bytes.end());
  const int64_t all = s.n_layer * s.n_expert;
  const int64_t per_worker = (all + n_cpu_workers - 1) / n_cpu_workers;
  if (hold_most) {
    in.file_cache_budget = group::PlacementPlan::cache_region_bytes(n_cpu_workers, per_worker - 1, slot);
    in.ram_budget = in.file_cache_budget + slot / 2;
  } else {
    in.file_cache_budget = 0;
    in.ram_budget = group::PlacementPlan::cache_region_bytes(n_cpu_workers, s.n_expert_used, slot) +
                    static_cast<uint64_t>(all / 4) * slot + slot / 2;
  }
  Budgets b{std::to_string(in.ram_budget), std::to_string(in.file_cache_budget), group::plan_placement(in)};
  return b;
}

GroupOptions file_cache_group(const std::string& model, const Budgets& b, const std::string& handoff) {
  GroupOptions o;
  o.model = model;
  o.handoff = handoff;
  o.vram = "dense";
  o.ram = b.ram;
  o.extra_args = {"--file-cache", b.file_cache};
  return o;
}

// The most FILE-tier experts one worker owns over all layers.
int64_t most_file_experts_owned(const group::PlacementPlan& p) {
  std::vector<int64_t> per(static_cast<size_t>(p.n_cpu_workers), 0);
  for (int64_t il = 0; il < p.n_layer; ++il) {
    for (int32_t e : p.experts_in(il, group::Tier::kFile)) ++per[static_cast<size_t>(e % p.n_cpu_workers)];
  }
  return *std::max_element(per.begin(), per.end());
}

// A cache that holds all but one of each worker's FILE-tier experts: the first request reads
// what it uses (misses and read-ahead), the second identical one finds them: it hits, and misses
// fewer than the first did.
TEST(GroupFileCache, ARepeatedRequestHitsInTheCache) {
  constexpr int kTokens = 8;
  const auto [dir, model, prompt, ref] = golden_case("qwen3moe_odd", "f32", "filecache-hits", kTokens);
  const Budgets b = file_budgets(model, 2, true);
  ASSERT_GT(b.plan.file.experts, 0);
  ASSERT_GE(b.plan.cache_slots, most_file_experts_owned(b.plan) - 1) << b.plan.table();
  GroupOptions o = file_cache_group(model, b, "doorbell");
  o.logits_dump = dir + "/logits.f32";
  Group g(o);
  const group::PlacementPlan plan =
      group::PlacementPlan::read(group::placement_path(g.socket_dir()), group::model_sizes(model::Model::load(model), 0));
  EXPECT_EQ(plan.cache_slots, b.plan.cache_slots);
  EXPECT_EQ(plan.tiers, b.plan.tiers);

  Generation gen = generate(g.socket_dir(), prompt, kTokens);
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, ref.ids);
  const std::vector<float> got = read_logits_dump(o.logits_dump, ref.logits.size());
  EXPECT_EQ(first_bit_difference(got, ref.logits), got.size());
  const auto first = cpu_counters(g.socket_dir());
  EXPECT_GT(first.at("cache_misses") + first.at("read_ahead_experts"), 0u);
  EXPECT_GT(first.at("file_bytes_fetched"), 0u);
  EXPECT_EQ(first.at("cache_slots"), static_cast<uint64_t>(2 * plan.cache_slots));
  EXPECT_EQ(first.at("cache_stale"), 0u);
  // The prefill step's rows route to about every expert: the next layer's FILE experts were
  // read ahead, and its layer used some of them.
  EXPECT_GT(first.at("read_ahead_requests"), 0u);
  EXPECT_GT(first.at("read_ahead_used"), 0u);
  EXPECT_LE(first.at("read_ahead_used"), first.at("read_ahead_experts"));
  EXPECT_EQ(first.at("experts_file"), first.at("cache_hits") + first.at("cache_misses"));

  gen = generate(g.socket_dir(), prompt, kTokens);
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, ref.ids);
  const auto second = cpu_counters(g.socket_dir());
  EXPECT_GT(second.at("cache_hits"), first.at("cache_hits"));
  EXPECT_LT(second.at("cache_misses") - first.at("cache_misses"), first.at("cache_misses"));
  EXPECT_GT(second.at("cache_filled"), 0u);
  g.stop();
  fs::remove_all(dir);
}

// Low-RAM mode with the defaults: --ram half the experts' bytes (this model has 24 experts: a
// smaller share cannot hold the staging slots) and nothing else (the file cache takes its default share): the group plans RAM tier + cache + staging, prints the plan's
// disk line, and decodes the reference's tokens.
TEST(GroupFileCache, LowRamWithTheDefaultsPlansTheCacheAndDecodes) {
  constexpr int kTokens = 8;
  const auto [dir, model, prompt, ref] = golden_case("qwen3moe_odd", "f32", "filecache-lowram", kTokens);
  const model::Model m = model::Model::load(model);
  const group::ModelSizes s = group::model_sizes(m, group::planned_context(m, 0));
  uint64_t experts = 0;
  for (int64_t il = 0; il < s.n_layer; ++il) experts += s.expert_slot_bytes[static_cast<size_t>(il)] * static_cast<uint64_t>(s.n_expert);
  GroupOptions o;
  o.model = model;
  o.ram = std::to_string(experts / 2);
  Group g(o);
  const group::PlacementPlan plan = group::PlacementPlan::read(group::placement_path(g.socket_dir()), s);
  EXPECT_GT(plan.ram.experts, 0) << plan.table();
  EXPECT_GT(plan.file.experts, 2 * plan.ram.experts) << plan.table();
  EXPECT_GE(plan.cache_slots, plan.staging_slots) << plan.table();
  EXPECT_GT(plan.staging_slots, 0) << plan.table();
  const Generation gen = generate(g.socket_dir(), prompt, kTokens);
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, ref.ids);
  EXPECT_GT(cpu_counters(g.socket_dir()).at("cache_misses"), 0u);
  std::ifstream log(g.socket_dir() + "/" + group::kCoordinatorInstance + ".log");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  const size_t at = text.find("disk reads: ");
  ASSERT_NE(at, std::string::npos) << text;
  const double share = std::stod(text.substr(at + 12));
  EXPECT_GT(share, 30.0) << text.substr(at, 300);   // most experts are FILE-tier, few of them kept
  EXPECT_LT(share, 100.0) << text.substr(at, 300);
  EXPECT_NE(text.find("tok/s (disk rate", at), std::string::npos) << text.substr(at, 300);
  g.stop();
  fs::remove_all(dir);
}

struct SmallCase {
  std::string model, weights, handoff;
  std::string name() const { return param_name(model) + "_" + weights + "_" + handoff; }
};
void PrintTo(const SmallCase& c, std::ostream* os) { *os << c.name(); }

class GroupFileCacheSmall : public ::testing::TestWithParam<SmallCase> {};

// Only the staging slots: experts are evicted between (and within) tokens, read again, and the
// tokens and logits are still the reference's.
TEST_P(GroupFileCacheSmall, EvictsAndMatchesTheReference) {
  const SmallCase& c = GetParam();
  constexpr int kTokens = 10;
  const auto [dir, model, prompt, ref] = golden_case(c.model, c.weights, "filecache-small", kTokens);
  const Budgets b = file_budgets(model, 2, false);
  ASSERT_GT(b.plan.file.experts, 0);
  ASSERT_LT(b.plan.cache_slots, most_file_experts_owned(b.plan)) << b.plan.table();
  GroupOptions o = file_cache_group(model, b, c.handoff);
  o.logits_dump = dir + "/logits.f32";
  Group g(o);
  const Generation gen = generate(g.socket_dir(), prompt, kTokens);
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, ref.ids);
  const std::vector<float> got = read_logits_dump(o.logits_dump, ref.logits.size());
  const size_t diff = first_bit_difference(got, ref.logits);
  EXPECT_EQ(diff, got.size()) << "logit " << diff;
  const auto n = cpu_counters(g.socket_dir());
  EXPECT_GT(n.at("cache_evictions"), 0u);
  EXPECT_GT(n.at("cache_misses"), 0u);
  EXPECT_EQ(n.at("cache_stale"), 0u);
  EXPECT_EQ(n.at("experts_file"), n.at("cache_hits") + n.at("cache_misses"));
  EXPECT_LE(n.at("cache_filled"), n.at("cache_slots"));
  if (c.handoff == "doorbell") {
    // Decode: the router guess of the next layer's experts was read ahead.
    EXPECT_GT(n.at("read_ahead_requests"), 0u);
    EXPECT_LE(n.at("read_ahead_used"), n.at("read_ahead_experts"));
  } else {
    EXPECT_EQ(n.at("read_ahead_requests"), 0u) << "the zmq hand-off has no request bell to read ahead after";
  }
  g.stop();
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Golden, GroupFileCacheSmall,
                         ::testing::Values(SmallCase{"qwen3moe_odd", "f32", "doorbell"}, SmallCase{"qwen3moe_k256", "kmix", "doorbell"},
                                           SmallCase{"qwen3next_odd", "f32", "zmq"}),
                         [](const ::testing::TestParamInfo<SmallCase>& i) { return i.param.name(); });

// Long steps staging the cached FILE tier on the "device" (gpu_worker/file_stage.h) through the
// CPU backend's emulation of the CUDA staging path (--cpu-backend-stages: staged experts computed
// with the reference kernel from copies taken when staged, as the workers compute F32 experts): a
// 72-token prompt's 64-row step has the owners fill the cache with each layer's FILE experts
// (kFillRequest), stages them from their slots, and the tokens and logits stay the reference's bit
// for bit. With --fault-tear-file-copies=1 one copy per window is reported torn: it leaves the
// device and its owner recomputes it (kRedoRequest), still bit for bit.
struct StageCase {
  std::string model;
  int tear = 0;
  bool small = false;   // the staging slots' cache (file_budgets' second kind): the workers read what it lacks
  std::string name() const { return param_name(model) + (small ? "_small" : "") + (tear > 0 ? "_torn" : ""); }
};
void PrintTo(const StageCase& c, std::ostream* os) { *os << c.name(); }

class GroupFileCacheStage : public ::testing::TestWithParam<StageCase> {};

TEST_P(GroupFileCacheStage, StagedFromTheCacheMatchesTheReference) {
  const StageCase& c = GetParam();
  constexpr int kTokens = 6;
  const auto [dir, model, golden, unused] = golden_case(c.model, "f32", "filecache-stage", 1);
  std::vector<int32_t> prompt;
  while (prompt.size() < 72) prompt.push_back(golden[prompt.size() % golden.size()]);
  const ReferenceRun ref = reference_greedy(model, prompt, kTokens);
  const Budgets b = file_budgets(model, 2, !c.small);
  ASSERT_GT(b.plan.file.experts, 0) << b.plan.table();
  GroupOptions o = file_cache_group(model, b, "doorbell");
  o.logits_dump = dir + "/logits.f32";
  o.extra_args.insert(o.extra_args.end(), {"--gpu-worker-arg=--cpu-backend-stages", "--gpu-worker-arg=--prefill-stage-min-rows=64",
                                           "--gpu-worker-arg=--fault-tear-file-copies=" + std::to_string(c.tear)});
  Group g(o);
  const Generation gen = generate(g.socket_dir(), prompt, kTokens);
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, ref.ids);
  const std::vector<float> got = read_logits_dump(o.logits_dump, ref.logits.size());
  const size_t diff = first_bit_difference(got, ref.logits);
  EXPECT_EQ(diff, got.size()) << "logit " << diff;
  const std::string gpu = group::kGpuWorkerInstance;
  const uint64_t staged_file = instance_counter(g.socket_dir(), gpu, "experts_device_staged_file");
  const uint64_t torn = instance_counter(g.socket_dir(), gpu, "file_stage_torn");
  EXPECT_GT(staged_file, 0u) << "no FILE-tier expert was staged from the cache";
  EXPECT_GT(instance_counter(g.socket_dir(), gpu, "file_fill_requests"), 0u);
  const uint64_t uncached = instance_counter(g.socket_dir(), gpu, "file_stage_uncached");
  if (!c.small) {
    EXPECT_EQ(uncached, 0u) << "the cache holds a layer's FILE experts";
  }
  const auto n = cpu_counters(g.socket_dir());
  std::printf("[ %s ] %llu FILE experts staged from the cache, %llu torn, %llu not cached; the workers computed %llu FILE experts\n",
              c.name().c_str(), static_cast<unsigned long long>(staged_file), static_cast<unsigned long long>(torn),
              static_cast<unsigned long long>(uncached), static_cast<unsigned long long>(n.at("experts_file")));
  EXPECT_GT(n.at("fill_requests"), 0u);
  EXPECT_GT(n.at("fill_device_experts"), 0u);
  if (c.tear > 0) {
    EXPECT_GT(torn, 0u);
    EXPECT_LT(torn, staged_file);
  } else {
    EXPECT_EQ(torn, 0u) << "a slot the fill pinned was refilled under a copy";
  }
  g.stop();
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Golden, GroupFileCacheStage,
                         ::testing::Values(StageCase{"qwen3moe_odd"}, StageCase{"qwen3moe_odd", 1}, StageCase{"qwen3next_odd", 1},
                                           StageCase{"qwen3moe_odd", 0, true}, StageCase{"qwen3moe_odd", 1, true},
                                           StageCase{"synth:qwen35moe-tiny", 0, true}, StageCase{"synth:qwen35moe-tiny", 1, true}),
                         [](const ::testing::TestParamInfo<StageCase>& i) { return param_name(i.param.name()); });

// io_worker-0 killed in the middle of a read: a first generation connects the workers to it,
// then it is stopped (SIGSTOP), so the next read a cpu worker sends lands in its socket unread;
// once the worker has sent it, the process is killed. The request is lost with it: the worker's
// wait times out (10 s), the request goes again to the restarted process, and the generation
// completes with the reference's tokens.
TEST(GroupFileCache, IoWorkerKilledMidReadIsRestartedAndTheStepCompletes) {
  constexpr int kTokens = 6;
  const GoldenCase gc = golden_case("qwen3moe_odd", "f32", "filecache-iokill", kTokens);
  const Budgets b = file_budgets(gc.model, 2, false);
  Group g(file_cache_group(gc.model, b, "doorbell"));
  Generation gen = generate(g.socket_dir(), gc.prompt, kTokens);
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  const uint64_t before = cpu_counters(g.socket_dir()).at("file_fetches");
  const pid_t io = g.instance_pid(group::kIoWorkerInstance);
  ASSERT_EQ(kill(io, SIGSTOP), 0);
  const auto t0 = std::chrono::steady_clock::now();
  // A prompt of its own (the first one's prefix is cached): its prefill misses in the small cache.
  std::vector<int32_t> prompt(gc.prompt.rbegin(), gc.prompt.rend());
  const ReferenceRun ref = reference_greedy(gc.model, prompt, kTokens);
  std::thread client([&] { gen = generate(g.socket_dir(), prompt, kTokens); });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  uint64_t sent = before;
  while ((sent = cpu_counters(g.socket_dir()).at("file_fetches")) == before && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_GT(sent, before) << "no read was sent to the stopped io_worker";
  ASSERT_EQ(kill(io, SIGKILL), 0);
  client.join();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10)) << "the lost request was not waited for";
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, ref.ids);
  EXPECT_NE(g.instance_pid(group::kIoWorkerInstance), io) << "io_worker-0 was not restarted";
  EXPECT_EQ(cpu_counters(g.socket_dir()).at("cache_stale"), 0u);
  g.stop();
  fs::remove_all(gc.dir);
}

// A copy of the GGUF at `src` whose last tensor is `last` (the rest in file order), so that
// cutting the file short takes bytes of that tensor only: nothing but the io_worker reads a
// FILE-tier expert's bytes, while every process maps the file and would fault on a dense page
// past the end.
void rewrite_with_tensor_last(const std::string& src, const std::string& dst, const std::string& last) {
  const gguf::GgufFile f = gguf::GgufFile::open(src);
  gguf::GgufWriter w;
  for (const auto& [key, value] : f.metadata()) w.set(key, value);
  const gguf::TensorInfo* moved = f.find_tensor(last);
  if (moved == nullptr) throw std::runtime_error(src + " has no tensor " + last);
  for (const gguf::TensorInfo& t : f.tensors()) {
    if (t.name != last) w.add_tensor(t.name, t.shape, t.type, t.data, t.n_bytes);
  }
  w.add_tensor(moved->name, moved->shape, moved->type, moved->data, moved->n_bytes);
  w.write(dst);
}

// The model file cut short under a running group (the FILE-tier experts of the last layer's down
// projection past the cut): the request fails, and its error names the file, the range read and
// the cause (the io_worker's), carried from the cpu worker through the gpu_worker's step.
TEST(GroupFileCache, AShardCutShortFailsTheRequestNamingFileRangeAndCause) {
  const std::string dir = temp_dir("filecache-cut");
  const std::string converted = convert_golden("qwen3moe_odd", "", dir);
  const model::Model probe = model::Model::load(converted);
  const int64_t L = probe.hp.n_layer, E = probe.hp.n_expert;
  const std::string last = "blk." + std::to_string(L - 1) + ".ffn_down_exps.weight";
  const std::string model = dir + "/cut.gguf";
  rewrite_with_tensor_last(converted, model, last);
  // High ids unpopular: they are the FILE tier, so the cut (the upper half of the tensor) holds
  // FILE-tier experts only.
  group::Census census = group::Census::uniform(L, E);
  for (auto& layer : census.counts) {
    for (int64_t e = 0; e < E; ++e) layer[static_cast<size_t>(e)] = static_cast<uint64_t>(E - e) * 10;
  }
  const std::string census_path = dir + "/census.json";
  census.write(census_path);
  const model::Model m = model::Model::load(model);
  const gguf::TensorInfo& t = *m.file.find_tensor(last);
  const uint64_t cut = m.file.data_offset(t.shard) + t.offset + t.n_bytes / 2;
  ASSERT_EQ(m.file.paths().size(), 1u);
  Budgets b = file_budgets(model, 2, false);
  {
    group::PlacementInput in;
    in.sizes = group::model_sizes(m, group::planned_context(m, 0));
    in.n_cpu_workers = 2;
    in.vram_budget = in.sizes.dense_bytes + in.sizes.kv_bytes;
    in.ram_budget = std::stoull(b.ram);
    in.file_cache_budget = 0;
    in.census = census;
    b.plan = group::plan_placement(in);
  }
  std::vector<std::string> offsets;   // the FILE-tier down ranges the cut takes
  for (int64_t e = 0; e < E; ++e) {
    const group::FileRange r = group::expert_file_range(m, L - 1, e, 2);
    if (r.offset + r.bytes <= cut) continue;
    ASSERT_EQ(b.plan.at(L - 1, e), group::Tier::kFile) << "expert " << e << " of the cut is not FILE-tier: " << b.plan.table();
    offsets.push_back("read of [" + std::to_string(r.offset) + ", +" + std::to_string(r.bytes) + ")");
  }
  ASSERT_FALSE(offsets.empty());
  GroupOptions o = file_cache_group(model, b, "doorbell");
  o.census = census_path;
  Group g(o);
  ASSERT_EQ(::truncate(model.c_str(), static_cast<off_t>(cut)), 0);
  // Every token of a whole prompt's prefill reaches the last layer: some reach the cut experts.
  std::vector<int32_t> prompt = golden_prompt("qwen3moe_odd");
  const Generation gen = generate(g.socket_dir(), prompt, 4);
  ASSERT_FALSE(gen.error.empty()) << "the request read past the end of a cut file and succeeded";
  EXPECT_NE(gen.error.find(model), std::string::npos) << gen.error;
  EXPECT_NE(gen.error.find("hit the end of the file"), std::string::npos) << gen.error;
  EXPECT_NE(gen.error.find("truncated since?"), std::string::npos) << gen.error;
  bool named = false;
  for (const std::string& r : offsets) named |= gen.error.find(r) != std::string::npos;
  EXPECT_TRUE(named) << gen.error;
  EXPECT_NE(gen.error.find("cpu_expert_worker-"), std::string::npos) << gen.error;
  g.stop();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moraine::group_test
