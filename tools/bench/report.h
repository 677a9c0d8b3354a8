// What one moraine-bench invocation measured, and its two renderings: a llama-bench-like
// markdown table for people and JSON for machines.
#pragma once
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tools/bench/bandwidth_probe.h"
#include "tools/bench/bench_engine.h"
#include "tools/bench/bench_run.h"
#include "tools/bench/bound.h"
#include "tools/bench/prefill_bound.h"

namespace moraine::bench {

struct ModelSummary {
  std::string path;
  std::string arch;
  uint64_t file_bytes = 0;
  int64_t n_layer = 0, n_expert = 0, n_expert_used = 0;
  PrefillModel prefill{};   // FLOPs per prompt token and the expert shape (prefill_model)
};

// One decode figure of an engine with a FILE tier: cold (the first run after the engine started,
// BenchEngine::has_file_tier) or warm (the counted decode runs, the stats of the last).
struct FileTierRun {
  Timing decode;
  EngineStats stats;
  DiskBound disk;   // from stats.file_cache and the measured O_DIRECT rate
};
struct FileTierRuns {
  FileTierRun cold, warm;
};

struct BenchReport {
  std::string engine;
  ModelSummary model;
  int threads = 0;
  int repeat = 0;
  std::optional<uint64_t> vram_budget, ram_budget;
  std::vector<Timing> prefill;
  Timing decode;
  EngineStats stats;
  std::array<Measured, kTierCount> bandwidth;  // per tier, as measured (or why not)
  // The RAM and PCIe tiers measured at once (measure_dram_beside_h2d): whether the bound's
  // "tiers read concurrently" holds for the two on this host.
  Measured ram_beside_pcie, pcie_beside_ram;
  Bound bound;
  std::optional<double> share_of_bound;  // decode tok/s over the bound
  GemmRates gemm;                        // the prefill GEMM probe (engine path and cuBLAS BF16) at a window's rows
  // The engine path at a whole long step's rows per expert (what a window as long as the step
  // would see); not used by the bound, which follows the engine's windows.
  GemmRates gemm_step;
  std::vector<PrefillBound> prefill_bound;  // one per prefill timing, same order
  std::optional<FileTierRuns> file_tier;    // nullopt: the engine has no FILE tier
};

nlohmann::json report_json(const BenchReport& r);
void print_table(const BenchReport& r, std::ostream& out);

}  // namespace moraine::bench
