// BenchEngine over the process group ("engine: group-cpu" / "group-cuda"): moraine-bench starts
// its own group with moraine-supervisor (the budgets --vram/--ram are the group's), generates
// through the coordinator's Generate with the prompt as token ids, and reads the coordinator's
// own prefill/decode times. After each run it asks every process for Stats: experts computed per
// tier (gpu_worker: VRAM, cpu_expert_workers: RAM and FILE) give the hit rates and the bytes per
// token per tier; a worker restart (supervisor) or a re-issued step (coordinator) is a fault.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "coordinator/group_launcher.h"
#include "tools/bench/bench_engine.h"
#include "tools/bench/reference_engine.h"

namespace moraine::bench {

struct GroupEngineOptions {
  std::string model;
  std::string backend = "cpu";   // the gpu_worker's backend: cpu or cuda
  int cpu_workers = 1;
  int threads = 0;               // reported only: the supervisor splits every core between the workers
  std::string vram, ram;         // budgets as the supervisor takes them ("12G"; empty: unlimited)
  std::string bin_dir;           // where moraine-supervisor and the workers are
  int max_tokens = 0;            // rows of one step (prefill chunk); 0: the coordinator's choice
  int64_t ctx = 0;               // positions the group plans KV memory for (supervisor --ctx; 0: its default)
  // The gpu_worker's adaptive VRAM tier (moraine-supervisor --vram-adapt-every): 0 by default,
  // so the placement stays what the census (or uniform popularity) made it. Swaps move experts
  // between GPU and CPU arithmetic, which round differently, so a greedy run would not repeat
  // the warm-up's tokens exactly and the bench would call the run non-deterministic.
  int vram_adapt_every = 0;
  // Empty: a fresh /tmp/moraine-bench-XXXXXX, removed at the end. Given: used (created if
  // missing) and kept, with the group's log (group.log) and the census of a warm-up.
  std::string socket_dir;
  std::vector<std::string> supervisor_args;   // appended to the supervisor's start arguments
  bool check_logits = true;                    // SamplingParams::check_logits of every request
  bool speculate = false;                      // GenerateRequest::speculate of every request
};

class GroupEngine final : public BenchEngine {
 public:
  // `m` is the model the bench already opened (shapes and bytes per token; the group maps its own).
  GroupEngine(GroupEngineOptions o, std::unique_ptr<model::Model> m);
  ~GroupEngine() override;
  std::string name() const override { return "group-" + o_.backend; }
  int64_t n_vocab() const override { return model_->hp.n_vocab; }
  int n_threads() const override { return o_.threads; }
  void reset() override;   // zeroes every process's counters (each Generate starts a fresh sequence)
  std::span<const float> prefill(std::span<const int32_t> tokens) override;
  std::span<const float> decode_one(int32_t token) override;
  bool self_timed() const override { return true; }
  Generated generate(std::span<const int32_t> prompt, int64_t n) override;
  EngineStats stats() const override;
  std::string detected_fault() const override;
  bool has_file_tier() const override { return file_tier_; }

  // The census warm-up ("census warm; the second run counts"): generates n tokens after
  // `prompt` so the gpu_worker records which experts the routing used, stops the group (the
  // gpu_worker merges its counts into <socket dir>/census.json at exit), checks the census is
  // there and not empty, and starts the group again so that placement reads it. Without this
  // the group places by uniform popularity (no census is read or written). Throws BenchFault
  // for a faulty warm-up run and std::runtime_error when no census was written.
  void warm_census(std::span<const int32_t> prompt, int64_t n);

 private:
  void start(bool record_census);
  // The workers' counters since their processes started: experts computed per tier (taken: by
  // the device over PCIe, gpu_worker --device-takes-from), then the cpu workers' prefetch
  // counters. They are not zeroed by Stats' reset, so reset() keeps a snapshot and stats()
  // reports the difference.
  enum WorkerCount : size_t {
    kExpertsVram, kExpertsRam, kExpertsFile, kExpertsTaken,
    kPrefetchGuessed, kPrefetchGuessedRight, kPrefetchNeeded, kPrefetchRuns, kPrefetchCutShort,
    kDoorbellSleeps, kPoolSleeps, kSpinCutShort,
    kCacheHits, kCacheMisses, kFileBytes, kReadAheadExperts, kReadAheadUsed,
    kWorkerCounts
  };
  using WorkerCounts = std::array<uint64_t, kWorkerCounts>;
  WorkerCounts worker_counts() const;
  GroupEngineOptions o_;
  WorkerCounts counts_at_reset_{};
  uint64_t tokens_since_reset_ = 0;   // positions computed by the runs since reset() (prompt + n - 1 each)
  bool file_tier_ = false;            // the placement the group started with has FILE-tier experts
  std::array<uint64_t, 3> speculation_counts() const;   // the coordinator's verify_steps, drafted, accepted
  std::array<uint64_t, 3> speculation_at_reset_{};
  std::unique_ptr<model::Model> model_;
  ModelReadBytes bytes_;
  std::string socket_dir_;
  bool own_socket_dir_ = false;
  std::string census_path_;
  std::string census_note_;
  bool census_warm_ = false;   // warm_census ran: placement followed census_path_
  // The placement the group follows, as a long prefill step stages it (manifest, plan, census).
  ExpertStaging staging() const;
  std::unique_ptr<group::LaunchedGroup> group_;
  std::string fault_;
};

// moraine-supervisor beside this executable (a bundle's bin/) or in the build tree
// (<build>/coordinator/); empty when neither exists.
std::string default_group_bin_dir();

}  // namespace moraine::bench
