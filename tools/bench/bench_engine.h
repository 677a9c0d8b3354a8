// The engine moraine-bench drives. Every way moraine runs a model (the in-process CPU reference
// today; the process group with its CUDA and CPU-expert workers later) plugs in here, so the
// bench, its fault checks and its bound stay one piece of code whatever runs underneath.
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace moraine::bench {

// Where weight bytes come from during a decode step. Each tier is read at its own measured
// bandwidth: vram at device memory bandwidth, pcie (host to device copies) at pinned
// host-to-device bandwidth, ram at all-core DRAM read bandwidth, disk at O_DIRECT read.
enum class Tier { Vram = 0, Pcie = 1, Ram = 2, Disk = 3 };
inline constexpr int kTierCount = 4;
inline constexpr std::array<const char*, kTierCount> kTierNames = {"vram", "pcie", "ram", "disk"};

// What a long prefill step (coordinator --long-step-rows) copies host->device, from the placement
// the engine follows: the bound of prefill_bound.h estimates from it the distinct experts a step
// uses. Plain numbers, so engines and tests fill it without the group's headers.
struct ExpertStaging {
  int64_t n_expert = 0, n_expert_used = 0;
  int64_t long_step_rows = 0;   // rows of a long step; 0: the engine runs none
  int64_t window_rows = 0;      // rows per window of a long step (--max-tokens): each GEMM call's rows
  std::vector<double> expert_bytes;      // [layer] gate + up + down of one expert
  // [layer * n_expert + expert]: 1 = RAM tier (staged over PCIe by a long step), 2 = FILE tier
  // (computed by the cpu workers after a disk read), 0 = VRAM (no copy).
  std::vector<uint8_t> tier;
  // [layer * n_expert + expert] routing counts of a census; empty: uniform popularity.
  std::vector<double> popularity;
  std::string popularity_note;  // where popularity came from, or why uniform
  // false: the engine's long steps run on the CPU (the group's CPU backend): nothing crosses
  // PCIe, no GPU GEMM; the placement is still reported (EngineStats::staging_none says why no bound).
  bool device_computes = true;
};

// The tiers an expert is placed in (coordinator/placement.h), for bytes per token by placement.
inline constexpr int kPlacedCount = 3;
inline constexpr std::array<const char*, kPlacedCount> kPlacedNames = {"vram", "ram", "file"};

struct EngineStats {
  // Weight bytes one decode token reads from each tier (expected value over the routing). With a
  // file cache, a FILE-tier expert found in the cache is read from RAM, and disk is what the
  // run read from the model file per token (measured: the misses' reads and the read-ahead).
  std::array<double, kTierCount> bytes_per_token{};
  // Share of expert reads served by each tier (sums to 1 over the tiers that serve any): disk
  // is the FILE-tier experts read on demand (cache misses), their hits count as RAM.
  std::array<double, kTierCount> hit_rate{};
  // Weight bytes one decode token computes by where the placement put them: VRAM, RAM (the RAM
  // tier; the dense part where the backend computes), FILE (every FILE-tier expert, hit or miss).
  // Sums to the model's bytes per token. Zero for engines without a placement.
  std::array<double, kPlacedCount> placed_bytes_per_token{};
  // Experts computed by each tier over the last run (what hit_rate is the share of); 0 for
  // engines that do not count them.
  std::array<uint64_t, kTierCount> expert_reads{};
  bool budgets_applied = false;  // false: --vram/--ram were recorded but this engine ignores them
  // Where the placement's expert popularity came from ("warm: ..." after a census warm-up run,
  // "none: uniform ..."); empty for engines without a placement.
  std::string census;
  // Device memory in use after a step, the most the gpu_worker saw since the group started (the
  // driver's figure for the whole device); 0 without a device. Printed beside the --vram budget.
  uint64_t device_used_bytes = 0;
  // Speculation over the last run (the group's coordinator with --speculate): verify steps,
  // tokens drafted and accepted. Zero without it.
  uint64_t verify_steps = 0, drafted_tokens = 0, accepted_draft_tokens = 0;
  // The cpu workers' idle-time prefetch over the last run (cpu_expert_worker
  // --ffn-prefetch-next-layer): experts prefetched before a layer's request, how many of them the
  // request asked for, and how many it asked for in all; prefetches started, and how many of them
  // the next request cut short. Zero without cpu workers.
  uint64_t prefetch_guessed = 0, prefetch_guessed_right = 0, prefetch_needed = 0, prefetch_runs = 0, prefetch_cut_short = 0;
  // The cpu workers' sleeps over the last run: the doorbell thread's futex waits before a request,
  // the expert threads' between job lists, and polls cut short because a CPU looked shared. While
  // tokens are generated all three should stay near zero; many mean wake-ups on the chain
  // (session 15 runs B and C, 12G decode: a slowed worker at 41 tok/s showed 3421 expert-thread
  // sleeps, the normal runs at 152-182 tok/s 24-256; docs/perf-log.md#session-15-cpu-sleeps).
  uint64_t doorbell_sleeps = 0, pool_sleeps = 0, spin_cut_short = 0;
  // The cpu workers' file cache over the last run (cpu_expert_worker/expert_cache.h): FILE-tier
  // experts computed from a cached slot (hits) or after reading them (misses), the bytes read from
  // the model file (misses and read-ahead), experts read ahead and of those used; and the
  // positions of the run (prompt + generated - 1: the last token is never fed back), for
  // per-token figures. Zero without a FILE tier.
  struct FileCache {
    uint64_t hits = 0, misses = 0, bytes_read = 0, read_ahead = 0, read_ahead_used = 0, tokens = 0;
  } file_cache;
  // The hand-off chain of the last run, per layer whose experts the cpu workers share (a decode
  // run's steps are all one token): the gpu_worker's wait for the device to publish the layer's
  // routing (what the device does between two hand-offs: fetching and combining the rows, the
  // next layer's norm, attention and router, the publish), its wait for the cpu workers (ring to
  // answer), and the slowest cpu worker's call itself (request seen to answer rung). p50 / p90
  // over each stage's last 4096 samples (StageRecorder's window); samples 0 where the stage did
  // not run (everything on the device, the reference engine).
  struct ChainStage {
    double p50_us = 0, p90_us = 0;
    uint64_t samples = 0;
  };
  ChainStage routed_wait, expert_handoff, expert_cpu;
  // The placement a long prefill step stages from; nullopt with staging_none saying why (an engine
  // without a GPU, a backend that runs no long steps).
  std::optional<ExpertStaging> staging;
  std::string staging_none = "the engine computes on the CPU (no host->device copies, no GPU GEMMs)";
};

class BenchEngine {
 public:
  virtual ~BenchEngine() = default;
  // Printed beside every number ("cpu-reference", later "group-cuda"...).
  virtual std::string name() const = 0;
  virtual int64_t n_vocab() const = 0;
  virtual int n_threads() const = 0;
  // Forgets every cached token (each timed run starts from an empty context).
  virtual void reset() = 0;
  // Runs the prompt; returns the last token's logits (valid until the next call).
  virtual std::span<const float> prefill(std::span<const int32_t> tokens) = 0;
  // Feeds one token after the cached ones; returns its logits (valid until the next call).
  virtual std::span<const float> decode_one(int32_t token) = 0;
  virtual EngineStats stats() const = 0;

  // Engines that sample inside themselves (the process group: the coordinator samples and
  // streams tokens) time their own steps instead of being driven token by token: greedy
  // generation of n tokens after the prompt, with the engine's own prefill and decode times
  // (decode_s covers the n - 1 steps after the prefill produced the first token).
  struct Generated {
    std::vector<int32_t> ids;
    double prefill_s = 0;
    double decode_s = 0;
  };
  virtual bool self_timed() const { return false; }
  virtual Generated generate(std::span<const int32_t> prompt, int64_t n) {
    (void)prompt;
    (void)n;
    return {};
  }
  // A fault the engine saw since reset() that invalidates the run's timing or output (a worker
  // restart, a retried transfer); empty when none. The in-process reference has none to see.
  virtual std::string detected_fault() const { return {}; }
  // Whether some experts stay in the model file behind a host cache: the bench then times one
  // decode run first, while that cache is cold (the engine just started), beside the warm runs.
  virtual bool has_file_tier() const { return false; }
};

}  // namespace moraine::bench
