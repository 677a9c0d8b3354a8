// moraine-bench's command line, separated from main() so tests can drive it with an engine of
// their own (a fault injector) and check the exit status and the message.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "tools/bench/bench_engine.h"
#include "tools/bench/report.h"

namespace moraine::bench {

struct BenchOptions {
  std::string model;
  bool json = false;
  int64_t n_gen = 64;
  std::vector<int64_t> prompt_lengths{512, 8192};
  std::optional<uint64_t> vram_budget, ram_budget;
  int threads = 0;  // 0: all cores
  int repeat = 2;   // runs per test; the first is the warm-up
  int64_t dram_probe_mib = 1024;
  int64_t disk_probe_mib = 1024;
  int64_t gpu_probe_mib = 256;
  // Which engine runs the model: "cpu-reference" (in-process) or "group" (the process group,
  // started by the bench with the budgets above).
  std::string engine = "cpu-reference";
  std::string backend = "cpu";    // group: the gpu_worker's backend
  int cpu_workers = 1;            // group: cpu_expert_workers
  std::string bin_dir;            // group: where moraine-supervisor is (default: found beside the bench)
  std::string vram_text, ram_text;  // the budgets as given, passed on to the group
  bool census_warmup = false;     // group: one run to record the census, restart, then measure
  int vram_adapt_every = 0;       // group: the gpu_worker's adaptive VRAM tier (0: off)
  std::string socket_dir;         // group: where its sockets and logs go (default: a fresh temp dir)
  std::vector<std::string> supervisor_args;  // group: appended to `moraine-supervisor start` (A/B of its flags)
  // group: every sampled row's logits checked finite by the coordinator (SamplingParams::check_logits),
  // which then reads them; off: greedy tokens come from the gpu_worker without the logits copy.
  bool check_logits = true;
  // group: greedy requests with speculation (suffix drafts) (GenerateRequest::speculate).
  bool speculate = false;
  // group: positions the group plans KV memory for (moraine-supervisor --ctx). 0: what the runs
  // need, the longest prompt + n + 1 (the census warm-up's run), as llama-bench sizes n_ctx to
  // its test; the supervisor's own default, min(4096, the model's), cannot run pp8192.
  int64_t ctx = 0;
};

struct EngineUnderTest {
  std::unique_ptr<BenchEngine> engine;
  ModelSummary model;
};
using EngineFactory = std::function<EngineUnderTest(const BenchOptions&)>;

// "12G", "512M", "1.5T", "4096" (bytes). Throws std::invalid_argument naming the text.
uint64_t parse_size(const std::string& text);

// Parses argv, builds the engine, runs, prints. Returns 0, 1 for a refused (faulty) run or a
// bad input, 2 for a bad command line; every refusal says why on `err`.
int bench_main(int argc, char** argv, const EngineFactory& make_engine, std::ostream& out, std::ostream& err);

}  // namespace moraine::bench
