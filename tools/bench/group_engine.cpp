#include "tools/bench/group_engine.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <stdexcept>
#include <utility>

#include "coordinator/census.h"
#include "coordinator/group_layout.h"
#include "coordinator/placement.h"
#include "coordinator/private_socket.h"
#include "proto/control.grpc.pb.h"
#include "proto/generate.grpc.pb.h"
#include "tools/bench/bench_run.h"

namespace moraine::bench {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> instances(int cpu_workers) {
  std::vector<std::string> v = {group::kSupervisorInstance, group::kCoordinatorInstance, group::kGpuWorkerInstance,
                                "io_worker-0"};
  for (int i = 0; i < cpu_workers; ++i) v.push_back(group::cpu_worker_instance(i));
  return v;
}

control::StatsReply stats_of(const std::string& socket_dir, const std::string& instance, bool reset) {
  auto stub = control::Control::NewStub(
      grpc::CreateChannel(group::control_address(socket_dir, instance), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  control::StatsRequest req;
  req.set_reset(reset);
  control::StatsReply reply;
  const grpc::Status st = stub->Stats(&ctx, req, &reply);
  if (!st.ok()) throw std::runtime_error(instance + ": Stats failed: " + st.error_message());
  return reply;
}

uint64_t counter(const control::StatsReply& r, const char* name) {
  const auto it = r.counters().find(name);
  return it == r.counters().end() ? 0 : it->second;
}

EngineStats::ChainStage chain_stage(const control::StatsReply& r, const char* name) {
  EngineStats::ChainStage c;
  for (const control::StageStats& s : r.stages()) {
    if (s.name() != name) continue;
    c.samples = s.latency().samples();
    c.p50_us = s.latency().p50_us();
    c.p90_us = s.latency().p90_us();
  }
  return c;
}

}  // namespace

std::string default_group_bin_dir() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return {};
  for (const fs::path& cand : {self.parent_path(), self.parent_path().parent_path().parent_path() / "coordinator"}) {
    if (fs::exists(cand / "moraine-supervisor")) return cand.string();
  }
  return {};
}

GroupEngine::GroupEngine(GroupEngineOptions o, std::unique_ptr<model::Model> m)
    : o_(std::move(o)), model_(std::move(m)), bytes_(decode_read_bytes(*model_)) {
  if (o_.bin_dir.empty()) o_.bin_dir = default_group_bin_dir();
  if (o_.bin_dir.empty() || !fs::exists(fs::path(o_.bin_dir) / "moraine-supervisor")) {
    throw std::runtime_error("engine group: moraine-supervisor not found (give --bin-dir)");
  }
  if (o_.socket_dir.empty()) {
    char tmpl[] = "/tmp/moraine-bench-XXXXXX";
    if (!mkdtemp(tmpl)) throw std::runtime_error("engine group: cannot make a socket directory in /tmp");
    socket_dir_ = tmpl;
    own_socket_dir_ = true;
  } else {
    socket_dir_ = o_.socket_dir;
    group::ensure_private_dir(socket_dir_);
  }
  // The bench's own census, never the model's MODEL.census.json: a number must not depend on
  // what earlier runs of the model happened to route.
  census_path_ = socket_dir_ + "/census.json";
  std::error_code ec;
  fs::remove(census_path_, ec);
  census_note_ = "none: uniform expert popularity (no census read or written; --census-warmup runs one first)";
  start(false);
}

void GroupEngine::start(bool record_census) {
  group_.reset();
  group::LaunchOptions lo;
  lo.supervisor = (fs::path(o_.bin_dir) / "moraine-supervisor").string();
  lo.socket_dir = socket_dir_;
  lo.log_path = socket_dir_ + "/group.log";
  lo.start_args = {"-m", o_.model, "--bin-dir", o_.bin_dir, "--cpu-workers", std::to_string(o_.cpu_workers),
                   "--backend", o_.backend, "--max-tokens", std::to_string(o_.max_tokens), "--census", census_path_,
                   "--vram-adapt-every", std::to_string(o_.vram_adapt_every), "--ctx", std::to_string(o_.ctx)};
  // Placement reads the census when the file is there (after a warm-up); only the warm-up run writes it.
  if (!record_census) lo.start_args.push_back("--no-census");
  if (!o_.vram.empty()) lo.start_args.insert(lo.start_args.end(), {"--vram", o_.vram});
  if (!o_.ram.empty()) lo.start_args.insert(lo.start_args.end(), {"--ram", o_.ram});
  lo.start_args.insert(lo.start_args.end(), o_.supervisor_args.begin(), o_.supervisor_args.end());
  // Loading a large model can take minutes from a slow disk.
  lo.ready_timeout = std::chrono::minutes(20);
  group_ = std::make_unique<group::LaunchedGroup>(lo);
  file_tier_ = false;
  try {
    if (const ExpertStaging st = staging(); std::find(st.tier.begin(), st.tier.end(), uint8_t{2}) != st.tier.end()) file_tier_ = true;
  } catch (const std::exception&) {
    // No plan to read: stats() says why; no cold-cache run.
  }
}

void GroupEngine::warm_census(std::span<const int32_t> prompt, int64_t n) {
  start(true);
  reset();
  fault_.clear();
  const Generated g = generate(prompt, n);
  if (!fault_.empty()) throw BenchFault("census warm-up run: the engine reports a fault: " + fault_);
  if (static_cast<int64_t>(g.ids.size()) != n) {
    throw BenchFault("census warm-up run: the engine returned " + std::to_string(g.ids.size()) + " tokens, expected " +
                     std::to_string(n));
  }
  group_->stop();   // the gpu_worker flushes its census at exit
  std::uint64_t routed = 0;
  try {
    const group::Census c = group::Census::read(census_path_, model_->hp.n_layer, model_->hp.n_expert);
    for (const auto& layer : c.counts) {
      for (std::uint64_t x : layer) routed += x;
    }
  } catch (const std::exception& e) {
    throw std::runtime_error("census warm-up: no usable census after the warm-up run (" + std::string(e.what()) +
                             "); does the gpu_worker record one? see " + socket_dir_ + "/group.log");
  }
  if (routed == 0) throw std::runtime_error("census warm-up: the census " + census_path_ + " counts no routing");
  start(false);
  census_warm_ = true;
  census_note_ = "warm: " + std::to_string(routed) + " expert routings recorded by a warm-up run (" +
                 std::to_string(prompt.size()) + "-token prompt + " + std::to_string(n) +
                 " tokens), then the group restarted and placed by them";
}

GroupEngine::~GroupEngine() {
  group_.reset();
  std::error_code ec;
  if (own_socket_dir_) fs::remove_all(socket_dir_, ec);
}

void GroupEngine::reset() {
  // A process that does not answer between runs has died (and is being restarted): the run
  // about to start, and the one before it, cannot be trusted.
  for (const std::string& inst : instances(o_.cpu_workers)) {
    try {
      stats_of(socket_dir_, inst, true);
    } catch (const std::exception& e) {
      fault_ = std::string(e.what()) + " (a process of the group died or is restarting)";
      throw BenchFault(fault_);
    }
  }
  counts_at_reset_ = worker_counts();
  speculation_at_reset_ = speculation_counts();
  tokens_since_reset_ = 0;
}

std::array<uint64_t, 3> GroupEngine::speculation_counts() const {
  try {
    const control::StatsReply c = stats_of(socket_dir_, group::kCoordinatorInstance, false);
    return {counter(c, "verify_steps"), counter(c, "drafted_tokens"), counter(c, "accepted_draft_tokens")};
  } catch (const std::exception& e) {
    throw BenchFault(std::string("speculation counters: ") + e.what() + " (the coordinator died or is restarting)");
  }
}

GroupEngine::WorkerCounts GroupEngine::worker_counts() const {
  // Summed over the cpu workers.
  static constexpr std::pair<WorkerCount, const char*> kCpuWorker[] = {
      {kExpertsRam, "experts_ram"},           {kExpertsFile, "experts_file"},
      {kPrefetchGuessed, "prefetch_guessed"}, {kPrefetchGuessedRight, "prefetch_guessed_right"},
      {kPrefetchNeeded, "prefetch_needed"},   {kPrefetchRuns, "prefetch_runs"},
      {kPrefetchCutShort, "prefetch_cut_short"}, {kDoorbellSleeps, "doorbell_sleeps"},
      {kPoolSleeps, "pool_sleeps"},           {kSpinCutShort, "spin_cut_short"},
      {kCacheHits, "cache_hits"},             {kCacheMisses, "cache_misses"},
      {kFileBytes, "file_bytes_fetched"},     {kReadAheadExperts, "read_ahead_experts"},
      {kReadAheadUsed, "read_ahead_used"}};
  WorkerCounts c{};
  try {
    const control::StatsReply g = stats_of(socket_dir_, group::kGpuWorkerInstance, false);
    c[kExpertsVram] = counter(g, "experts_vram");
    c[kExpertsTaken] = counter(g, "experts_device_taken");   // RAM-tier experts the device copied in and computed
    for (int i = 0; i < o_.cpu_workers; ++i) {
      const control::StatsReply r = stats_of(socket_dir_, group::cpu_worker_instance(i), false);
      for (const auto& [at, name] : kCpuWorker) c[at] += counter(r, name);
    }
  } catch (const std::exception& e) {
    throw BenchFault(std::string("hit rates: ") + e.what() + " (a process of the group died or is restarting)");
  }
  return c;
}

std::span<const float> GroupEngine::prefill(std::span<const int32_t>) {
  throw std::logic_error("engine group is self-timed: use generate()");
}
std::span<const float> GroupEngine::decode_one(int32_t) {
  throw std::logic_error("engine group is self-timed: use generate()");
}

BenchEngine::Generated GroupEngine::generate(std::span<const int32_t> prompt, int64_t n) {
  auto stub = generate::Coordinator::NewStub(grpc::CreateChannel(
      group::control_address(socket_dir_, group::kCoordinatorInstance), grpc::InsecureChannelCredentials()));
  generate::GenerateRequest req;
  for (int32_t id : prompt) req.mutable_token_ids()->add_ids(static_cast<uint32_t>(id));
  generate::SamplingParams& sp = *req.mutable_sampling();
  sp.set_temperature(0);
  sp.set_max_tokens(static_cast<uint32_t>(n));
  sp.set_ignore_eos(true);
  sp.set_check_logits(o_.check_logits);
  req.set_speculate(o_.speculate);
  // Every run prefills the whole prompt: the same prompt again would come from the prefix cache
  // (H200, 30B: "pp8192 565,043 tok/s" with it).
  req.set_no_prompt_cache(true);
  grpc::ClientContext ctx;
  auto reader = stub->Generate(&ctx, req);
  tokens_since_reset_ += prompt.size() + static_cast<uint64_t>(std::max<int64_t>(n, 1)) - 1;
  Generated g;
  generate::GenerateChunk chunk;
  std::string error;
  while (reader->Read(&chunk)) {
    for (uint32_t id : chunk.token_ids()) g.ids.push_back(static_cast<int32_t>(id));
    if (!chunk.error().empty()) error = chunk.error();
    if (chunk.has_timing()) {
      g.prefill_s = static_cast<double>(chunk.timing().prefill_us()) * 1e-6;
      g.decode_s = static_cast<double>(chunk.timing().decode_us()) * 1e-6;
    }
  }
  const grpc::Status st = reader->Finish();
  if (!st.ok()) error = "Generate: " + st.error_message();
  if (!error.empty()) fault_ = error;
  // Faults of the processes (restarts, re-issued steps) since reset().
  if (fault_.empty()) {
    try {
      if (const uint64_t r = counter(stats_of(socket_dir_, group::kSupervisorInstance, false), "restarts")) {
        fault_ = std::to_string(r) + " worker restart(s)";
      } else if (const uint64_t s = counter(stats_of(socket_dir_, group::kCoordinatorInstance, false), "steps_reissued")) {
        fault_ = std::to_string(s) + " re-issued step(s)";
      }
    } catch (const std::exception& e) {
      fault_ = std::string(e.what()) + " (a process of the group died or is restarting)";
    }
  }
  return g;
}

std::string GroupEngine::detected_fault() const { return fault_; }

ExpertStaging GroupEngine::staging() const {
  const group::GroupManifest man = group::GroupManifest::read(group::manifest_path(socket_dir_));
  const group::ModelSizes sizes = group::model_sizes(*model_, group::planned_context(*model_, o_.ctx));
  const group::PlacementPlan plan =
      group::PlacementPlan::read(man.placement_path.empty() ? group::placement_path(socket_dir_) : man.placement_path, sizes);
  ExpertStaging st;
  st.n_expert = plan.n_expert;
  st.n_expert_used = model_->hp.n_expert_used;
  st.long_step_rows = man.long_step_rows;
  st.window_rows = man.max_tokens;
  st.expert_bytes.assign(sizes.expert_bytes.begin(), sizes.expert_bytes.end());
  for (const group::Tier t : plan.tiers) st.tier.push_back(t == group::Tier::kVram ? 0 : t == group::Tier::kRam ? 1 : 2);
  if (census_warm_) {
    const group::Census c = group::Census::read(census_path_, model_->hp.n_layer, model_->hp.n_expert);
    for (const auto& layer : c.counts)
      for (const std::uint64_t x : layer) st.popularity.push_back(static_cast<double>(x));
    st.popularity_note = "the warm-up run's census (the routing placement was made from)";
  } else {
    st.popularity_note = "uniform k/E: the bench has no census (--census-warmup records one)";
  }
  if (o_.vram_adapt_every > 0) st.popularity_note += "; the VRAM tier adapts while running, the plan's tiers are the start";
  return st;
}

EngineStats GroupEngine::stats() const {
  // Experts computed per tier over the last run: the counters since reset() (measured on the
  // H200, 12G Z1 -p 8192: the counts since start, prefill steps included, said 59% VRAM hits
  // where the decode had 87%). A process that restarted since lost its counters: no hit rate.
  uint64_t device_used = 0;
  EngineStats::ChainStage routed_wait, expert_handoff, expert_cpu;
  try {
    const control::StatsReply g = stats_of(socket_dir_, group::kGpuWorkerInstance, false);
    device_used = counter(g, "device_used_bytes");
    routed_wait = chain_stage(g, "routed_wait");
    expert_handoff = chain_stage(g, "expert_handoff");
    for (int i = 0; i < o_.cpu_workers; ++i) {   // the hand-off waits for the slowest worker
      const EngineStats::ChainStage w = chain_stage(stats_of(socket_dir_, group::cpu_worker_instance(i), false), "expert_cpu");
      if (w.p50_us >= expert_cpu.p50_us) expert_cpu = w;
    }
    if (const uint64_t r = counter(stats_of(socket_dir_, group::kSupervisorInstance, false), "restarts")) {
      throw BenchFault("hit rates: " + std::to_string(r) + " worker restart(s) since the group started");
    }
  } catch (const BenchFault&) {
    throw;
  } catch (const std::exception& e) {
    throw BenchFault(std::string("hit rates: ") + e.what() + " (a process of the group died or is restarting)");
  }
  const WorkerCounts now = worker_counts();
  WorkerCounts d{};   // over the last run
  for (size_t t = 0; t < now.size(); ++t) {
    if (now[t] < counts_at_reset_[t]) throw BenchFault("hit rates: a worker's expert counter went back (restarted?)");
    d[t] = now[t] - counts_at_reset_[t];
  }
  const double vram = static_cast<double>(d[kExpertsVram]);
  const double ram = static_cast<double>(d[kExpertsRam]);
  const double file = static_cast<double>(d[kExpertsFile]);
  const double taken = static_cast<double>(d[kExpertsTaken]);
  EngineStats s;
  s.budgets_applied = true;
  s.census = census_note_;
  s.device_used_bytes = device_used;
  const std::array<uint64_t, 3> spec = speculation_counts();
  s.verify_steps = spec[0] - speculation_at_reset_[0];
  s.drafted_tokens = spec[1] - speculation_at_reset_[1];
  s.accepted_draft_tokens = spec[2] - speculation_at_reset_[2];
  s.prefetch_guessed = d[kPrefetchGuessed];
  s.prefetch_guessed_right = d[kPrefetchGuessedRight];
  s.prefetch_needed = d[kPrefetchNeeded];
  s.prefetch_runs = d[kPrefetchRuns];
  s.prefetch_cut_short = d[kPrefetchCutShort];
  s.doorbell_sleeps = d[kDoorbellSleeps];
  s.pool_sleeps = d[kPoolSleeps];
  s.spin_cut_short = d[kSpinCutShort];
  s.file_cache = {d[kCacheHits], d[kCacheMisses], d[kFileBytes], d[kReadAheadExperts], d[kReadAheadUsed], tokens_since_reset_};
  s.routed_wait = routed_wait;
  s.expert_handoff = expert_handoff;
  s.expert_cpu = expert_cpu;
  const double total = vram + ram + file + taken;
  const bool on_gpu = o_.backend == "cuda";
  // The CPU backend's placement too (reported, and read by the CPU-only tests), without a bound.
  if (!on_gpu) s.staging_none = "the group's CPU backend computes every expert on the CPU (no host->device copies, no GPU GEMMs)";
  try {
    s.staging = staging();
    s.staging->device_computes = on_gpu;
  } catch (const std::exception& e) {
    s.staging_none = std::string("the group's placement could not be read: ") + e.what();
  }
  // Dense weights live where the backend computes: device memory, or RAM for the CPU backend.
  s.bytes_per_token[static_cast<int>(on_gpu ? Tier::Vram : Tier::Ram)] += bytes_.dense;
  s.placed_bytes_per_token[on_gpu ? 0 : 1] += bytes_.dense;
  if (total > 0) {
    const int vram_tier = static_cast<int>(on_gpu ? Tier::Vram : Tier::Ram);
    // FILE-tier experts found in the file cache are read from RAM; the misses were read from
    // the disk on demand (hits + misses = experts_file: every FILE-tier expert computed).
    const double hits = static_cast<double>(std::min(d[kCacheHits], d[kExpertsFile]));
    s.hit_rate[vram_tier] += vram / total;
    s.hit_rate[static_cast<int>(Tier::Ram)] += (ram + hits) / total;
    s.hit_rate[static_cast<int>(Tier::Disk)] += (file - hits) / total;
    // The device's copies over the bus: the PCIe tier, read beside the cpu workers' DRAM (the CPU
    // backend computes them from RAM).
    const int taken_tier = static_cast<int>(on_gpu ? Tier::Pcie : Tier::Ram);
    s.hit_rate[taken_tier] += taken / total;
    s.expert_reads[taken_tier] += d[kExpertsTaken];
    s.expert_reads[vram_tier] += d[kExpertsVram];
    s.expert_reads[static_cast<int>(Tier::Ram)] += d[kExpertsRam] + static_cast<uint64_t>(hits);
    s.expert_reads[static_cast<int>(Tier::Disk)] += d[kExpertsFile] - static_cast<uint64_t>(hits);
    for (int t = 0; t < kTierCount; ++t) {
      if (t != static_cast<int>(Tier::Disk)) s.bytes_per_token[t] += bytes_.experts * s.hit_rate[t];
    }
    s.placed_bytes_per_token[0] += bytes_.experts * vram / total;
    s.placed_bytes_per_token[1] += bytes_.experts * (ram + taken) / total;
    s.placed_bytes_per_token[2] += bytes_.experts * file / total;
  }
  // What the disk delivered: the bytes the cpu workers had read from the model file (demand
  // misses and read-ahead, used or not) over the run's positions; an estimate from the misses
  // alone would leave out what the read-ahead read.
  if (s.file_cache.tokens > 0) {
    s.bytes_per_token[static_cast<int>(Tier::Disk)] =
        static_cast<double>(s.file_cache.bytes_read) / static_cast<double>(s.file_cache.tokens);
  }
  return s;
}

}  // namespace moraine::bench
