// bench_main driven with engines of the test's own: a well-behaved one whose logits are a
// seeded hash of the context (so greedy output is deterministic), and fault injectors that
// return a NaN, an inf, or a different greedy output on the counted run. A faulty run must end
// with a non-zero status and a message saying why, and print no numbers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <unistd.h>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "tools/bench/bench_cli.h"

namespace moraine::bench {
namespace {

constexpr int64_t kVocab = 1000;
constexpr double kRamBytesPerToken = 123456789.0;

enum class Fault { None, NanInDecode, InfInPrefill, ChangesOnSecondRun, WorkerRestart, ColdRunDiffers };

// The file tier SeededEngine reports with file_tier: 4 layers top-2 of 1 MB experts, so a
// position computes 8 experts; the first run after start (cold) finds 2 of 8 in the cache per
// position, later runs 6 of 8, and every miss and one read-ahead a position is read from the file.
constexpr double kFileExpertBytes = 1e6;
constexpr uint64_t kColdHitsPerToken = 2, kWarmHitsPerToken = 6, kExpertsPerToken = 8;

class SeededEngine final : public BenchEngine {
 public:
  // staged: stats() reports a placement as a GPU engine's long steps stage it (kStaging).
  explicit SeededEngine(Fault f, bool staged = false, bool file_tier = false)
      : fault_(f), staged_(staged), file_tier_(file_tier), logits_(kVocab) {}
  bool has_file_tier() const override { return file_tier_; }
  std::string name() const override { return "test-seeded"; }
  int64_t n_vocab() const override { return kVocab; }
  int n_threads() const override { return 3; }
  void reset() override {
    history_ = 0x5eed;
    n_past_ = 0;
    ++runs_;
  }
  std::span<const float> prefill(std::span<const int32_t> tokens) override {
    for (int32_t t : tokens) feed(t);
    fill();
    if (fault_ == Fault::InfInPrefill && tokens.size() > 1) logits_[kVocab / 2] = INFINITY;
    return logits_;
  }
  std::span<const float> decode_one(int32_t token) override {
    feed(token);
    fill();
    if (fault_ == Fault::NanInDecode && n_past_ == 6) logits_[17] = NAN;
    if (fault_ == Fault::ColdRunDiffers && runs_ == 1 && n_past_ == 3) {   // the first run only: output index 2
      const auto top = std::max_element(logits_.begin(), logits_.end()) - logits_.begin();
      logits_[(top + 1) % kVocab] = logits_[top] + 1.0f;
    }
    if (fault_ == Fault::ChangesOnSecondRun && runs_ % 2 == 0 && n_past_ == 9) {
      // Every second reset is a counted run (2 per test): move the maximum there only.
      const auto top = std::max_element(logits_.begin(), logits_.end()) - logits_.begin();
      logits_[(top + 1) % kVocab] = logits_[top] + 1.0f;
    }
    return logits_;
  }
  // As a process-group engine would report a worker that died and was restarted mid-decode.
  std::string detected_fault() const override {
    return fault_ == Fault::WorkerRestart && n_past_ > 3 ? "cpu_expert_worker 1 restarted" : "";
  }
  EngineStats stats() const override {
    EngineStats s;
    s.bytes_per_token[static_cast<int>(Tier::Ram)] = kRamBytesPerToken;
    s.hit_rate[static_cast<int>(Tier::Ram)] = 1.0;
    if (staged_) s.staging = kStaging();
    if (file_tier_) {
      // The run's positions: the one-token prompt and every decode step but the last's output.
      const uint64_t tokens = static_cast<uint64_t>(n_past_);
      const uint64_t hits = (runs_ == 1 ? kColdHitsPerToken : kWarmHitsPerToken) * tokens;
      const uint64_t misses = kExpertsPerToken * tokens - hits;
      s.file_cache = {hits, misses, static_cast<uint64_t>(kFileExpertBytes) * (misses + tokens), tokens, tokens / 2, tokens};
      s.placed_bytes_per_token = {0, 0, kFileExpertBytes * kExpertsPerToken};
    }
    return s;
  }

 private:
  void feed(int32_t t) {
    history_ = history_ * 1099511628211ull ^ static_cast<uint64_t>(t);
    ++n_past_;
  }
  void fill() {
    std::mt19937_64 rng(history_);
    std::normal_distribution<float> d(0.0f, 3.0f);
    for (float& x : logits_) x = d(rng);
  }
  // One layer of 8 experts top-2, 1 MB each: four in VRAM, four in RAM.
  static ExpertStaging kStaging() {
    ExpertStaging st;
    st.n_expert = 8;
    st.n_expert_used = 2;
    st.long_step_rows = 8192;
    st.window_rows = 16;
    st.expert_bytes = {1e6};
    st.tier = {0, 0, 0, 0, 1, 1, 1, 1};
    st.popularity_note = "uniform (test)";
    return st;
  }
  Fault fault_;
  bool staged_ = false, file_tier_ = false;
  std::vector<float> logits_;
  uint64_t history_ = 0;
  int64_t n_past_ = 0;
  int runs_ = 0;
};

struct CliResult {
  int status;
  std::string out, err;
};

constexpr double kWeightFlops = 5e8;

CliResult run_cli(Fault f, std::vector<std::string> args, bool staged = false, bool file_tier = false,
                  const std::string& model = std::string(MORAINE_SOURCE_DIR) + "/tests/bench/bench_report_test.cpp") {
  // The disk probe reads -m with O_DIRECT: this source file is a real file under one request.
  std::vector<std::string> argv_s{"moraine-bench", "-m", model,
                                  "--dram-probe-mib", "64", "--disk-probe-mib", "8", "--gpu-probe-mib", "8"};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& s : argv_s) argv.push_back(s.data());
  const EngineFactory factory = [f, staged, file_tier](const BenchOptions& o) {
    ModelSummary m{o.model, "test-arch", 42, 4, 8, 2};
    m.prefill.weight_flops = kWeightFlops;   // no experts to time: the GEMM probe says n/a on any machine
    return EngineUnderTest{std::make_unique<SeededEngine>(f, staged, file_tier), m};
  };
  std::ostringstream out, err;
  const int status = bench_main(static_cast<int>(argv.size()), argv.data(), factory, out, err);
  return {status, out.str(), err.str()};
}

TEST(BenchFaults, NanInDecodeLogitsIsRefused) {
  const CliResult r = run_cli(Fault::NanInDecode, {"-n", "16", "-p", "8", "--json"});
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_NE(r.err.find("refusing"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("NaN"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("tg16 run 1 token 5"), std::string::npos) << r.err;  // n_past 6 = prompt + 5 decodes
}

TEST(BenchFaults, InfInPrefillLogitsIsRefused) {
  const CliResult r = run_cli(Fault::InfInPrefill, {"-n", "4", "-p", "32"});
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_NE(r.err.find("pp32 run 1: logit 500 is inf"), std::string::npos) << r.err;
}

TEST(BenchFaults, GreedyOutputThatChangesBetweenRunsIsRefused) {
  const CliResult r = run_cli(Fault::ChangesOnSecondRun, {"-n", "16", "-p", "8"});
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_NE(r.err.find("tg16 run 2"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("non-deterministic"), std::string::npos) << r.err;
}

TEST(BenchFaults, EngineReportedFaultIsRefused) {
  // Prefill of 2 tokens (n_past 2) passes; the decode run reaches n_past > 3.
  const CliResult r = run_cli(Fault::WorkerRestart, {"-n", "8", "-p", "2"});
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_NE(r.err.find("tg8 run 1: the engine reports a fault: cpu_expert_worker 1 restarted"), std::string::npos) << r.err;
}

TEST(BenchFaults, ColdCacheRunWithOtherTokensIsRefused) {
  const CliResult r = run_cli(Fault::ColdRunDiffers, {"-n", "8", "-p", "4"}, false, true);
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_NE(r.err.find("tg8 cold-cache run: greedy output differs from the warm runs' at token 2"), std::string::npos) << r.err;
}

TEST(BenchFaults, BadArgumentsAreRefusedWithTheirName) {
  CliResult r = run_cli(Fault::None, {"--vram", "12X"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("12X"), std::string::npos) << r.err;
  r = run_cli(Fault::None, {"--repeat", "1"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("repeat"), std::string::npos) << r.err;
}

TEST(BenchReport, JsonParsesAndCarriesEveryField) {
  const CliResult r = run_cli(Fault::None, {"-n", "12", "-p", "8,24", "--repeat", "3", "--vram", "12G", "--ram", "32G", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("engine"), "test-seeded");
  EXPECT_EQ(j.at("model").at("arch"), "test-arch");
  EXPECT_EQ(j.at("model").at("file_bytes"), 42);
  for (const char* k : {"path", "n_layer", "n_expert", "n_expert_used"}) EXPECT_TRUE(j.at("model").contains(k)) << k;
  EXPECT_EQ(j.at("threads"), 3);
  EXPECT_EQ(j.at("repeat"), 3);
  EXPECT_EQ(j.at("budgets").at("vram_bytes"), 12ull << 30);
  EXPECT_EQ(j.at("budgets").at("ram_bytes"), 32ull << 30);
  EXPECT_EQ(j.at("budgets").at("applied"), false);

  ASSERT_EQ(j.at("prefill").size(), 2u);
  EXPECT_EQ(j.at("prefill")[0].at("n_tokens"), 8);
  EXPECT_EQ(j.at("prefill")[1].at("n_tokens"), 24);
  for (const auto& t : {j.at("prefill")[0], j.at("prefill")[1], j.at("decode")}) {
    EXPECT_GT(t.at("tok_s").get<double>(), 0.0);
    EXPECT_GE(t.at("stddev").get<double>(), 0.0);
    EXPECT_EQ(t.at("counted_runs"), 2);  // --repeat 3: the warm-up is not counted
  }
  EXPECT_EQ(j.at("decode").at("n_tokens"), 12);

  for (const char* tier : {"vram", "pcie", "ram", "disk"}) {
    EXPECT_TRUE(j.at("bytes_per_token").contains(tier)) << tier;
    EXPECT_TRUE(j.at("hit_rate").contains(tier)) << tier;
    EXPECT_TRUE(j.at("bandwidth").at(tier).contains("bytes_per_s")) << tier;
    EXPECT_FALSE(j.at("bandwidth").at(tier).at("note").get<std::string>().empty()) << tier;
  }
  // RAM and PCIe read at once: numbers on a machine with a GPU, else null with the reason.
  for (const char* tier : {"ram", "pcie"}) {
    const auto& c = j.at("bandwidth_concurrent").at(tier);
    const std::string note = c.at("note").get<std::string>();
    if (c.at("bytes_per_s").is_null()) {
      EXPECT_EQ(note.rfind("n/a", 0), 0u) << tier << ": " << note;
    } else {
      EXPECT_GT(c.at("bytes_per_s").get<double>(), 1e8) << tier;
    }
  }
  for (const char* stage : {"routed_wait", "expert_handoff", "expert_cpu"}) {   // an engine without a group
    EXPECT_EQ(j.at("handoff_chain").at(stage).at("samples"), 0) << stage;
  }
  EXPECT_EQ(j.at("bytes_per_token").at("ram"), kRamBytesPerToken);
  EXPECT_EQ(j.at("hit_rate").at("ram"), 1.0);
  EXPECT_TRUE(j.at("file_tier").is_null()) << "no FILE tier, no cold/warm figures";
  for (const char* tier : {"vram", "ram", "file"}) EXPECT_TRUE(j.at("placed_bytes_per_token").contains(tier)) << tier;
  // The file is under one O_DIRECT request: disk says why it has no number.
  EXPECT_TRUE(j.at("bandwidth").at("disk").at("bytes_per_s").is_null());

  // The bound and the share follow from the reported numbers.
  const double ram_bw = j.at("bandwidth").at("ram").at("bytes_per_s").get<double>();
  EXPECT_GT(ram_bw, 1e8);  // any machine reads DRAM faster than 100 MB/s
  const double bound = j.at("bound").at("tok_s").get<double>();
  EXPECT_NEAR(bound, ram_bw / kRamBytesPerToken, 1e-9 * bound);
  EXPECT_EQ(j.at("bound").at("limiting_tier"), "ram");
  EXPECT_TRUE(j.at("bound").contains("why_none"));
  const double decode = j.at("decode").at("tok_s").get<double>();
  EXPECT_NEAR(j.at("share_of_bound").get<double>(), decode / bound, 1e-9 * decode / bound);
}

TEST(BenchReport, PrefillBoundInJsonAndTable) {
  const CliResult r = run_cli(Fault::None, {"-n", "4", "-p", "8,32", "--json"}, true);
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j.at("prefill_bound").size(), 2u);
  for (const auto& b : j.at("prefill_bound")) {
    const int64_t n = b.at("n_tokens").get<int64_t>();
    EXPECT_EQ(b.at("step_rows"), n);
    EXPECT_EQ(b.at("long_step"), n > 16);
    // Four RAM experts of 1 MB, each used by an n-row step with 1 - (3/4)^n.
    EXPECT_NEAR(b.at("pcie_bytes_per_token").get<double>(), 4e6 * (1 - std::pow(0.75, n)) / n, 1e-6);
    EXPECT_DOUBLE_EQ(b.at("flops_per_token").get<double>(), kWeightFlops);
    // No expert shape to time: no GEMM rate, so no bound, and why.
    EXPECT_TRUE(b.at("tok_s").is_null());
    EXPECT_NE(b.at("why_none").get<std::string>().find("GEMM"), std::string::npos) << b.at("why_none");
  }
  EXPECT_EQ(j.at("prefill_gemm").at("engine_note").get<std::string>().rfind("n/a", 0), 0u) << j.at("prefill_gemm");
  EXPECT_EQ(j.at("prefill_staging").at("long_step_rows"), 8192);
  const CliResult t = run_cli(Fault::None, {"-n", "4", "-p", "32"}, true);
  ASSERT_EQ(t.status, 0) << t.err;
  EXPECT_NE(t.out.find("prefill bound: a long step of min(n, 8192) rows in windows of 16"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("popularity: uniform (test)"), std::string::npos) << t.out;
  // An engine without staging: n/a with its reason.
  const CliResult u = run_cli(Fault::None, {"-n", "4", "-p", "32"});
  EXPECT_NE(u.out.find("prefill bound: n/a (the engine computes on the CPU"), std::string::npos) << u.out;
}

// An engine with a FILE tier: one decode run first (cold), then the usual runs (warm); each with
// the cache's hit rate, the bytes read from the file per position and the disk bound they set at
// the measured O_DIRECT rate of -m (a 9 MiB file: one 8 MiB request).
TEST(BenchReport, FileTierColdAndWarmRunsWithTheDiskBound) {
  const std::string model = (std::filesystem::temp_directory_path() / ("bench-file-tier-" + std::to_string(::getpid()))).string();
  {
    std::ofstream f(model, std::ios::binary);
    const std::vector<char> block(1 << 20, 3);
    for (int i = 0; i < 9; ++i) f.write(block.data(), static_cast<std::streamsize>(block.size()));
  }
  const CliResult r = run_cli(Fault::None, {"-n", "8", "-p", "4", "--json"}, false, true, model);
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  const nlohmann::json& ft = j.at("file_tier");
  ASSERT_TRUE(ft.is_object()) << j.dump();
  const uint64_t tokens = 9;   // the one-token prompt + 8 decode steps
  for (const auto& [name, hits_per_token] : {std::pair{"cold", kColdHitsPerToken}, std::pair{"warm", kWarmHitsPerToken}}) {
    const nlohmann::json& run = ft.at(name);
    EXPECT_EQ(run.at("counted_runs"), 1) << name;
    EXPECT_GT(run.at("tok_s").get<double>(), 0.0) << name;
    EXPECT_EQ(run.at("tokens").get<uint64_t>(), tokens) << name;
    EXPECT_EQ(run.at("hits").get<uint64_t>(), hits_per_token * tokens) << name;
    EXPECT_EQ(run.at("misses").get<uint64_t>(), (kExpertsPerToken - hits_per_token) * tokens) << name;
    EXPECT_DOUBLE_EQ(run.at("hit_rate").get<double>(), static_cast<double>(hits_per_token) / kExpertsPerToken) << name;
    // What the disk read per position: every miss and one read-ahead.
    const double disk = run.at("disk_bytes_per_token").get<double>();
    EXPECT_DOUBLE_EQ(disk, kFileExpertBytes * static_cast<double>(kExpertsPerToken - hits_per_token + 1)) << name;
    EXPECT_DOUBLE_EQ(run.at("placed_bytes_per_token").at("file").get<double>(), kFileExpertBytes * kExpertsPerToken) << name;
    const nlohmann::json& bw = ft.at("disk_bytes_per_s");
    if (bw.is_null()) {   // a file system without O_DIRECT: no bound, and why
      EXPECT_TRUE(run.at("disk_bound_tok_s").is_null()) << name;
      EXPECT_NE(run.at("why_none").get<std::string>().find("not measured"), std::string::npos) << run.dump();
      continue;
    }
    const double bound = run.at("disk_bound_tok_s").get<double>();
    EXPECT_NEAR(bound, bw.get<double>() / disk, 1e-9 * bound) << name;
    EXPECT_NEAR(run.at("share_of_disk_bound").get<double>(), run.at("tok_s").get<double>() / bound, 1e-9) << name;
  }
  EXPECT_GE(ft.at("warm").at("hit_rate").get<double>(), ft.at("cold").at("hit_rate").get<double>());
  EXPECT_EQ(ft.at("warm").at("tok_s"), j.at("decode").at("tok_s"));
  const CliResult t = run_cli(Fault::None, {"-n", "8", "-p", "4"}, false, true, model);
  ASSERT_EQ(t.status, 0) << t.err;
  EXPECT_NE(t.out.find("FILE tier: cold = the first decode run after the engine started"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("| cold  |"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("|     25.0% |"), std::string::npos) << t.out;   // the cold hit rate
  EXPECT_NE(t.out.find("|     75.0% |"), std::string::npos) << t.out;
  std::filesystem::remove(model);
}

TEST(BenchReport, TableNamesTheEngineAndTheTests) {
  const CliResult r = run_cli(Fault::None, {"-n", "5", "-p", "7"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("engine: test-seeded"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("pp7 |"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tg5 |"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("limited by ram"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace moraine::bench
