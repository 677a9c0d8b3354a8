// Long steps on --backend cuda with FILE-tier experts (issue 29, gpu_worker/file_stage.h): a
// 72-token prompt's first 64-row step stages the FILE tier's experts from the cpu workers' file
// cache on the device (the workers first read the layer's into the cache: a fill request), beside
// the RAM tier's, and the group gives the very tokens and logits, bit for bit, of the same group
// with every expert in RAM (which stages them all from the arena): the same experts go through
// the same GEMM in the same order, and the decode steps after it compute them on the cpu workers
// from their cache slots as from RAM slots. The gpu_worker's counters show experts staged from
// the cache, none of them found torn or missing (these caches hold every layer's FILE experts a
// worker owns, pinned by the fill), and the workers' show the fill requests. Skips without a
// CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "common/model/model.h"
#include "coordinator/group_layout.h"
#include "coordinator/placement.h"
#include "kernels/cuda/device.h"
#include "tests/group/group_harness.h"

namespace moraine::group_test {
namespace {

namespace fs = std::filesystem;

struct Case {
  std::string model, weights;
  bool small_cache;   // true: RAM for a quarter of the experts and a cache of the staging slots only
  std::string name() const { return param_name(model) + "_" + weights + (small_cache ? "_small_cache" : "_large_cache"); }
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name(); }

std::vector<int32_t> repeated(const std::vector<int32_t>& prompt, int n) {
  std::vector<int32_t> out;
  while (static_cast<int>(out.size()) < n) out.push_back(prompt[out.size() % prompt.size()]);
  return out;
}

// --ram and --file-cache for 2 cpu workers: no RAM tier and a cache one slot short of every
// expert a worker owns (large), or RAM for a quarter of the experts and the file cache at the
// staging slots (small: the planner's minimum, --file-cache 0).
std::pair<std::string, std::string> file_budgets(const std::string& path, bool small) {
  const model::Model m = model::Model::load(path);
  const group::ModelSizes s = group::model_sizes(m, group::planned_context(m, 0));
  const uint64_t slot = *std::max_element(s.expert_slot_bytes.begin(), s.expert_slot_bytes.end());
  const int64_t all = s.n_layer * s.n_expert, per_worker = (all + 1) / 2;
  if (!small) {
    const uint64_t cache = group::PlacementPlan::cache_region_bytes(2, per_worker - 1, slot);
    return {std::to_string(cache + slot / 2), std::to_string(cache)};
  }
  const uint64_t ram = group::PlacementPlan::cache_region_bytes(2, s.n_expert_used, slot) +
                       static_cast<uint64_t>(all / 4) * slot + slot / 2;
  return {std::to_string(ram), "0"};
}

struct GroupRun {
  Generation gen;
  std::vector<float> logits;
  uint64_t staged = 0, staged_file = 0, uncached = 0, torn = 0, fills = 0, worker_fills = 0;
  group::PlacementPlan plan;
};

GroupRun run_group(const std::string& model, const std::vector<int32_t>& prompt, int n, const std::string& dump, const std::string& ram,
              const std::string& file_cache) {
  GroupOptions o;
  o.model = model;
  o.backend = "cuda";   // vram "dense": no expert in VRAM, so every one a long step uses is staged
  o.logits_dump = dump;
  o.extra_args = {"--gpu-worker-arg=--prefill-stage-min-rows=64"};
  if (!ram.empty()) {
    o.ram = ram;
    o.extra_args.insert(o.extra_args.end(), {"--file-cache", file_cache});
  }
  Group g(o);
  GroupRun r;
  r.plan = group::PlacementPlan::read(group::placement_path(g.socket_dir()), group::model_sizes(model::Model::load(model), 0));
  r.gen = generate(g.socket_dir(), prompt, n);
  const std::string gpu = group::kGpuWorkerInstance;
  r.staged = instance_counter(g.socket_dir(), gpu, "experts_device_staged");
  r.staged_file = instance_counter(g.socket_dir(), gpu, "experts_device_staged_file");
  r.uncached = instance_counter(g.socket_dir(), gpu, "file_stage_uncached");
  r.torn = instance_counter(g.socket_dir(), gpu, "file_stage_torn");
  r.fills = instance_counter(g.socket_dir(), gpu, "file_fill_requests");
  for (int w = 0; w < 2; ++w) r.worker_fills += instance_counter(g.socket_dir(), group::cpu_worker_instance(w), "fill_requests");
  g.stop();
  return r;
}

class GroupCudaFileStage : public ::testing::TestWithParam<Case> {};

TEST_P(GroupCudaFileStage, FileTierExpertsStagedFromTheCacheGiveTheAllRamBits) {
  std::string why;
  if (!cuda::device_available(&why)) GTEST_SKIP() << "no CUDA device: " << why;
  const Case& c = GetParam();
  constexpr int kTokens = 12;
  const auto [dir, model, golden_prompt, unused] = golden_case(c.model, c.weights, "fstage", 1, model::KvType::F16);
  const std::vector<int32_t> prompt = repeated(golden_prompt, 72);

  const GroupRun ram = run_group(model, prompt, kTokens, dir + "/ram.f32", "", "");
  ASSERT_TRUE(ram.gen.error.empty()) << ram.gen.error;
  EXPECT_EQ(ram.plan.file.experts, 0) << ram.plan.table();
  EXPECT_GT(ram.staged, 0u) << "the all-RAM group staged nothing: the 64-row step is not a staging step";

  const auto [ram_budget, file_cache] = file_budgets(model, c.small_cache);
  const GroupRun file = run_group(model, prompt, kTokens, dir + "/file.f32", ram_budget, file_cache);
  ASSERT_TRUE(file.gen.error.empty()) << file.gen.error;
  ASSERT_GT(file.plan.file.experts, 0) << file.plan.table();
  EXPECT_EQ(file.plan.vram.experts, 0) << file.plan.table();
  if (c.small_cache) {
    EXPECT_GT(file.plan.ram.experts, 0) << file.plan.table();
  }
  std::printf("[ %s ] %lld FILE / %lld RAM experts, cache %lld slots a worker; staged %llu RAM + %llu FILE, %llu not cached, "
              "%llu torn, %llu fill rounds (%llu worker fills)\n",
              c.name().c_str(), static_cast<long long>(file.plan.file.experts), static_cast<long long>(file.plan.ram.experts),
              static_cast<long long>(file.plan.cache_slots), static_cast<unsigned long long>(file.staged),
              static_cast<unsigned long long>(file.staged_file), static_cast<unsigned long long>(file.uncached),
              static_cast<unsigned long long>(file.torn), static_cast<unsigned long long>(file.fills),
              static_cast<unsigned long long>(file.worker_fills));
  EXPECT_GT(file.staged_file, 0u) << "no FILE-tier expert was staged from the cache";
  EXPECT_GT(file.fills, 0u);
  EXPECT_GT(file.worker_fills, 0u);
  EXPECT_EQ(file.uncached, 0u) << "the fill left FILE experts out of a cache that holds a layer's";
  EXPECT_EQ(file.torn, 0u) << "a slot the fill pinned was refilled under the device's copy";
  // Each staged step: every expert with rows, RAM or FILE, on the device, as in the all-RAM group.
  EXPECT_EQ(file.staged + file.staged_file, ram.staged);

  EXPECT_EQ(file.gen.ids, ram.gen.ids);
  const size_t n = ram.gen.ids.size() * static_cast<size_t>(model::Model::load(model).hp.n_vocab);
  const std::vector<float> a = read_logits_dump(dir + "/ram.f32", n), b = read_logits_dump(dir + "/file.f32", n);
  EXPECT_EQ(first_bit_difference(a, b), a.size()) << "the FILE group's logits differ from the all-RAM group's";
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Golden, GroupCudaFileStage,
                         ::testing::Values(Case{"qwen3moe_k256", "kmix", false}, Case{"qwen3moe_k256", "kmix", true},
                                           Case{"qwen3next_k256", "kmix", false}, Case{"qwen3next_k256", "kmix", true}),
                         [](const ::testing::TestParamInfo<Case>& i) { return param_name(i.param.name()); });

}  // namespace
}  // namespace moraine::group_test
