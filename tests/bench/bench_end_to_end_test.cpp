// moraine-bench run as a user would on tiny synth models of both families: it must finish, say
// "engine: cpu-reference", and report bytes per token equal to what the GGUF's tensor list
// implies (computed here independently of the tool: every non-expert tensor once, one row of
// token_embd, top-k of n_expert of each expert tensor).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>

#include "common/gguf/gguf.h"

#include "tests/bench/bench_test_support.h"

namespace {

namespace fs = std::filesystem;
using moraine::bench_test::Scratch;
using moraine::bench_test::slurp;

int sh(const std::string& cmd) { return std::system(cmd.c_str()); }

double expected_ram_bytes_per_token(const std::string& path) {
  const auto f = moraine::gguf::GgufFile::open(path);
  const std::string arch = *f.get_string("general.architecture");
  const double n_expert = static_cast<double>(*f.get_u64(arch + ".expert_count"));
  const double n_used = static_cast<double>(*f.get_u64(arch + ".expert_used_count"));
  double bytes = 0;
  bool has_output = false;
  const moraine::gguf::TensorInfo* embd = nullptr;
  for (const auto& t : f.tensors()) {
    if (t.name == "token_embd.weight") {
      embd = &t;
      bytes += static_cast<double>(t.n_bytes) / static_cast<double>(t.n_rows());
    } else if (t.name.find("_exps.") != std::string::npos) {
      bytes += static_cast<double>(t.n_bytes) * n_used / n_expert;
    } else {
      has_output |= t.name == "output.weight";
      bytes += static_cast<double>(t.n_bytes);
    }
  }
  if (!has_output && embd) bytes += static_cast<double>(embd->n_bytes);  // tied lm head read whole
  return bytes;
}

void run_shape(const std::string& shape) {
  Scratch s("moraine-bench-e2e-");
  const std::string build = MORAINE_BUILD_DIR;
  const std::string model = (s.dir / (shape + ".gguf")).string();
  ASSERT_EQ(sh(build + "/tools/synth/moraine-synth --shape " + shape + " -o " + model + " --zipf 1.0 --seed 7 2>" +
               (s.dir / "synth.err").string()),
            0)
      << slurp(s.dir / "synth.err");

  const std::string bench = build + "/tools/bench/moraine-bench -m " + model +
                            " -n 6 -p 5,17 -t 2 --dram-probe-mib 64 --disk-probe-mib 8 --gpu-probe-mib 8";
  const fs::path out = s.dir / "bench.json", err = s.dir / "bench.err";
  ASSERT_EQ(sh(bench + " --json >" + out.string() + " 2>" + err.string()), 0) << slurp(err);
  const nlohmann::json j = nlohmann::json::parse(slurp(out));
  EXPECT_EQ(j.at("engine"), "cpu-reference");
  EXPECT_EQ(j.at("model").at("file_bytes").get<uint64_t>(), fs::file_size(model));
  EXPECT_LE(j.at("threads").get<int>(), 2);
  ASSERT_EQ(j.at("prefill").size(), 2u);
  EXPECT_EQ(j.at("prefill")[1].at("n_tokens"), 17);
  EXPECT_GT(j.at("prefill")[1].at("tok_s").get<double>(), 0.0);
  EXPECT_EQ(j.at("decode").at("n_tokens"), 6);
  EXPECT_GT(j.at("decode").at("tok_s").get<double>(), 0.0);

  const double expected = expected_ram_bytes_per_token(model);
  EXPECT_DOUBLE_EQ(j.at("bytes_per_token").at("ram").get<double>(), expected);
  for (const char* tier : {"vram", "pcie", "disk"}) EXPECT_EQ(j.at("bytes_per_token").at(tier), 0.0) << tier;
  const double bound = j.at("bound").at("tok_s").get<double>();
  EXPECT_NEAR(bound, j.at("bandwidth").at("ram").at("bytes_per_s").get<double>() / expected, 1e-9 * bound);

  // The table says which engine produced the numbers.
  const fs::path table = s.dir / "bench.txt";
  ASSERT_EQ(sh(bench + " >" + table.string() + " 2>" + err.string()), 0) << slurp(err);
  EXPECT_NE(slurp(table).find("engine: cpu-reference"), std::string::npos) << slurp(table);
}

// The process-group engine: moraine-bench starts its own group (CPU backend, two cpu workers)
// with a RAM budget that leaves part of the experts in the file, and must report the expert
// reads split over the RAM and disk tiers that add up to the same bytes per token.
TEST(BenchEndToEnd, GroupEngineSplitsExpertReadsOverRamAndFile) {
  Scratch s("moraine-bench-e2e-");
  const std::string build = MORAINE_BUILD_DIR;
  const std::string model = (s.dir / "moe.gguf").string();
  ASSERT_EQ(sh(build + "/tools/synth/moraine-synth --shape qwen3moe-tiny -o " + model + " --zipf 1.0 --seed 7 2>" +
               (s.dir / "synth.err").string()),
            0)
      << slurp(s.dir / "synth.err");
  uint64_t expert_bytes = 0;
  const auto file = moraine::gguf::GgufFile::open(model);   // named: tensors() refers into it
  for (const auto& t : file.tensors()) {
    if (t.name.find("_exps.") != std::string::npos) expert_bytes += t.n_bytes;
  }
  const std::string ram = std::to_string(expert_bytes * 2 / 5);
  const std::string bench = build + "/tools/bench/moraine-bench -m " + model + " --engine group --cpu-workers 2 --ram " +
                            ram + " -n 6 -p 5 -t 2 --dram-probe-mib 64 --disk-probe-mib 8 --gpu-probe-mib 8 --json";
  const fs::path out = s.dir / "bench.json", err = s.dir / "bench.err";
  ASSERT_EQ(sh(bench + " >" + out.string() + " 2>" + err.string()), 0) << slurp(err);
  const nlohmann::json j = nlohmann::json::parse(slurp(out));
  EXPECT_EQ(j.at("engine"), "group-cpu");
  EXPECT_GT(j.at("prefill")[0].at("tok_s").get<double>(), 0.0);
  EXPECT_EQ(j.at("decode").at("n_tokens"), 6);
  EXPECT_GT(j.at("decode").at("tok_s").get<double>(), 0.0);
  const nlohmann::json& hit = j.at("hit_rate");
  EXPECT_GT(hit.at("ram").get<double>(), 0.0) << hit.dump();
  EXPECT_GT(hit.at("disk").get<double>(), 0.0) << hit.dump();
  EXPECT_EQ(hit.at("vram").get<double>(), 0.0) << hit.dump();   // CPU backend: dense only on the gpu_worker
  EXPECT_NEAR(hit.at("ram").get<double>() + hit.at("disk").get<double>(), 1.0, 1e-12);
  // By placement tier the bytes add up to the model's per token; RAM and FILE hold experts.
  double total = 0;
  for (const char* tier : {"vram", "ram", "file"}) total += j.at("placed_bytes_per_token").at(tier).get<double>();
  EXPECT_NEAR(total, expected_ram_bytes_per_token(model), 1e-9 * total);
  EXPECT_GT(j.at("placed_bytes_per_token").at("file").get<double>(), 0.0);
  EXPECT_GT(j.at("bytes_per_token").at("disk").get<double>(), 0.0);
  // The FILE tier behind its cache: a cold run (the first after the group started) and the warm
  // one, each with counts that must agree with one another and with the expert's bytes.
  double one_expert = 0;   // gate + up + down of one expert (every layer of this shape alike)
  for (const auto& t : file.tensors()) {
    if (t.name.rfind("blk.0.", 0) == 0 && t.name.find("_exps.") != std::string::npos) one_expert += static_cast<double>(t.n_bytes);
  }
  one_expert /= static_cast<double>(*file.get_u64("qwen3moe.expert_count"));
  const nlohmann::json& ft = j.at("file_tier");
  ASSERT_TRUE(ft.is_object()) << j.dump();
  for (const char* name : {"cold", "warm"}) {
    const nlohmann::json& run = ft.at(name);
    const uint64_t tokens = run.at("tokens").get<uint64_t>(), hits = run.at("hits").get<uint64_t>(),
                   misses = run.at("misses").get<uint64_t>(), ahead = run.at("read_ahead").get<uint64_t>();
    EXPECT_EQ(tokens, 6u + 1) << name;   // the one-token prompt and 6 decode steps
    EXPECT_GT(misses, 0u) << name << run.dump();
    // Every read from the file is a miss or a read-ahead of one whole expert.
    EXPECT_EQ(static_cast<double>(run.at("bytes_read").get<uint64_t>()), static_cast<double>(misses + ahead) * one_expert) << run.dump();
    EXPECT_NEAR(run.at("disk_bytes_per_token").get<double>(), static_cast<double>(misses + ahead) * one_expert / static_cast<double>(tokens),
                1e-6) << run.dump();
    // Bytes per token of the FILE tier: every FILE-tier expert computed (hit or miss), each one expert's bytes.
    EXPECT_NEAR(run.at("placed_bytes_per_token").at("file").get<double>(),
                static_cast<double>(hits + misses) * one_expert / static_cast<double>(tokens), 1e-6) << run.dump();
    EXPECT_NEAR(run.at("hit_rate").get<double>(), static_cast<double>(hits) / static_cast<double>(hits + misses), 1e-12);
    if (!ft.at("disk_bytes_per_s").is_null()) {
      const double bound = run.at("disk_bound_tok_s").get<double>();
      EXPECT_NEAR(bound, ft.at("disk_bytes_per_s").get<double>() / run.at("disk_bytes_per_token").get<double>(), 1e-9 * bound);
      EXPECT_NEAR(run.at("share_of_disk_bound").get<double>(), run.at("tok_s").get<double>() / bound, 1e-9);
    }
  }
  const nlohmann::json &cold = ft.at("cold"), &warm = ft.at("warm");
  EXPECT_GE(warm.at("hit_rate").get<double>(), cold.at("hit_rate").get<double>()) << ft.dump();
  EXPECT_LE(warm.at("misses").get<uint64_t>(), cold.at("misses").get<uint64_t>()) << ft.dump();
  // The tier table's disk row is the warm run's reads; its FILE-tier hits are RAM reads there.
  EXPECT_NEAR(j.at("bytes_per_token").at("disk").get<double>(), warm.at("disk_bytes_per_token").get<double>(), 1e-9);
  EXPECT_EQ(j.at("expert_reads").at("disk").get<uint64_t>(), warm.at("misses").get<uint64_t>());
  // The shares are of the decode run alone (the workers' counters run from their start, so the
  // bench takes the difference over the run): the prefill of the 1-token prompt and 6 decode
  // steps, each computing top-k experts in every layer. Counted since start, the prefill runs
  // (-p 5, twice) would add theirs.
  const int64_t n_layer = static_cast<int64_t>(*file.get_u64("qwen3moe.block_count"));
  const int64_t k = static_cast<int64_t>(*file.get_u64("qwen3moe.expert_used_count"));
  const nlohmann::json& reads = j.at("expert_reads");
  EXPECT_EQ(reads.at("ram").get<int64_t>() + reads.at("disk").get<int64_t>(), (6 + 1) * n_layer * k) << reads.dump();
  EXPECT_EQ(reads.at("vram").get<int64_t>(), 0) << reads.dump();
  // The placement the prefill bound reads (group.json, placement.json): every expert in RAM or
  // FILE, steps of the coordinator's default 512 rows (the bench leaves --max-tokens to it, as a
  // user's group does), no long steps on the CPU backend, so no bound and why.
  const int64_t n_expert = static_cast<int64_t>(*file.get_u64("qwen3moe.expert_count"));
  const nlohmann::json& st = j.at("prefill_staging");
  EXPECT_EQ(st.at("device_computes"), false) << st.dump();
  EXPECT_EQ(st.at("window_rows"), 512) << st.dump();
  EXPECT_EQ(st.at("long_step_rows"), 0) << st.dump();
  EXPECT_GT(st.at("experts").at("file").get<int64_t>(), 0) << st.dump();
  EXPECT_EQ(st.at("experts").at("ram").get<int64_t>() + st.at("experts").at("file").get<int64_t>(), n_layer * n_expert)
      << st.dump();
  EXPECT_NE(j.at("prefill_bound")[0].at("why_none").get<std::string>().find("CPU backend"), std::string::npos)
      << j.at("prefill_bound")[0].dump();
  // The workers' idle-time prefetch (their default router guess) over the same run: it guessed,
  // and what it got right is part of what the layers asked the workers for.
  const nlohmann::json& pf = j.at("cpu_prefetch");
  EXPECT_GT(pf.at("guessed").get<int64_t>(), 0) << pf.dump();
  EXPECT_LE(pf.at("guessed_right").get<int64_t>(), pf.at("guessed").get<int64_t>()) << pf.dump();
  EXPECT_LE(pf.at("guessed_right").get<int64_t>(), pf.at("needed").get<int64_t>()) << pf.dump();
  EXPECT_LE(pf.at("needed").get<int64_t>(), reads.at("ram").get<int64_t>() + reads.at("disk").get<int64_t>()) << pf.dump();
  EXPECT_GT(pf.at("runs").get<int64_t>(), 0) << pf.dump();
  EXPECT_LE(pf.at("cut_short").get<int64_t>(), pf.at("runs").get<int64_t>()) << pf.dump();
  // The hand-off chain of the same run: in each layer of the 7 steps the gpu_worker waited for
  // the backend's routing (the CPU backend hands off in-graph too) and then for the workers,
  // timing both; the busiest worker timed its own calls (at most one per hand-off).
  const nlohmann::json& chain = j.at("handoff_chain");
  const nlohmann::json& call = chain.at("expert_cpu");
  EXPECT_GT(call.at("samples").get<int64_t>(), 0) << chain.dump();
  EXPECT_LE(call.at("samples").get<int64_t>(), (6 + 1) * n_layer) << chain.dump();
  for (const char* stage : {"routed_wait", "expert_handoff", "expert_cpu"}) {
    const nlohmann::json& c = chain.at(stage);
    if (stage != std::string("expert_cpu")) {
      EXPECT_EQ(c.at("samples").get<int64_t>(), (6 + 1) * n_layer) << stage << chain.dump();
    }
    EXPECT_GT(c.at("p50_us").get<double>(), 0.0) << stage << chain.dump();
    EXPECT_GE(c.at("p90_us").get<double>(), c.at("p50_us").get<double>()) << stage << chain.dump();
  }
}

// The census warm-up: a first run records which experts the routing uses, the group restarts
// and places by it. At Zipf 1.2 with RAM for about a quarter of the experts, the RAM tier must then
// serve clearly more of the expert reads than the uniform placement (low ids first) does.
TEST(BenchEndToEnd, GroupEngineCensusWarmupPutsTheUsedExpertsInRam) {
  Scratch s("moraine-bench-e2e-");
  const std::string build = MORAINE_BUILD_DIR;
  const std::string model = (s.dir / "moe.gguf").string();
  ASSERT_EQ(sh(build + "/tools/synth/moraine-synth --shape qwen3moe-tiny --experts 32 -o " + model +
               " --zipf 1.2 --seed 3 2>" + (s.dir / "synth.err").string()),
            0)
      << slurp(s.dir / "synth.err");
  uint64_t expert_bytes = 0;
  const auto file = moraine::gguf::GgufFile::open(model);   // named: tensors() refers into it
  for (const auto& t : file.tensors()) {
    if (t.name.find("_exps.") != std::string::npos) expert_bytes += t.n_bytes;
  }
  const std::string bench = build + "/tools/bench/moraine-bench -m " + model + " --engine group --cpu-workers 2 --ram " +
                            std::to_string(expert_bytes * 3 / 10) +
                            " -n 48 -p 96 -t 2 --dram-probe-mib 64 --disk-probe-mib 8 --gpu-probe-mib 8 --json";
  const auto run = [&](const std::string& extra, const std::string& tag) {
    const fs::path out = s.dir / (tag + ".json"), err = s.dir / (tag + ".err");
    EXPECT_EQ(sh(bench + extra + " >" + out.string() + " 2>" + err.string()), 0) << slurp(err);
    return nlohmann::json::parse(slurp(out));
  };
  const nlohmann::json uniform = run("", "uniform");
  const nlohmann::json warm = run(" --census-warmup", "warm");
  EXPECT_EQ(uniform.at("census").get<std::string>().rfind("none", 0), 0u) << uniform.at("census");
  EXPECT_EQ(warm.at("census").get<std::string>().rfind("warm:", 0), 0u) << warm.at("census");
  // The prefill bound's popularity follows: the census after a warm-up, uniform without one.
  EXPECT_EQ(warm.at("prefill_staging").at("popularity").get<std::string>().rfind("the warm-up run's census", 0), 0u)
      << warm.at("prefill_staging");
  EXPECT_EQ(uniform.at("prefill_staging").at("popularity").get<std::string>().rfind("uniform", 0), 0u)
      << uniform.at("prefill_staging");
  // The RAM tier's share of the expert reads: RAM reads less the FILE-tier experts found in the
  // file cache (counted as RAM reads too).
  const auto ram_tier_share = [](const nlohmann::json& j) {
    const nlohmann::json& reads = j.at("expert_reads");
    const double hits = j.at("file_tier").is_object() ? j.at("file_tier").at("warm").at("hits").get<double>() : 0.0;
    return (reads.at("ram").get<double>() - hits) / (reads.at("ram").get<double>() + reads.at("disk").get<double>());
  };
  const double ram_uniform = ram_tier_share(uniform);
  const double ram_warm = ram_tier_share(warm);
  std::printf("RAM tier share of expert reads: uniform placement %.3f, after the census warm-up %.3f\n", ram_uniform, ram_warm);
  // Measured: 0.213 uniform, 0.662 warm (seed 3); 0.161 and 0.719 in session 23.
  EXPECT_GT(ram_warm, ram_uniform + 0.1);
}

// pp8192 on the group: the gpu_worker's KV cache holds the positions placement planned, which
// were min(4096, the model's) whatever the prompts. moraine-bench now plans what its runs need
// (longest prompt + n + 1, or --ctx) and refuses runs longer than the model's context_length
// before starting anything. The plan the group followed is read back from the coordinator's log.
TEST(BenchEndToEnd, GroupEnginePlansTheContextItsRunsNeed) {
  Scratch s("moraine-bench-e2e-");
  const std::string build = MORAINE_BUILD_DIR;
  const std::string model = (s.dir / "moe.gguf").string();
  ASSERT_EQ(sh(build + "/tools/synth/moraine-synth --shape qwen3moe-tiny -o " + model + " --seed 5 2>" +
               (s.dir / "synth.err").string()),
            0)
      << slurp(s.dir / "synth.err");
  const auto f = moraine::gguf::GgufFile::open(model);
  const uint64_t model_ctx = *f.get_u64("qwen3moe.context_length");
  const std::string bench = build + "/tools/bench/moraine-bench -m " + model +
                            " --engine group -t 2 --dram-probe-mib 64 --disk-probe-mib 8 --gpu-probe-mib 8 --json";
  // Returns the exit status; the plan's context through `planned` when the run passed.
  const auto run = [&](const std::string& extra, const std::string& tag, int64_t* planned) {
    const fs::path dir = s.dir / tag, out = s.dir / (tag + ".json"), err = s.dir / (tag + ".err");
    const int rc = sh(bench + extra + " --socket-dir " + dir.string() + " >" + out.string() + " 2>" + err.string());
    if (rc == 0 && planned) {
      // The coordinator's log line "placement: ... context N" (placement.json goes with the group).
      const std::string log = slurp(dir / "coordinator.log");
      const size_t at = log.rfind(" context ");
      *planned = at == std::string::npos ? -1 : std::stoll(log.substr(at + 9));
    }
    return std::make_pair(rc, slurp(err));
  };
  // Not the supervisor's default of min(4096, the model's), which the group planned before.
  ASSERT_GE(model_ctx, 4096u);
  const int64_t n = 3, longest = 2000;
  int64_t planned = 0;
  auto [rc, err] = run(" -n " + std::to_string(n) + " -p 7," + std::to_string(longest), "auto", &planned);
  ASSERT_EQ(rc, 0) << err;
  EXPECT_EQ(planned, longest + n + 1);
  // An explicit --ctx is passed through as it is.
  std::tie(rc, err) = run(" -n 4 -p 9 --ctx 1000", "explicit", &planned);
  ASSERT_EQ(rc, 0) << err;
  EXPECT_EQ(planned, 1000);
  // Refused before any run: --ctx below what the runs need, and runs longer than the model allows.
  std::tie(rc, err) = run(" -n 4 -p 300 --ctx 200", "short", nullptr);
  EXPECT_NE(rc, 0);
  EXPECT_NE(err.find("--ctx 200 is less than the 305 positions"), std::string::npos) << err;
  std::tie(rc, err) = run(" -n 4 -p " + std::to_string(model_ctx), "too_long", nullptr);
  EXPECT_NE(rc, 0);
  EXPECT_NE(err.find("context_length " + std::to_string(model_ctx)), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(s.dir / "too_long" / "coordinator.log")) << "a group was started for a refused run";
}

TEST(BenchEndToEnd, Qwen3MoeTiny) { run_shape("qwen3moe-tiny"); }
TEST(BenchEndToEnd, Qwen3NextTiny) { run_shape("qwen3next-tiny"); }

}  // namespace
