// The planner's disk line (coordinator/disk_estimate.h): the share of a decode token's
// routed-expert reads expected from the model file, the bytes per token and the tok/s bound at a
// disk rate. Checked against closed forms worked out here, not against the estimator's own
// arithmetic: 0 when every expert fits in RAM; uniform routing with only the FILE tier and its
// cache holding experts: 1 - W (C - S) / (L E); a census case worked by hand. Then the coordinator
// binary as a user runs it (--print-plan on a synth model at --ram far below the experts' bytes)
// and its refusal of a --ram that cannot hold the staging slots, naming the numbers.
#include <gtest/gtest.h>

#include <cstdio>
#include <regex>
#include <string>

#include "common/model/model.h"
#include "coordinator/disk_estimate.h"
#include "coordinator/group_layout.h"
#include "coordinator/placement.h"
#include "tests/group/group_harness.h"
#include "tests/support/shell.h"

namespace moraine::group {
namespace {

ModelSizes even_sizes(int64_t L, int64_t E, int64_t k, uint64_t expert_bytes) {
  ModelSizes s;
  s.n_layer = L;
  s.n_expert = E;
  s.n_expert_used = k;
  s.dense_bytes = 1 << 20;
  s.kv_bytes = 1 << 16;
  s.context = 1024;
  s.expert_bytes.assign(static_cast<size_t>(L), expert_bytes);
  s.expert_slot_bytes.assign(static_cast<size_t>(L), arena_align(expert_bytes));
  return s;
}

TEST(DiskEstimate, NothingFromTheFileWhenEveryExpertFitsInRam) {
  PlacementInput in;
  in.sizes = even_sizes(6, 16, 4, 100'000);
  in.n_cpu_workers = 2;
  in.vram_budget = in.sizes.dense_bytes + in.sizes.kv_bytes;
  in.ram_budget = 6 * 16 * arena_align(100'000);   // exactly every expert
  const PlacementPlan p = plan_placement(in);
  ASSERT_EQ(p.file.experts, 0) << p.table();
  const DiskEstimate d = estimate_disk_reads(p, in.sizes, {});
  EXPECT_EQ(d.routed_reads, 6.0 * 4);
  EXPECT_EQ(d.file_reads, 0.0);
  EXPECT_EQ(d.fraction(), 0.0);
  EXPECT_EQ(d.disk_bytes, 0.0);
  EXPECT_NE(disk_line(d, {1e9, "given"}).find("disk reads: 0.00% "), std::string::npos) << disk_line(d, {1e9, "given"});
}

// No RAM tier: every expert is FILE-tier, each worker owns L E / W of them and keeps C - S in its
// cache; under uniform routing each is used by a token with k / E.
TEST(DiskEstimate, UniformRoutingOverTheFileTierAndItsCache) {
  for (const auto& [L, E, k, W, slots] : std::vector<std::tuple<int64_t, int64_t, int64_t, int, int64_t>>{
           {6, 16, 4, 2, 10}, {4, 8, 2, 2, 2}, {5, 12, 3, 3, 7}, {3, 64, 8, 1, 40}}) {
    PlacementInput in;
    in.sizes = even_sizes(L, E, k, 50'000);
    in.n_cpu_workers = W;
    in.vram_budget = in.sizes.dense_bytes + in.sizes.kv_bytes;
    const uint64_t slot = arena_align(50'000);
    in.file_cache_budget = PlacementPlan::cache_region_bytes(W, slots, slot);
    in.ram_budget = in.file_cache_budget + slot / 2;   // no room for a RAM-tier expert beside the cache
    const PlacementPlan p = plan_placement(in);
    ASSERT_EQ(p.ram.experts, 0) << p.table();
    ASSERT_EQ(p.file.experts, L * E) << p.table();
    ASSERT_EQ(p.cache_slots, slots) << p.table();
    const DiskEstimate d = estimate_disk_reads(p, in.sizes, {});
    const double kept = static_cast<double>(W) * static_cast<double>(std::max<int64_t>(0, slots - p.staging_slots));
    const double expected = 1.0 - kept / static_cast<double>(L * E);
    EXPECT_NEAR(d.fraction(), expected, 1e-12) << "L " << L << " E " << E << " W " << W << " C " << slots << " S " << p.staging_slots;
    EXPECT_NEAR(d.file_reads, static_cast<double>(L * k), 1e-9);
    EXPECT_NEAR(d.disk_bytes, expected * static_cast<double>(L * k) * 50'000.0, 1e-6);
    EXPECT_FALSE(d.from_census);
  }
}

// One layer of 4 experts, top-2, one worker, counts 6 2 1 1: uses per token min(1, 2 * 6/10) = 1,
// 0.4, 0.2, 0.2. Three cache slots, two of them staging: the hottest (expert 0) is kept.
TEST(DiskEstimate, CensusRoutingKeepsTheHottestInTheCache) {
  PlacementPlan p;
  p.n_layer = 1;
  p.n_expert = 4;
  p.n_cpu_workers = 1;
  p.staging_slots = 2;
  p.cache_slots = 3;
  p.tiers.assign(4, Tier::kFile);
  Census c = Census::uniform(1, 4);
  c.counts[0] = {6, 2, 1, 1};
  const ModelSizes s = even_sizes(1, 4, 2, 1000);
  DiskEstimate d = estimate_disk_reads(p, s, c);
  EXPECT_TRUE(d.from_census);
  EXPECT_NEAR(d.file_reads, 1.8, 1e-12);
  EXPECT_NEAR(d.cache_hits, 1.0, 1e-12);
  EXPECT_NEAR(d.fraction(), 0.4, 1e-12);
  EXPECT_NEAR(d.disk_bytes, 800.0, 1e-9);
  // Expert 0 in RAM instead: the cache keeps the next hottest (expert 1).
  p.tiers[0] = Tier::kRam;
  d = estimate_disk_reads(p, s, c);
  EXPECT_NEAR(d.file_reads, 0.8, 1e-12);
  EXPECT_NEAR(d.cache_hits, 0.4, 1e-12);
  EXPECT_NEAR(d.fraction(), 0.2, 1e-12);
  // The line: the share, the bytes and the bound at the rate given (1e6 B/s / 400 B = 2500 tok/s).
  const std::string line = disk_line(d, {1e6, "given: test"});
  EXPECT_NE(line.find("disk reads: 20.00% of routed-expert reads per token from the file (census routing"), std::string::npos) << line;
  EXPECT_NE(line.find("at most 2500.00 tok/s (disk rate given: test)"), std::string::npos) << line;
  EXPECT_NE(disk_line(d, {std::nullopt, "not measured: why"}).find("disk bound n/a (disk rate not measured: why; give --disk-rate)"),
            std::string::npos);
}

TEST(DiskEstimate, ProbeReadsTheFileWithODirectOrSaysWhyNot) {
  const std::string dir = group_test::temp_dir("disk-probe");
  const std::string path = dir + "/f.bin";
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::vector<char> block(1 << 20, 7);
    for (int i = 0; i < 24; ++i) ASSERT_EQ(std::fwrite(block.data(), 1, block.size(), f), block.size());
    std::fclose(f);
  }
  const DiskRate r = measure_disk_rate(path, 0.1);
  if (r.bytes_per_s) {
    EXPECT_GT(*r.bytes_per_s, 1e6) << r.how;   // any disk or page-less file system reads 1 MB/s
    EXPECT_EQ(r.how.rfind("measured: O_DIRECT", 0), 0u) << r.how;
  } else {
    EXPECT_NE(r.how.find("O_DIRECT"), std::string::npos) << r.how;   // tmpfs: the open is refused, and said so
  }
  const DiskRate missing = measure_disk_rate(dir + "/none.bin");
  EXPECT_FALSE(missing.bytes_per_s);
  EXPECT_NE(missing.how.find("none.bin"), std::string::npos) << missing.how;
  std::filesystem::remove_all(dir);
}

// The coordinator binary: --print-plan on qwen3moe-tiny with the VRAM budget dense, and --ram
// that holds only the file cache (no RAM-tier expert), far below the experts' bytes.
TEST(DiskEstimate, PrintPlanSaysWhatTheDiskServesAndRefusesARamBelowTheStaging) {
  const std::string dir = group_test::temp_dir("disk-plan");
  const std::string model = group_test::synth_model("qwen3moe-tiny", "f32", dir);
  const model::Model m = model::Model::load(model);
  const ModelSizes s = model_sizes(m, planned_context(m, 0));
  const uint64_t slot = *std::max_element(s.expert_slot_bytes.begin(), s.expert_slot_bytes.end());
  const auto run = [&](const std::string& args) {
    return test_support::run_command(std::string(MORAINE_BUILD_DIR) + "/coordinator/moraine-coordinator --print-plan -m " +
                                     test_support::quoted(model) + " --socket-dir " + test_support::quoted(dir + "/sock") +
                                     " --vram dense --cpu-workers 2 " + args);
  };
  const std::regex share(R"(disk reads: ([0-9.]+)% of routed-expert reads per token from the file)");
  std::smatch mt;
  // Every expert fits: nothing from the disk, and no probe (no rate measured).
  auto [rc, out] = run("--ram unlimited");
  ASSERT_EQ(rc, 0) << out;
  ASSERT_TRUE(std::regex_search(out, mt, share)) << out;
  EXPECT_EQ(std::stod(mt[1]), 0.0) << out;
  EXPECT_NE(out.find("no disk bound"), std::string::npos) << out;

  const int64_t slots = 3;
  const uint64_t cache = PlacementPlan::cache_region_bytes(2, slots, slot);
  const std::string low = "--ram " + std::to_string(cache + slot / 2) + " --file-cache " + std::to_string(cache);
  std::tie(rc, out) = run(low + " --disk-rate 1G");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\n  RAM          0 "), std::string::npos) << out;
  EXPECT_NE(out.find("file cache: 2 workers x 3 slots"), std::string::npos) << out;
  const std::regex staging(R"(x 3 slots of [^(]*\(([0-9]+) staging)");
  ASSERT_TRUE(std::regex_search(out, mt, staging)) << out;
  const int64_t S = std::stoll(mt[1]);
  const double L = static_cast<double>(s.n_layer), E = static_cast<double>(s.n_expert), k = static_cast<double>(s.n_expert_used);
  const double expected = 1.0 - 2.0 * static_cast<double>(std::max<int64_t>(0, slots - S)) / (L * E);
  ASSERT_TRUE(std::regex_search(out, mt, share)) << out;
  EXPECT_NEAR(std::stod(mt[1]) / 100.0, expected, 5e-5) << out;   // printed to 0.01%
  // The bound at 1 GiB/s: the rate over the expected bytes (every layer's experts the same size here).
  const std::regex bound(R"(at most ([0-9.]+) tok/s \(disk rate given: --disk-rate 1G\))");
  ASSERT_TRUE(std::regex_search(out, mt, bound)) << out;
  const double bytes = expected * L * k * static_cast<double>(s.expert_bytes[0]);
  EXPECT_NEAR(std::stod(mt[1]), static_cast<double>(1ull << 30) / bytes, 0.01) << out;
  // The default rate: measured by the O_DIRECT probe (or, where the file system refuses O_DIRECT, why not).
  std::tie(rc, out) = run(low);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_TRUE(out.find("disk rate measured: O_DIRECT") != std::string::npos || out.find("disk rate not measured: O_DIRECT") != std::string::npos) << out;

  // A --ram below one staging slot per worker: refused, naming the budget, the slots and the bytes they need.
  std::tie(rc, out) = run("--ram " + std::to_string(slot));
  EXPECT_NE(rc, 0) << out;
  EXPECT_EQ(out.find("placement:"), std::string::npos) << out;
  EXPECT_NE(out.find("--ram " + format_bytes(slot) + " (" + std::to_string(slot) + " bytes) is too small for the staging slots"),
            std::string::npos) << out;
  EXPECT_NE(out.find("2 workers x 1 slots x " + std::to_string(slot) + " bytes"), std::string::npos) << out;
  EXPECT_NE(out.find(std::to_string(PlacementPlan::cache_region_bytes(2, 1, slot)) + " bytes"), std::string::npos) << out;
  EXPECT_NE(run("--ram 1G --disk-rate fast").second.find("--disk-rate 'fast'"), std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace moraine::group
