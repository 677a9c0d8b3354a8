#include "tools/bench/bench_cli.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <sstream>
#include <tuple>

#include "tools/bench/bandwidth_probe.h"
#include "tools/bench/bench_run.h"
#include "tools/bench/bound.h"
#include "tools/bench/prefill_bound.h"

namespace moraine::bench {

uint64_t parse_size(const std::string& text) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = used ? text.substr(used) : "";
  if (!unit.empty() && (unit.back() == 'B' || unit.back() == 'b')) unit.pop_back();
  if (!unit.empty() && (unit.back() == 'i')) unit.pop_back();  // GiB == G: sizes are binary
  double scale = 0;
  if (unit.empty()) scale = 1;
  else if (unit == "K" || unit == "k") scale = 1024.0;
  else if (unit == "M" || unit == "m") scale = 1024.0 * 1024;
  else if (unit == "G" || unit == "g") scale = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "t") scale = 1024.0 * 1024 * 1024 * 1024;
  if (used == 0 || scale == 0 || !std::isfinite(v) || v < 0) {
    throw std::invalid_argument("'" + text + "' is not a size (e.g. 12G, 512M, 4096)");
  }
  return static_cast<uint64_t>(v * scale);
}

namespace {

// The prefill bound of every timed prompt length; the GEMM probe runs only for an engine that
// stages experts for a GPU (what it would time is that engine's path).
void prefill_bounds(BenchReport& r, const TierBandwidth& bw) {
  const PrefillModel& pm = r.model.prefill;
  if (r.stats.staging && r.stats.staging->device_computes) {
    // Each matmul_experts call of a long step covers one window: its rows per expert under uniform routing.
    const ExpertStaging& st = *r.stats.staging;
    const auto per_expert = [&](int64_t rows) {
      return std::clamp<int64_t>(pm.n_expert > 0 ? rows * pm.n_expert_used / pm.n_expert : 0, 1, 512);
    };
    r.gemm = measure_prefill_gemm(pm, per_expert(st.window_rows));
    if (st.long_step_rows > st.window_rows) r.gemm_step = measure_prefill_gemm(pm, per_expert(st.long_step_rows), false);
  } else {
    r.gemm.engine_note = r.gemm.cublas_note = "not measured: " + r.stats.staging_none;
  }
  for (const Timing& t : r.prefill) {
    PrefillBound b = prefill_bound(t.n_tokens, pm, r.stats.staging, r.stats.staging_none, bw[static_cast<int>(Tier::Pcie)],
                                   bw[static_cast<int>(Tier::Disk)], r.gemm);
    if (b.tok_s) b.share = t.tok_s / *b.tok_s;
    r.prefill_bound.push_back(b);
  }
}

BenchReport run_all(const BenchOptions& o, EngineUnderTest& eut) {
  BenchEngine& e = *eut.engine;
  BenchReport r;
  r.engine = e.name();
  r.model = eut.model;
  r.threads = e.n_threads();
  r.repeat = o.repeat;
  r.vram_budget = o.vram_budget;
  r.ram_budget = o.ram_budget;
  // Runs first: a faulty run ends the bench before minutes of probing. With a FILE tier, one
  // decode run before anything else fills the file cache: the cold-cache figure.
  std::optional<FileTierRun> cold;
  if (e.has_file_tier()) {
    cold = FileTierRun{time_decode_once(e, o.n_gen), {}, {}};
    cold->stats = e.stats();
  }
  for (int64_t n : o.prompt_lengths) r.prefill.push_back(time_prefill(e, bench_prompt(n, e.n_vocab()), o.repeat));
  r.decode = time_decode(e, o.n_gen, o.repeat);
  r.stats = e.stats();
  if (cold) {
    const auto diff = std::mismatch(cold->decode.output.begin(), cold->decode.output.end(), r.decode.output.begin(), r.decode.output.end());
    if (diff.first != cold->decode.output.end() || diff.second != r.decode.output.end()) {
      throw BenchFault("tg" + std::to_string(o.n_gen) + " cold-cache run: greedy output differs from the warm runs' at token " +
                       std::to_string(diff.first - cold->decode.output.begin()) + " (non-deterministic engine)");
    }
    r.file_tier = FileTierRuns{*cold, {r.decode, r.stats, {}}};
  }
  // The engine (for the group: the processes holding the GPU) goes before the GPU probes: the
  // probes' own CUDA context and buffers beside it added ~0.5 GiB to the device memory that
  // bench/side-by-side measures for the row (H200: the gpu_worker 13.5 GiB, nvidia-smi 14.1).
  eut.engine.reset();

  const size_t gpu_bytes = static_cast<size_t>(o.gpu_probe_mib) << 20;
  r.bandwidth[static_cast<int>(Tier::Vram)] = measure_device_memory(gpu_bytes);
  r.bandwidth[static_cast<int>(Tier::Pcie)] = measure_pinned_h2d(gpu_bytes);
  r.bandwidth[static_cast<int>(Tier::Ram)] = measure_dram_read(static_cast<size_t>(o.dram_probe_mib) << 20);
  r.bandwidth[static_cast<int>(Tier::Disk)] = measure_disk_read(o.model, static_cast<size_t>(o.disk_probe_mib) << 20);
  std::tie(r.ram_beside_pcie, r.pcie_beside_ram) =
      measure_dram_beside_h2d(static_cast<size_t>(o.dram_probe_mib) << 20, gpu_bytes);

  TierBandwidth bw;
  for (int t = 0; t < kTierCount; ++t) bw[t] = r.bandwidth[t].bytes_per_s;
  r.bound = decode_bound(r.stats.bytes_per_token, bw);
  if (r.file_tier) {
    for (FileTierRun* run : {&r.file_tier->cold, &r.file_tier->warm}) {
      run->disk = disk_bound(run->stats.file_cache, run->decode.tok_s, bw[static_cast<int>(Tier::Disk)]);
    }
  }
  if (r.bound.tok_s) r.share_of_bound = r.decode.tok_s / *r.bound.tok_s;
  prefill_bounds(r, bw);
  return r;
}

}  // namespace

int bench_main(int argc, char** argv, const EngineFactory& make_engine, std::ostream& out, std::ostream& err) {
  CLI::App app{"moraine-bench: prefill and decode tok/s beside the bound of this machine's measured bandwidths"};
  BenchOptions o;
  std::string vram, ram;
  std::string lengths = "512,8192";
  app.add_option("-m,--model", o.model, "GGUF model file")->required();
  app.add_flag("--json", o.json, "print one JSON object instead of the tables");
  app.add_option("-n,--n-gen", o.n_gen, "decode tokens per run (temperature 0)")->check(CLI::PositiveNumber);
  app.add_option("-p,--prompt-lengths", lengths, "prefill prompt lengths, comma-separated");
  app.add_option("--vram", vram, "VRAM budget (e.g. 12G); recorded, applied by engines that can");
  app.add_option("--ram", ram, "RAM budget (e.g. 32G); recorded, applied by engines that can");
  app.add_option("--engine", o.engine, "cpu-reference (in-process) or group (the process group, budgets applied)")
      ->check(CLI::IsMember({"cpu-reference", "group"}))->capture_default_str();
  app.add_option("--backend", o.backend, "group: the gpu_worker's backend (cpu or cuda)")
      ->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_option("--cpu-workers", o.cpu_workers, "group: cpu_expert_workers")->check(CLI::Range(1, 64));
  app.add_option("--vram-adapt-every", o.vram_adapt_every,
                 "group: steps between the gpu_worker's expert swaps into VRAM (0, the default: the placement "
                 "stays; swaps change which side computes an expert, so greedy runs stop repeating exactly)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--bin-dir", o.bin_dir, "group: where moraine-supervisor and the workers are");
  app.add_flag("--census-warmup", o.census_warmup,
               "group: first a run of the longest prompt + n tokens that records the expert census, then "
               "restart the group so placement reads it, then measure (default: uniform placement)");
  app.add_option("--ctx", o.ctx,
                 "group: context the group plans KV memory for (0, the default: the longest prompt + n + 1)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--check-logits,!--no-check-logits", o.check_logits,
               "group: the coordinator checks every sampled row's logits finite (default; off: the gpu_worker returns "
               "the greedy token and the logits stay on the device)");
  app.add_flag("--speculate", o.speculate,
               "group: decode with drafts (the model's MTP head, else suffix drafts from the context) verified several tokens a step (same tokens as greedy; the "
               "report gives drafted and accepted counts)");
  app.add_option("--supervisor-arg", o.supervisor_args,
                 "group: an extra argument for `moraine-supervisor start` (repeat; e.g. --supervisor-arg=--reserve-cores=2)")
      ->allow_extra_args(false);
  app.add_option("--socket-dir", o.socket_dir, "group: socket and log directory, kept (default: a temp dir, removed)");
  app.add_option("-t,--threads", o.threads, "engine threads (0 = all cores)")->check(CLI::NonNegativeNumber);
  app.add_option("-r,--repeat", o.repeat, "runs per test; the first is the warm-up and is not counted")
      ->check(CLI::Range(2, 1000));
  app.add_option("--dram-probe-mib", o.dram_probe_mib, "buffer of the DRAM read probe")->check(CLI::Range(1, 1 << 20));
  app.add_option("--disk-probe-mib", o.disk_probe_mib, "bytes of the model file the O_DIRECT probe reads")
      ->check(CLI::Range(8, 1 << 24));
  app.add_option("--gpu-probe-mib", o.gpu_probe_mib, "buffer of the GPU probes")->check(CLI::Range(1, 1 << 16));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e, out, err) == 0 ? 0 : 2;
  }
  try {
    if (!vram.empty()) o.vram_budget = parse_size(vram);
    if (!ram.empty()) o.ram_budget = parse_size(ram);
    if ((o.census_warmup || !o.socket_dir.empty() || o.ctx > 0 || !o.supervisor_args.empty()) && o.engine != "group") {
      throw std::invalid_argument("--census-warmup, --socket-dir, --ctx and --supervisor-arg need --engine group");
    }
    o.vram_text = vram;
    o.ram_text = ram;
    o.prompt_lengths.clear();
    std::stringstream ss(lengths);
    for (std::string item; std::getline(ss, item, ',');) {
      const uint64_t n = parse_size(item);
      if (n == 0) throw std::invalid_argument("--prompt-lengths: 0 is not a prompt length");
      o.prompt_lengths.push_back(static_cast<int64_t>(n));
    }
  } catch (const std::exception& e) {
    err << "moraine-bench: " << e.what() << "\n";
    return 2;
  }
  try {
    EngineUnderTest eut = make_engine(o);
    const BenchReport r = run_all(o, eut);
    if (o.json) {
      out << report_json(r).dump(1) << "\n";
    } else {
      print_table(r, out);
    }
    return 0;
  } catch (const BenchFault& e) {
    err << "moraine-bench: refusing to report numbers from a faulty run: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    err << "moraine-bench: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace moraine::bench
