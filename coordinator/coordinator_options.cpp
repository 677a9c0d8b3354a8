// moraine-coordinator's options and what follows from them (coordinator_options.h).
#include "coordinator/coordinator_options.h"

#include <fstream>
#include <iostream>
#include <stdexcept>

#include "coordinator/device_reserve.h"
#include "coordinator/disk_estimate.h"
#include "coordinator/group_layout.h"

namespace moraine::group {


// --kv-type, or its default: f16 with the CUDA backend (llama.cpp's default cache type: half the
// VRAM of F32, which then holds experts), f32 with the CPU backend, whose reference executor
// holds floats (its cache would be charged at 2 bytes and use 4).
model::KvType kv_type_for(const CoordinatorOptions& o) {
  if (o.kv_type.empty()) return o.backend == "cuda" ? model::KvType::F16 : model::KvType::F32;
  const model::KvType t = model::parse_kv_type(o.kv_type, "--kv-type");
  if (t == model::KvType::F16 && o.backend != "cuda")
    throw std::invalid_argument("--kv-type f16 needs --backend cuda (the CPU backend holds an F32 cache)");
  return t;
}

// --long-step-rows, or its default: 8192 rows with the CUDA backend, which stages the RAM tier's
// experts over PCIe for long steps (a layer's copies once per 8192 rows instead of once per 512:
// at the 30B shape, 12G, the copies alone bound 512-row steps to ~2,300 tok/s), none with the CPU
// backend (nothing to stage); at most the context, and 0 when not above --max-tokens.
int long_step_rows_for(const CoordinatorOptions& o, const model::Model& m) {
  const int64_t rows = o.long_step_rows >= 0 ? o.long_step_rows : o.backend == "cuda" ? 8192 : 0;
  const int64_t fit = std::min<int64_t>(rows, group::planned_context(m, o.ctx));
  return fit > o.max_tokens && o.step_channel == "doorbell" ? static_cast<int>(fit) : 0;
}

// The placement every process of the group follows: planned once, here (`log`: its lines to stderr).
// census_out: the popularity the plan was made from (empty: uniform).
group::PlacementPlan plan_for(const CoordinatorOptions& o, const model::Model& m, bool log, group::Census* census_out) {
  group::PlacementInput in;
  in.sizes = group::model_sizes(m, group::planned_context(m, o.ctx), kv_type_for(o));
  // Batched decode: each of the --parallel sequence slots holds its own KV cache and recurrent
  // state for the whole context (GroupManifest::slots), charged here like the first.
  const std::int64_t seq_slots = o.batch_decode ? std::max(o.parallel, 1) : 1;
  in.sizes.kv_bytes *= static_cast<std::uint64_t>(seq_slots);
  in.sizes.kv_slots = seq_slots;
  if (o.backend == "cuda") {
    in.sizes.device_reserve_bytes = group::cuda_device_reserve_bytes(m, o.max_tokens, in.sizes.context, 0, 0, seq_slots);
    in.sizes.dense_bytes -= group::cuda_host_resident_bytes(m);
  }
  // "dense": exactly the dense weights, KV/state (and a CUDA device's context and scratch), no experts: what a gpu_worker on its CPU
  // backend gets by default, so that the cpu_expert_workers compute the routed experts.
  in.vram_budget = o.vram == "dense" ? in.sizes.dense_bytes + in.sizes.kv_bytes + in.sizes.device_reserve_bytes
                                     : group::parse_byte_budget(o.vram, "--vram");
  in.ram_budget = group::parse_byte_budget(o.ram, "--ram");
  if (o.file_cache != "auto") in.file_cache_budget = group::parse_byte_budget(o.file_cache, "--file-cache");
  in.n_cpu_workers = o.cpu_workers;
  const std::string census = o.census.empty() ? group::default_census_path(o.model) : o.census;
  if (std::ifstream(census).good()) {
    try {
      in.census = group::Census::read(census, m.hp.n_layer, m.hp.n_expert);
      if (log) std::cerr << "coordinator: expert popularity from " << census << "\n";
    } catch (const std::exception& e) {
      // A census named on the command line is the user's input: refuse it. The default one is
      // ours (the gpu_worker writes it and replaces a bad one), so a bad one must not stop the
      // group from starting.
      if (!o.census.empty()) throw;
      if (log) std::cerr << "coordinator: ignoring " << e.what() << " (uniform popularity; the gpu_worker will replace it)\n";
    }
  } else if (log) {
    std::cerr << "coordinator: no census at " << census << " yet (uniform popularity)\n";
  }
  if (census_out) *census_out = in.census;
  group::PlacementPlan plan = group::plan_placement(in);
  // Long steps stage a layer's whole RAM tier and its cached FILE tier at once
  // (group::long_step_stage_slots), whose slots the reserve must hold; holding them moves experts
  // out of VRAM into RAM, so plan again until
  // the slots cover the plan's layers (a slot more each round: ~2.7 MB of 9 GB of experts at the
  // 30B shape, so two or three rounds).
  if (const int long_rows = long_step_rows_for(o, m); o.backend == "cuda" && long_rows > 0) {
    int64_t slots = 0;
    for (int round = 0;; ++round) {
      const int64_t need = group::long_step_stage_slots(plan);
      if (need <= slots) break;
      if (round == 8) throw std::logic_error("coordinator: the long steps' staging slots did not settle (" + std::to_string(need) + ")");
      slots = need + 1;
      const uint64_t grown = group::cuda_device_reserve_bytes(m, o.max_tokens, in.sizes.context, long_rows, slots, seq_slots);
      if (o.vram == "dense") in.vram_budget += grown - in.sizes.device_reserve_bytes;   // still exactly the dense part
      in.sizes.device_reserve_bytes = grown;
      plan = group::plan_placement(in);
    }
  }
  if (log) std::cerr << "coordinator: " << plan.table() << group::plan_disk_line(o.disk_rate, m, plan, in.census);
  return plan;
}

// --max-tokens 0: 512 rows, except where long steps stage the RAM tier on the device (CUDA) and
// a longer window costs no expert its VRAM: the longest of 4096, 2048 and 1024 that leaves the
// device as many experts as 512 rows do. A window's GEMMs get more rows per expert the longer it
// is, but its scratch (~0.4 MB a row) takes VRAM the experts would hold, and decode and short
// prompts read those (30B shape, --vram 12G, one H200 run, windows 512 / 2048 / 4096: pp8192
// 7,170 / 9,554 / 11,811 tok/s, pp512 2,712 / 2,498 / 2,327, tg 124 / 104 / 109, VRAM hit
// 0.57 / 0.53 / 0.48; docs/perf-log.md#session-21-windows). --max-tokens 4096 is the long-prompt setting.
int window_rows_for(const CoordinatorOptions& o, const model::Model& m) {
  CoordinatorOptions at = o;
  at.max_tokens = 512;
  if (o.backend != "cuda" || long_step_rows_for(at, m) == 0) return 512;
  const group::PlacementPlan base = plan_for(at, m, false);
  for (const int rows : {4096, 2048, 1024}) {
    at.max_tokens = rows;
    if (long_step_rows_for(at, m) == 0) continue;   // not below the long step's rows
    group::PlacementPlan p;
    try {
      p = plan_for(at, m, false);
    } catch (const std::invalid_argument&) {
      continue;   // this window's scratch does not fit --vram beside the dense weights and KV
    }
    if (p.vram.experts >= base.vram.experts) return rows;
  }
  return 512;
}

void add_coordinator_options(CLI::App& app, CoordinatorOptions& o) {
  app.add_option("-m,--model", o.model, "GGUF model file")->required();
  app.add_option("--socket-dir", o.socket_dir, "group socket directory")->required();
  app.add_option("--cpu-workers", o.cpu_workers, "number of cpu_expert_workers (experts interleaved over them)");
  app.add_option("--max-tokens", o.max_tokens,
                 "rows of one step (prefill chunk), or of a long step's window; sizes the exchange segment and the device "
                 "scratch (default 0: 512, or with --backend cuda's long steps up to 4096 as --vram allows)");
  app.add_option("--long-step-rows", o.long_step_rows,
                 "rows of a long prefill step, run by the gpu_worker layer by layer over windows of --max-tokens rows "
                 "(default: 8192 with --backend cuda, none with cpu; 0: none)");
  app.add_flag("--print-plan", o.print_plan,
               "print the step rows and the placement these options give (to stdout), then exit without starting");
  app.add_option("--handoff", o.handoff, "per-layer GPU<->CPU hand-off")->check(CLI::IsMember({"doorbell", "zmq"}));
  app.add_option("--logits-dump", o.logits_dump, "append each sampled row's float32 logits to FILE (tests)");
  app.add_option("--step-retries", o.step_retries, "times a failed step is re-issued");
  app.add_option("--vram", o.vram, "GPU memory for dense weights, KV, the CUDA context and scratch (--backend cuda) and experts (12G, 512M, ..., unlimited; dense: no experts)");
  app.add_option("--ram", o.ram, "expert arena in RAM: RAM-tier experts + the file cache for file-resident ones (unlimited)");
  app.add_option("--file-cache", o.file_cache,
                 "of --ram, what the cache of file-resident experts takes when some stay in the file (at least the slots one "
                 "layer needs; default auto: a quarter of --ram)");
  app.add_option("--disk-rate", o.disk_rate,
                 "disk read rate for the plan's disk bound, bytes per second (1.5G; K/M/G powers of 1024); default auto: "
                 "~0.25 s of O_DIRECT reads of the model file at start, when some experts stay in the file");
  app.add_option("--census", o.census,
                 "expert popularity counts (JSON), read for placement and merged into by the gpu_worker "
                 "(default MODEL.census.json)");
  app.add_flag("--no-census", o.no_census, "the gpu_worker writes no census (placement still reads one)");
  app.add_option("--vram-adapt-every", o.vram_adapt_every,
                 "steps between the gpu_worker's swaps of popular experts into VRAM (0: keep the placement's set)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--ctx", o.ctx, "context the KV budget is planned for (default min(4096, the model's))");
  app.add_option("--step-channel", o.step_channel,
                 "how a step reaches the gpu_worker: doorbell (shared memory) or zmq (a LayerStep round trip)")
      ->check(CLI::IsMember({"doorbell", "zmq"}));
  app.add_option("--step-spin-us", o.step_spin_us, "how long the wait for a step's answer spins before it sleeps")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--speculate-draft", o.speculate_draft,
                 "tokens a suffix draft proposes at most, for requests that ask for speculation (0: never draft)")
      ->check(CLI::Range(0, static_cast<int>(group::kMaxTokenRows) - 1));
  app.add_option("--speculate-mtp", o.speculate_mtp,
                 "tokens the model's MTP head drafts at most, for requests that ask for speculation, where the model has "
                 "one (a nextn block) and the backend runs it (cpu; else the suffix drafter); 0: suffix drafts only")
      ->check(CLI::Range(0, static_cast<int>(group::kMaxTokenRows) - 1));
  app.add_option("--speculate-min-match", o.speculate_min_match,
                 "shortest recurring context suffix a draft follows")
      ->check(CLI::Range(1, 1 << 20));
  app.add_flag("--greedy-on-host", o.greedy_on_host,
               "greedy decode copies the logits and takes their argmax here (default: the gpu_worker returns the token)");
  app.add_option("--backend", o.backend, "the gpu_worker's backend: cuda charges the device's context and scratch to --vram")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--kv-type", o.kv_type,
                 "KV cache element type, charged to --vram and held by the gpu_worker: f16 (default with --backend "
                 "cuda) or f32 (default, and the only one, with cpu)")
      ->check(CLI::IsMember({"f16", "f32"}));
  app.add_option("--parallel", o.parallel,
                 "requests that take turns on the gpu_worker at once (each runs --turn-tokens tokens while others "
                 "wait, its sequence saved in the gpu_worker's store meanwhile); more wait to be admitted")
      ->check(CLI::Range(1, 256));
  app.add_flag("--batch-decode", o.batch_decode,
               "the --parallel requests decode together: each step carries one row per decoding request, every chosen "
               "expert read once for all (each slot's KV charged to --vram; no speculation or prompt cache for them yet)");
  app.add_option("--prefill-chunk", o.prefill_chunk,
                 "--batch-decode: prompt rows per batched step, beside the decoding requests' rows, so that they keep "
                 "streaming while a new request prefills (0: a new prompt runs as steps of its own between them)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--batch-queue", o.batch_queue,
                 "--batch-decode: requests that wait for a sequence slot beyond --parallel, taking them in arrival "
                 "order; more are refused at once (RESOURCE_EXHAUSTED)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--turn-tokens", o.turn_tokens, "tokens a request's turn runs before it yields to a waiting one")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--cache-ram", o.cache_ram,
                 "host memory the gpu_worker keeps earlier conversations' KV cache and recurrent state in, so that a "
                 "request continuing any of them prefills only its new tokens (least recently used out; default 8G; "
                 "0: only the last conversation is reused)");
}

}  // namespace moraine::group
