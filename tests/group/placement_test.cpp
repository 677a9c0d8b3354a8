// The placement planner (coordinator/placement.h): budgets -> tiers on random model shapes and
// random popularity censuses (fixed seeds), checked against the rules it promises rather than
// against its own output: dense + KV first, per-layer quotas, most popular first, budgets never
// exceeded, nothing left out that would still fit, clear errors for budgets too small. Then the
// plan file round trip, the arena built from a plan, and the sizes of a real (golden) model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/model/model.h"
#include "coordinator/device_reserve.h"
#include "coordinator/group_layout.h"
#include "coordinator/placement.h"
#include "tests/group/group_harness.h"
#include "tests/support/shell.h"

namespace moraine::group {
namespace {

namespace fs = std::filesystem;

ModelSizes random_sizes(std::mt19937_64& rng) {
  ModelSizes s;
  s.n_layer = std::uniform_int_distribution<int64_t>(2, 9)(rng);
  s.n_expert = std::uniform_int_distribution<int64_t>(4, 40)(rng);
  s.n_expert_used = std::uniform_int_distribution<int64_t>(1, std::min<int64_t>(8, s.n_expert))(rng);
  s.dense_bytes = std::uniform_int_distribution<uint64_t>(1 << 20, 1 << 28)(rng);
  s.kv_bytes = std::uniform_int_distribution<uint64_t>(1 << 16, 1 << 24)(rng);
  s.context = 4096;
  // Most models quantize every layer's experts alike; some layers differ (mixed quant maps).
  const uint64_t base = std::uniform_int_distribution<uint64_t>(10'000, 3'000'000)(rng);
  for (int64_t il = 0; il < s.n_layer; ++il) {
    const uint64_t b = rng() % 4 == 0 ? base + rng() % base : base;
    s.expert_bytes.push_back(b);
    s.expert_slot_bytes.push_back(arena_align(b / 3) * 3 + kArenaAlign);   // any >= b works for the planner
  }
  return s;
}

Census random_census(std::mt19937_64& rng, int64_t L, int64_t E) {
  Census c = Census::uniform(L, E);
  for (auto& layer : c.counts) {
    for (auto& n : layer) n = rng() % 50;   // small range: ties happen and must break by id
  }
  return c;
}

// Within each layer, every expert of a better tier is at least as popular as every expert of a
// worse one, and equal counts are ordered by id.
void expect_popularity_order(const PlacementPlan& p, const Census& c) {
  for (int64_t il = 0; il < p.n_layer; ++il) {
    for (int64_t a = 0; a < p.n_expert; ++a) {
      for (int64_t b = 0; b < p.n_expert; ++b) {
        if (static_cast<int>(p.at(il, a)) >= static_cast<int>(p.at(il, b))) continue;   // a in a better tier than b
        const auto na = c.counts[il][a], nb = c.counts[il][b];
        ASSERT_TRUE(na > nb || (na == nb && a < b))
            << "layer " << il << ": expert " << a << " (" << na << ", " << tier_name(p.at(il, a)) << ") placed above expert "
            << b << " (" << nb << ", " << tier_name(p.at(il, b)) << ")";
      }
    }
  }
}

TEST(Placement, RandomBudgetsFollowTheRules) {
  std::mt19937_64 rng(20261129);
  int three_tiers = 0;   // trials that exercised every tier at once
  for (int trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    PlacementInput in;
    in.sizes = random_sizes(rng);
    const ModelSizes& s = in.sizes;
    in.n_cpu_workers = static_cast<int>(std::uniform_int_distribution<int>(1, 4)(rng));
    in.census = random_census(rng, s.n_layer, s.n_expert);
    uint64_t all_experts = 0, all_slots = 0;
    for (int64_t il = 0; il < s.n_layer; ++il) {
      all_experts += s.expert_bytes[il] * static_cast<uint64_t>(s.n_expert);
      all_slots += s.expert_slot_bytes[il] * static_cast<uint64_t>(s.n_expert);
    }
    const uint64_t vram_extra = rng() % (all_experts / 2 + 1);
    in.vram_budget = s.dense_bytes + s.kv_bytes + vram_extra;
    const uint64_t max_slot = *std::max_element(s.expert_slot_bytes.begin(), s.expert_slot_bytes.end());
    const uint64_t worst_staging = PlacementPlan::cache_region_bytes(in.n_cpu_workers, s.n_expert_used, max_slot);
    in.ram_budget = rng() % 5 == 0 ? kUnlimitedBytes : worst_staging + rng() % (all_slots / 2 + 1);

    const PlacementPlan p = plan_placement(in);
    ASSERT_EQ(p.tiers.size(), static_cast<size_t>(s.n_layer * s.n_expert));
    three_tiers += p.vram.experts > 0 && p.ram.experts > 0 && p.file.experts > 0;
    expect_popularity_order(p, in.census);

    // Budgets hold.
    EXPECT_LE(p.vram.bytes, vram_extra);
    if (in.ram_budget != kUnlimitedBytes) {
      EXPECT_LE(p.ram.bytes + p.cache_region_bytes(), in.ram_budget);
    }
    EXPECT_EQ(p.vram.experts + p.ram.experts + p.file.experts, s.n_layer * s.n_expert);

    // Per-layer quota: every layer gets at least what an equal share of the VRAM buys.
    for (int64_t il = 0; il < s.n_layer; ++il) {
      const int64_t share = static_cast<int64_t>(vram_extra / static_cast<uint64_t>(s.n_layer) / s.expert_bytes[il]);
      EXPECT_GE(static_cast<int64_t>(p.experts_in(il, Tier::kVram).size()), std::min(share, s.n_expert)) << "layer " << il;
    }
    // Nothing left out of VRAM that would still have fit.
    for (int64_t il = 0; il < s.n_layer; ++il) {
      if (static_cast<int64_t>(p.experts_in(il, Tier::kVram).size()) < s.n_expert) {
        EXPECT_GT(p.vram.bytes + s.expert_bytes[il], vram_extra) << "layer " << il << " had room for another VRAM expert";
      }
    }
    // FILE only when RAM is full, and then there are staging slots for the worst layer, up to k.
    if (in.ram_budget == kUnlimitedBytes) {
      EXPECT_EQ(p.file.experts, 0);
    }
    if (p.file.experts > 0) {
      EXPECT_GE(p.staging_slots, 1);
      EXPECT_LE(p.staging_slots, s.n_expert_used);
      EXPECT_GE(p.staging_slot_bytes, max_slot);
      EXPECT_GE(p.cache_slots, p.staging_slots);
      for (int64_t il = 0; il < s.n_layer; ++il) {
        std::vector<int64_t> per(static_cast<size_t>(in.n_cpu_workers), 0);
        for (int32_t e : p.experts_in(il, Tier::kFile)) ++per[static_cast<size_t>(e % in.n_cpu_workers)];
        for (int64_t n : per) EXPECT_GE(p.staging_slots, std::min(n, s.n_expert_used));
      }
      // Staging slots come out of the RAM budget before RAM experts are placed; nothing that
      // still fits beside them is left in FILE.
      for (int64_t il = 0; il < s.n_layer; ++il) {
        if (!p.experts_in(il, Tier::kFile).empty()) {
          EXPECT_GT(p.ram.bytes + p.cache_region_bytes() + s.expert_slot_bytes[il], in.ram_budget)
              << "layer " << il << " had room for another RAM expert";
        }
      }
    } else {
      EXPECT_EQ(p.staging_slots, 0);
      EXPECT_EQ(p.cache_slots, 0);
    }
  }
  EXPECT_GT(three_tiers, 100);
}

TEST(Placement, UniformCensusFillsLowIdsFirstWithEqualQuotas) {
  ModelSizes s;
  s.n_layer = 4;
  s.n_expert = 10;
  s.n_expert_used = 2;
  s.dense_bytes = 1000;
  s.kv_bytes = 24;
  s.expert_bytes.assign(4, 100);
  s.expert_slot_bytes.assign(4, 3 * kArenaAlign);
  PlacementInput in{s, 1024 + 4 * 3 * 100 + 150, kUnlimitedBytes, 2, {}};
  const PlacementPlan p = plan_placement(in);
  // 3 per layer from the equal shares, then one more (150 left) to the first layer: uniform
  // counts tie, and the leftover goes to the lowest layer.
  EXPECT_EQ(p.experts_in(0, Tier::kVram), (std::vector<int32_t>{0, 1, 2, 3}));
  for (int64_t il = 1; il < 4; ++il) EXPECT_EQ(p.experts_in(il, Tier::kVram), (std::vector<int32_t>{0, 1, 2})) << il;
  EXPECT_EQ(p.ram.experts, 40 - 13);
  EXPECT_EQ(p.file.experts, 0);
}

// 2 layers x 8 experts of 300 KB, dense 5 MB + KV 1 MB: budgets in round numbers of experts.
ModelSizes small_sizes() {
  ModelSizes s;
  s.n_layer = 2;
  s.n_expert = 8;
  s.n_expert_used = 2;
  s.dense_bytes = 5'000'000;
  s.kv_bytes = 1'000'000;
  s.context = 4096;
  s.expert_bytes.assign(2, 300'000);
  s.expert_slot_bytes.assign(2, 303'104);
  return s;
}

TEST(Placement, BudgetsTooSmallAreClearErrors) {
  PlacementInput in{small_sizes(), 5'999'999, kUnlimitedBytes, 2, {}};
  try {
    plan_placement(in);
    FAIL() << "a VRAM budget below dense + KV was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    for (const char* part : {"--vram", "5999999", "5000000", "1000000", "6000000", "4096 tokens"}) {
      EXPECT_NE(m.find(part), std::string::npos) << part << " missing from: " << m;
    }
  }
  // Exactly dense + KV is enough: no expert in VRAM.
  in.vram_budget = 6'000'000;
  EXPECT_EQ(plan_placement(in).vram.experts, 0);
  // RAM that cannot hold the staging slots file-resident experts need (2 workers x 2 slots, and
  // their directory entries: a 4 KiB page).
  const uint64_t staging = 2 * 2 * 303'104 + kArenaAlign;
  EXPECT_EQ(PlacementPlan::cache_region_bytes(2, 2, 303'104), staging);
  in.ram_budget = staging - 1;
  try {
    plan_placement(in);
    FAIL() << "a RAM budget below the staging slots was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--ram"), std::string::npos) << m;
    EXPECT_NE(m.find("staging"), std::string::npos) << m;
    EXPECT_NE(m.find(std::to_string(staging)), std::string::npos) << m;
  }
  // Exactly the staging: every expert in FILE, and the file cache is just those slots.
  in.ram_budget = staging;
  const PlacementPlan p = plan_placement(in);
  EXPECT_EQ(p.file.experts, 16);
  EXPECT_EQ(p.staging_slots, 2);
  EXPECT_EQ(p.cache_slots, 2);
}

// When experts stay in the file, the file cache takes its share of --ram before the RAM tier
// (a quarter by default, or PlacementInput::file_cache_budget), never less than the staging
// slots; the RAM tier gets the rest, and the plan's table says so.
TEST(Placement, FileCacheTakesItsShareOfTheRamBudget) {
  PlacementInput in{small_sizes(), 6'000'000, 12 * 303'104, 2, {}};
  const uint64_t per_slot = 2 * (303'104 + kCacheSlotHeaderBytes);
  PlacementPlan p = plan_placement(in);
  EXPECT_EQ(p.staging_slots, 2);
  EXPECT_EQ(p.cache_slots, 2) << "the quarter buys one slot a worker, below the staging's two";
  in.sizes.n_expert = 64;   // 128 experts of 303,104 bytes
  in.ram_budget = 40 * 303'104;
  p = plan_placement(in);
  EXPECT_EQ(p.cache_slots, 4) << "a quarter of 40 slots' bytes, shared by 2 workers, with the directory";
  EXPECT_GT(p.cache_slots, p.staging_slots);
  EXPECT_LE(p.ram.bytes + p.cache_region_bytes(), in.ram_budget);
  EXPECT_GT(p.ram.bytes + p.cache_region_bytes() + 303'104, in.ram_budget) << "the RAM tier left room";
  EXPECT_NE(p.table().find("file cache: 2 workers x 4 slots"), std::string::npos) << p.table();
  in.file_cache_budget = 7 * per_slot;
  p = plan_placement(in);
  EXPECT_EQ(p.cache_slots, 6) << "seven slots' share less the directory's page";
  in.file_cache_budget = 0;
  p = plan_placement(in);
  EXPECT_EQ(p.cache_slots, p.staging_slots);
  // Everything fits: no file cache.
  in.ram_budget = 128 * 303'104;
  p = plan_placement(in);
  EXPECT_EQ(p.file.experts, 0);
  EXPECT_EQ(p.cache_slots, 0);
  EXPECT_EQ(p.cache_region_bytes(), 0u);
}

// A CUDA gpu_worker's context and scratch (ModelSizes::device_reserve_bytes) come out of --vram
// before any expert: the same budget places that many fewer bytes of experts, and a budget
// that does not cover dense + KV + reserve is refused naming the reserve.
TEST(Placement, DeviceReserveIsChargedToTheVramBudget) {
  PlacementInput in{small_sizes(), 6'000'000 + 10 * 300'000, kUnlimitedBytes, 2, {}};
  EXPECT_EQ(plan_placement(in).vram.experts, 10);
  in.sizes.device_reserve_bytes = 1'200'000;   // four experts' worth
  const PlacementPlan p = plan_placement(in);
  EXPECT_EQ(p.vram.experts, 6);
  EXPECT_EQ(p.device_reserve_bytes, 1'200'000u);
  EXPECT_LE(p.dense_bytes + p.kv_bytes + p.device_reserve_bytes + p.vram.bytes, in.vram_budget);
  in.vram_budget = 7'199'999;
  try {
    plan_placement(in);
    FAIL() << "a VRAM budget below dense + KV + the device reserve was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    for (const char* part : {"7199999", "1200000", "context and scratch", "7200000"})
      EXPECT_NE(m.find(part), std::string::npos) << part << " missing from: " << m;
  }
}

// The CUDA reserve covers the runtime's context and every buffer of the step scratch the backend
// allocates (gpu_worker/cuda_step_scratch.h's list), the logits among them: up to 16 rows of
// n_vocab floats (the head's pass), so a 16-row step holds 15 rows more than a 1-row step. Longer
// steps (the PrefillGemm's workspaces from 64 rows) need more.
TEST(Placement, CudaDeviceReserveCoversContextAndLogits) {
  const std::string dir = group_test::temp_dir("placement-reserve");
  const std::string path = group_test::convert_golden("qwen3moe_odd", "--default q8_0", dir);
  const model::Model m = model::Model::load(path);
  const uint64_t V = static_cast<uint64_t>(m.hp.n_vocab);
  for (const auto& [T, ctx] : std::vector<std::pair<int64_t, int64_t>>{{1, 256}, {16, 256}, {512, 1024}}) {
    const gpu_worker::CudaStepScratch s = gpu_worker::cuda_step_scratch(m.hp, cuda_reserve_scratch_options(m.layers, T, ctx));
    EXPECT_GE(cuda_device_reserve_bytes(m, T, ctx), kCudaContextReserve + s.total(1)) << T << " rows";
    EXPECT_EQ(s.bytes("logits"), static_cast<uint64_t>(std::min<int64_t>(T, 16)) * V * sizeof(float)) << T << " rows";
  }
  EXPECT_GT(cuda_device_reserve_bytes(m, 512, 1024), cuda_device_reserve_bytes(m, 16, 256));
  // The embedding table stays in host memory; this model has its own output head.
  ASSERT_NE(m.output.data, m.tok_embd.data);
  EXPECT_EQ(cuda_host_resident_bytes(m), m.tok_embd.row_bytes * static_cast<uint64_t>(m.tok_embd.n_rows));
  model::Model tied = model::Model::load(path);
  tied.output = tied.tok_embd;   // tied embeddings: the device holds the table as the head
  EXPECT_EQ(cuda_host_resident_bytes(tied), 0u);
  fs::remove_all(dir);
}

// --kv-type f16 (the CUDA backend's default): each cached K and V element is charged 2 bytes
// instead of 4, the recurrent state stays float32; the freed bytes go to VRAM experts under the
// same budget; the plan file carries the type to the gpu_worker (a plan without it reads as F32).
TEST(Placement, KvF16ChargesTwoBytesPerCachedElement) {
  const std::string dir = group_test::temp_dir("placement-kv");
  for (const char* name : {"qwen3moe_odd", "qwen3next_odd"}) {
    SCOPED_TRACE(name);
    const model::Model m = model::Model::load(group_test::convert_golden(name, "--default q8_0", dir));
    const model::HParams& hp = m.hp;
    const int64_t ctx = 1000;
    uint64_t cached = 0, state = 0;   // K and V elements of the attention layers; recurrent floats
    for (int64_t il = 0; il < hp.n_layer; ++il) {
      if (hp.is_recurrent(il))
        state += static_cast<uint64_t>((hp.ssm_conv_kernel - 1) * hp.ssm_conv_dim() +
                                       hp.ssm_n_v_heads * hp.ssm_head_k_dim * hp.ssm_head_v_dim);
      else
        cached += static_cast<uint64_t>(2 * ctx * hp.n_head_kv * hp.head_dim);
    }
    ASSERT_GT(cached, 0u);
    const ModelSizes f32 = model_sizes(m, ctx), f16 = model_sizes(m, ctx, model::KvType::F16);
    EXPECT_EQ(f32.kv_bytes, 4 * cached + 4 * state);
    EXPECT_EQ(f16.kv_bytes, 2 * cached + 4 * state);
    EXPECT_EQ(f16.kv_type, model::KvType::F16);
    EXPECT_EQ(f16.dense_bytes, f32.dense_bytes);

    // One budget: the F16 plan holds the experts the freed bytes pay for, and says so.
    PlacementInput in;
    in.sizes = f32;
    in.vram_budget = f32.dense_bytes + f32.kv_bytes + 3 * f32.expert_bytes[0];
    const PlacementPlan p32 = plan_placement(in);
    in.sizes = f16;
    const PlacementPlan p16 = plan_placement(in);
    EXPECT_EQ(p16.kv_bytes, f16.kv_bytes);
    EXPECT_EQ(p16.kv_type, model::KvType::F16);
    EXPECT_GT(p16.vram.experts, p32.vram.experts);
    EXPECT_LE(p16.dense_bytes + p16.kv_bytes + p16.vram.bytes, in.vram_budget);
    p16.write(dir + "/plan16.json");
    EXPECT_EQ(PlacementPlan::read(dir + "/plan16.json", f16).kv_type, model::KvType::F16);
    EXPECT_NE(p16.table().find("f16 KV"), std::string::npos) << p16.table();
    p32.write(dir + "/plan32.json");
    EXPECT_EQ(PlacementPlan::read(dir + "/plan32.json", f32).kv_type, model::KvType::F32);
    // A plan written before the field: F32, what the backends held then.
    std::ifstream in32(dir + "/plan32.json");
    std::string text((std::istreambuf_iterator<char>(in32)), std::istreambuf_iterator<char>());
    const size_t at = text.find("\"kv_type\"");
    ASSERT_NE(at, std::string::npos);
    text.erase(at, text.find('\n', at) - at + 1);
    std::ofstream(dir + "/old.json") << text;
    EXPECT_EQ(PlacementPlan::read(dir + "/old.json", f32).kv_type, model::KvType::F32);
    // An unknown type is refused, naming the file and the field.
    std::string bad = text;
    bad.insert(bad.find('{') + 1, "\n \"kv_type\": \"q8_0\",");
    std::ofstream(dir + "/bad.json") << bad;
    try {
      PlacementPlan::read(dir + "/bad.json", f32);
      ADD_FAILURE() << "a plan with KV type q8_0 was accepted";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("bad.json"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("kv_type"), std::string::npos) << e.what();
    }
  }
  fs::remove_all(dir);
}

// --batch-decode (issue 33): each of the --parallel sequence slots holds its own KV cache and
// recurrent state for the whole context, so the plan charges kv_bytes once per slot, says so, and
// keeps fewer experts in a budget that held them all beside one slot's; the CUDA reserve grows by
// the slots' recurrent-state snapshots. The coordinator binary with --print-plan.
TEST(Placement, BatchDecodeChargesKvPerSlot) {
  const std::string dir = group_test::temp_dir("placement-slots");
  const std::string model = group_test::synth_model("qwen3next-tiny", "kmix", dir);
  const model::Model m = model::Model::load(model);
  const auto plan = [&](const std::string& args) {
    const auto [rc, out] = test_support::run_command(std::string(MORAINE_BUILD_DIR) +
                                                     "/coordinator/moraine-coordinator --print-plan --backend cuda "
                                                     "--max-tokens 64 --long-step-rows 0 -m " +
                                                     test_support::quoted(model) + " --socket-dir " +
                                                     test_support::quoted(dir + "/sock") + " " + args);
    EXPECT_EQ(rc, 0) << args << "\n" << out;
    return out;
  };
  const auto vram_experts = [](const std::string& out) {
    const size_t at = out.find("\n  VRAM ");
    return at == std::string::npos ? int64_t{-1} : std::stoll(out.substr(at + 8));
  };
  const int64_t ctx = planned_context(m, 0);
  const uint64_t kv = model_sizes(m, ctx, model::KvType::F16).kv_bytes;
  ASSERT_GT(kv, 0u);
  const std::string one = plan("--vram unlimited"), four = plan("--vram unlimited --batch-decode --parallel 4");
  EXPECT_NE(one.find("KV/state " + format_bytes(kv) + " +"), std::string::npos) << one;
  EXPECT_NE(four.find("KV/state " + format_bytes(4 * kv) + " for 4 sequence slots"), std::string::npos) << four;
  // The reserve's snapshot of the recurrent states and position word, one per slot (the listed
  // scratch: this tiny model's snapshot is below the 2 MiB page the total rounds to).
  const auto listed = [&](int64_t slots, const char* name) {
    return gpu_worker::cuda_step_scratch(m.hp, cuda_reserve_scratch_options(m.layers, 64, ctx, 0, 0, slots)).bytes(name);
  };
  EXPECT_GT(listed(1, "delta_snapshot"), 0u);
  EXPECT_EQ(listed(4, "delta_snapshot"), 4 * listed(1, "delta_snapshot"));
  EXPECT_EQ(listed(4, "pos"), 4 * listed(1, "pos"));
  // A budget of every expert beside one slot's KV holds fewer beside four slots'.
  const int64_t all = m.hp.n_layer * m.hp.n_expert;
  uint64_t experts = 0;
  const ModelSizes sizes = model_sizes(m, ctx, model::KvType::F16);
  for (uint64_t b : sizes.expert_bytes) experts += b * static_cast<uint64_t>(m.hp.n_expert);
  const uint64_t budget = sizes.dense_bytes - cuda_host_resident_bytes(m) + kv + cuda_device_reserve_bytes(m, 64, ctx) + experts +
                          (uint64_t{4} << 20);   // the reserve's rounding
  const std::string vram = "--vram " + std::to_string(budget);
  EXPECT_EQ(vram_experts(plan(vram)), all);
  const int64_t batched = vram_experts(plan(vram + " --batch-decode --parallel 4"));
  EXPECT_LT(batched, all);
  fs::remove_all(dir);
}

TEST(Placement, ByteBudgetsParse) {
  EXPECT_EQ(parse_byte_budget("12G", "--vram"), 12ull << 30);
  EXPECT_EQ(parse_byte_budget("512M", "--ram"), 512ull << 20);
  EXPECT_EQ(parse_byte_budget("1.5GiB", "--ram"), 3ull << 29);
  EXPECT_EQ(parse_byte_budget("64k", "--ram"), 64ull << 10);
  EXPECT_EQ(parse_byte_budget("2TB", "--ram"), 2ull << 40);
  EXPECT_EQ(parse_byte_budget("4096", "--ram"), 4096u);
  EXPECT_EQ(parse_byte_budget("unlimited", "--ram"), kUnlimitedBytes);
  for (const char* bad : {"", "lots", "12X", "-1G", "1e30"}) {
    try {
      parse_byte_budget(bad, "--vram");
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("--vram '" + std::string(bad) + "'"), std::string::npos) << e.what();
    }
  }
}

TEST(Placement, PlanAndCensusFilesRoundTripAndRefuseOtherModels) {
  std::mt19937_64 rng(7);
  PlacementInput in;
  in.sizes = random_sizes(rng);
  in.n_cpu_workers = 3;
  in.census = random_census(rng, in.sizes.n_layer, in.sizes.n_expert);
  in.vram_budget = in.sizes.dense_bytes + in.sizes.kv_bytes + in.sizes.expert_bytes[0] * 5;
  in.ram_budget = 3ull * static_cast<uint64_t>(in.sizes.n_expert_used) * 4 * in.sizes.expert_slot_bytes[0] * 2 +
                  in.sizes.expert_slot_bytes[0] * 7;
  const PlacementPlan p = plan_placement(in);
  const std::string dir = group_test::temp_dir("placement");
  p.write(dir + "/plan.json");
  const PlacementPlan q = PlacementPlan::read(dir + "/plan.json", in.sizes);
  EXPECT_EQ(q.tiers, p.tiers);
  EXPECT_EQ(q.staging_slots, p.staging_slots);
  EXPECT_EQ(q.cache_slots, p.cache_slots);
  EXPECT_EQ(q.staging_slot_bytes, p.staging_slot_bytes);
  EXPECT_EQ(q.vram.bytes, p.vram.bytes);
  EXPECT_EQ(q.ram.experts, p.ram.experts);
  EXPECT_EQ(q.table(), p.table());

  ModelSizes other = in.sizes;
  ++other.n_expert;
  try {
    PlacementPlan::read(dir + "/plan.json", other);
    ADD_FAILURE() << "a plan for another model was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/plan.json"), std::string::npos) << e.what();
  }

  in.census.write(dir + "/census.json");
  EXPECT_EQ(Census::read(dir + "/census.json", in.sizes.n_layer, in.sizes.n_expert).counts, in.census.counts);
  try {
    Census::read(dir + "/census.json", in.sizes.n_layer + 1, in.sizes.n_expert);
    ADD_FAILURE() << "a census for another shape was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("census.json"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("layers"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// A real model: the sizes add up to the file's tensors, and the arena built from a three-tier
// plan gives each RAM expert and each staging slot its own 4 KiB-aligned, non-overlapping place,
// with the file ranges naming exactly the expert's bytes.
TEST(Placement, GoldenModelSizesArenaAndFileRanges) {
  const std::string dir = group_test::temp_dir("placement-model");
  const std::string path = group_test::convert_golden("qwen3moe_odd", "--default q8_0", dir);
  const model::Model m = model::Model::load(path);
  const ModelSizes s = model_sizes(m, planned_context(m, 0));
  uint64_t experts = 0, all = 0;
  for (const gguf::TensorInfo& t : m.file.tensors()) {
    all += t.n_bytes;
    if (t.name.find("_exps.weight") != std::string::npos) experts += t.n_bytes;
  }
  EXPECT_EQ(s.dense_bytes, all - experts);
  uint64_t per_layer_sum = 0;
  for (uint64_t b : s.expert_bytes) per_layer_sum += b * static_cast<uint64_t>(s.n_expert);
  EXPECT_EQ(per_layer_sum, experts);

  PlacementInput in;
  in.sizes = s;
  in.n_cpu_workers = 2;
  in.vram_budget = s.dense_bytes + s.kv_bytes + 2 * s.n_layer * s.expert_bytes[0];
  in.ram_budget = 2 * static_cast<uint64_t>(s.n_expert_used) * s.expert_slot_bytes[0] + 3 * s.n_layer * s.expert_slot_bytes[0];
  const PlacementPlan p = plan_placement(in);
  ASSERT_GT(p.vram.experts, 0);
  ASSERT_GT(p.ram.experts, 0);
  ASSERT_GT(p.file.experts, 0);
  const ArenaLayout a = ArenaLayout::build(m, p);
  EXPECT_LE(a.total_bytes, in.ram_budget);
  std::vector<std::pair<size_t, size_t>> spans;
  for (int64_t il = 0; il < p.n_layer; ++il) {
    for (int32_t e : p.experts_in(il, Tier::kRam)) {
      const ArenaLayout::ExpertSlot& slot = a.ram_slot(il, e);
      for (int w = 0; w < 3; ++w) spans.push_back({slot.offset[w], slot.bytes[w]});
    }
  }
  for (int w = 0; w < 2; ++w) {
    for (int64_t j = 0; j < p.cache_slots; ++j) {
      const ArenaLayout::ExpertSlot slot = a.cache_slot(m, 0, w, j);
      for (int part = 0; part < 3; ++part) spans.push_back({slot.offset[part], slot.bytes[part]});
    }
  }
  // The file cache's directory: after the slots, worker by worker.
  ASSERT_GT(p.cache_slots, 0);
  spans.push_back({a.directory_offset, static_cast<size_t>(2 * p.cache_slots) * kCacheSlotHeaderBytes});
  EXPECT_EQ(a.directory_of(1), a.directory_offset + static_cast<size_t>(p.cache_slots) * kCacheSlotHeaderBytes);
  std::sort(spans.begin(), spans.end());
  for (size_t i = 0; i < spans.size(); ++i) {
    EXPECT_EQ(spans[i].first % kArenaAlign, 0u) << i;
    EXPECT_GT(spans[i].second, 0u);
    EXPECT_LE(spans[i].first + spans[i].second, a.total_bytes);
    if (i > 0) {
      EXPECT_LE(spans[i - 1].first + spans[i - 1].second, spans[i].first) << "overlap at " << i;
    }
  }
  // File ranges: read straight from the file, they are the bytes the model binds for the expert.
  std::ifstream f(path, std::ios::binary);
  for (int64_t il = 0; il < p.n_layer; ++il) {
    const model::MoeWeights& W = m.layers[static_cast<size_t>(il)].moe;
    const model::ExpertTensor* t[3] = {&W.gate, &W.up, &W.down};
    for (int64_t e : {int64_t{0}, s.n_expert - 1}) {
      for (int w = 0; w < 3; ++w) {
        const FileRange r = expert_file_range(m, il, e, w);
        const model::Matrix mx = t[w]->expert(e);
        ASSERT_EQ(r.bytes, static_cast<uint64_t>(mx.n_rows) * mx.row_bytes);
        std::vector<char> got(r.bytes);
        f.seekg(static_cast<std::streamoff>(r.offset));
        f.read(got.data(), static_cast<std::streamsize>(got.size()));
        ASSERT_TRUE(f.good());
        EXPECT_EQ(std::memcmp(got.data(), mx.data, r.bytes), 0) << "layer " << il << " expert " << e << " part " << w;
      }
    }
  }
  fs::remove_all(dir);
}

// --max-tokens 0, the default (coordinator.cpp's window_rows_for): 512-row steps, except where a
// CUDA long step's longer window leaves the device as many experts as 512 rows do. The coordinator
// binary with --print-plan, as a user runs it.
TEST(Placement, DefaultWindowRowsKeepEveryDeviceExpert) {
  const std::string dir = group_test::temp_dir("placement-window");
  const std::string model = group_test::synth_model("qwen3moe-tiny", "kmix", dir);
  const auto plan = [&](const std::string& args) {
    const auto [rc, out] = test_support::run_command(std::string(MORAINE_BUILD_DIR) +
                                                     "/coordinator/moraine-coordinator --print-plan -m " +
                                                     test_support::quoted(model) + " --socket-dir " +
                                                     test_support::quoted(dir + "/sock") + " " + args);
    EXPECT_EQ(rc, 0) << args << "\n" << out;
    return out;
  };
  const auto vram_experts = [](const std::string& out) {
    const size_t at = out.find("\n  VRAM ");
    return at == std::string::npos ? int64_t{-1} : std::stoll(out.substr(at + 8));
  };
  const auto has = [](const std::string& out, const std::string& what) { return out.find(what) != std::string::npos; };
  // Every expert fits: the longest window below the long step (this model's context, 4096
  // positions, makes long steps of 4096 rows).
  EXPECT_TRUE(has(plan("--backend cuda"), "steps of 2048 rows, long steps of 4096 rows"));
  // A budget that holds every expert beside 512 rows' scratch but not beside 1024 rows': 512.
  // The least budget holding every expert at a window, found by bisection on the binary's plans.
  const model::Model m = model::Model::load(model);
  const int64_t all = m.hp.n_layer * m.hp.n_expert;
  const auto least_budget_for_all = [&](int rows) {
    uint64_t lo = 1, hi = uint64_t{8} << 30;   // hi holds all: this model is a few MiB
    while (hi - lo > 4096) {
      const uint64_t mid = lo + (hi - lo) / 2;
      const auto [rc, out] = test_support::run_command(
          std::string(MORAINE_BUILD_DIR) + "/coordinator/moraine-coordinator --print-plan --backend cuda -m " +
          test_support::quoted(model) + " --socket-dir " + test_support::quoted(dir + "/sock") + " --max-tokens " +
          std::to_string(rows) + " --vram " + std::to_string(mid));
      (rc == 0 && vram_experts(out) == all ? hi : lo) = mid;
    }
    return hi;
  };
  const uint64_t b512 = least_budget_for_all(512), b1024 = least_budget_for_all(1024), b2048 = least_budget_for_all(2048);
  ASSERT_LT(b512 + 8192, b2048);
  const uint64_t between = b2048 - 8192;   // 2048 rows leave some expert off the device
  const int expected = between >= b1024 ? 1024 : 512;
  const std::string at_default = plan("--backend cuda --vram " + std::to_string(between));
  EXPECT_TRUE(has(at_default, "steps of " + std::to_string(expected) + " rows, long steps of 4096 rows")) << at_default;
  EXPECT_EQ(vram_experts(at_default), all) << at_default;
  const std::string at_2048 = plan("--backend cuda --max-tokens 2048 --vram " + std::to_string(between));
  EXPECT_TRUE(has(at_2048, "steps of 2048 rows")) << "an explicit --max-tokens wins";
  EXPECT_LT(vram_experts(at_2048), all) << at_2048;
  // The CPU backend has no long steps: 512.
  EXPECT_TRUE(has(plan("--backend cpu"), "steps of 512 rows\n"));
}

}  // namespace
}  // namespace moraine::group
