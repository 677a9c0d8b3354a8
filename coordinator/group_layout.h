// What every process of the group derives the same way from the model and the manifest: where
// the sockets are, how the exchange segment is carved, where each layer's experts sit in the
// arena, which worker owns which expert, and how one layer's routing becomes expert jobs.
// The coordinator creates the segments and writes the manifest (<socket-dir>/group.json) last,
// so a worker that can read the manifest can map everything it names.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/shm/shm_layout.h"
#include "coordinator/placement.h"

namespace moraine::group {

struct GroupManifest {
  std::string model_path;
  std::string group_prefix;
  std::string exchange_locator;
  std::string arena_locator;
  std::uint32_t coordinator_pid = 0;
  std::uint64_t coordinator_start_ticks = 0;
  int n_cpu_workers = 1;
  int max_tokens = 0;           // rows of one step (prefill chunk), or of one window of a long step
  // Rows of a long step (0: none): a prompt goes to the gpu_worker this many tokens a step, which
  // runs each layer over windows of max_tokens rows (gpu_worker/backend.h, Backend::set_window),
  // so a layer's staged RAM-tier experts cross PCIe once per long step, not once per window.
  int long_step_rows = 0;
  bool zmq_handoff = false;     // per-layer GPU<->CPU hand-off over ZeroMQ instead of doorbells
  std::string placement_path;   // the PlacementPlan (coordinator/placement.h) every process follows
  // Where the gpu_worker merges the routing counts it records (coordinator/census.h): the
  // coordinator's --census, else default_census_path(model); empty with --no-census (no writing).
  std::string census_path;
  // The census file the placement looked for popularity in (written or not: --no-census empties
  // census_path only); the cpu workers seed their file caches' heat from it when it is there.
  std::string placement_census_path;
  // The VRAM tier adapts while running: every this many steps the gpu_worker swaps experts used
  // more than a resident one (by a margin) into the device; 0 = the placement's set stays.
  int vram_adapt_every = 8;
  // How the coordinator hands the gpu_worker a step: "doorbell" (the exchange's step doorbells,
  // coordinator/step_bell.h) or "zmq" (a LayerStep / JobReply round trip per step).
  std::string step_channel = "doorbell";
  // Sequence slots the gpu_worker's backend keeps (BackendOptions::slots): batched steps
  // (StepHeader::segments) carry rows of up to this many sequences (coordinator --batch-decode).
  int slots = 1;

  void write(const std::string& path) const;   // atomically (temp file + rename)
  static GroupManifest read(const std::string& path);  // throws std::runtime_error naming the file
};

std::string manifest_path(const std::string& socket_dir);
std::string placement_path(const std::string& socket_dir);   // "<dir>/placement.json"
// gRPC Control endpoint of an instance ("unix:<dir>/<instance>.sock"); instance names have no '/'.
std::string control_address(const std::string& socket_dir, const std::string& instance);
// ZeroMQ data-plane endpoint ("ipc://<dir>/<instance>.jobs").
std::string jobs_endpoint(const std::string& socket_dir, const std::string& instance);
// Shared-memory name prefix of the group living in socket_dir: stable across restarts so the
// next start reclaims what a killed coordinator left.
std::string group_prefix_for(const std::string& socket_dir);
std::string cpu_worker_instance(int index);   // "cpu_expert_worker-<index>"
inline constexpr const char* kCoordinatorInstance = "coordinator";
inline constexpr const char* kGpuWorkerInstance = "gpu_worker-0";
inline constexpr const char* kIoWorkerInstance = "io_worker-0";
inline constexpr const char* kSupervisorInstance = "supervisor";

// Rows of one sequence slot in a batched step (StepHeader::segments; gpu_worker/backend.h,
// Backend::set_segments). Before the step, per segment in order: reset (1: forget the slot's
// sequence), rewind (1: drop its cached positions from first_position on), snapshot (1: save its
// recurrent state, a verify segment on a model with DeltaNet layers); then first_position must be
// what the slot caches. logit_rows: logits and greedy tokens of the segment's last logit_rows rows.
struct StepSegment {
  std::uint32_t slot;
  std::uint32_t first_position;
  std::uint32_t rows;
  std::uint32_t logit_rows;
  std::uint32_t reset;
  std::uint32_t rewind;
  std::uint32_t snapshot;
};
// Sequences of one batched step: one decode row each fills StepReply::row_tokens (kMaxTokenRows
// greedy tokens), and 16 rows is the CUDA backend's largest captured decode step, the size a
// batched decode graph would be built for first.
inline constexpr std::size_t kMaxSegments = 16;

// Written by the coordinator before it sends a step to the gpu_worker.
struct StepHeader {
  std::uint64_t step_seq;
  std::uint32_t n_tokens;
  std::uint32_t logit_rows;   // last logit_rows rows of the step get logits (1 or n_tokens)
  std::uint32_t reset;        // 1: forget the cached sequence before this step
  std::uint32_t first_position;
  // 1: greedy decode without the logits: the gpu_worker puts the argmax of the last logits row
  // (sampling::argmax's rule) in StepReply::token, computed where the logits are, and need not
  // write the logits rows (the CUDA backend copies 4 bytes instead of 607 KB per token).
  std::uint32_t greedy_token;
  // 1 (with greedy_token): also report the last row's first non-finite logit in
  // StepReply::nonfinite (SamplingParams::check_logits without the logits crossing).
  std::uint32_t check_finite;
  // 1: the gpu_worker first drops the cached positions from first_position on (the draft tokens
  // the previous verify step rejected; Backend::rewind). 0: first_position must be what is cached.
  std::uint32_t rewind;
  // 1: the gpu_worker saves the recurrent (DeltaNet) state before the step (Backend::snapshot): a
  // verify step on a model with recurrent layers, which a rejection rewinds to first_position.
  std::uint32_t snapshot;
  // The conversation cache (coordinator --cache-ram): the gpu_worker keeps saved sequences in its
  // own host memory by key, and before the step (before reset / rewind) first drops the keys in
  // state_drop (0: unused), then with state_save != 0 saves the cached sequence's first
  // state_save_positions positions under that key (dropping the positions past them first, as a
  // rewind would), then with state_load != 0 makes the sequence saved under that key the cached
  // one and forgets the key (the step's first_position then counts from it).
  std::uint64_t state_drop[8];
  std::uint64_t state_save;
  std::uint32_t state_save_positions;
  std::uint64_t state_load;
  // MTP speculation (the model's nextn block; Backend::can_mtp). 1: the gpu_worker also runs the
  // MTP head over this step's rows, extending its own KV cache (every step of a sequence that
  // drafts with it, prefill included; a step without it leaves the head behind: no drafts until
  // a reset). With mtp_drafts > 0 (and greedy_token) it then drafts up to that many tokens,
  // greedily along the MTP chain, after the row decode goes on from: in a verify window
  // (logit_rows > 1) the first logit row whose greedy token is not the window's next token
  // (accepted_prefix's rule), else the last row. StepReply::mtp_* has them.
  std::uint32_t mtp;
  std::uint32_t mtp_drafts;
  // Sequence slots (GroupManifest::slots). slot: the slot a step of one sequence (n_segments 0)
  // runs on, and the one the conversation cache's state_* operations act on in any step.
  // n_segments 1..kMaxSegments: a batched step, its n_tokens rows those of segments[0 ..
  // n_segments) in order (n_tokens their sum, logit_rows the sum of theirs, at most max_tokens
  // rows: no long step), and reset / rewind / snapshot / first_position above unused (0; the
  // segments have their own); no MTP. StepReply::row_tokens then holds the logit rows segment by
  // segment and StepReply::segment_token each segment's last.
  std::uint32_t slot;
  std::uint32_t n_segments;
  StepSegment segments[kMaxSegments];
};
inline constexpr std::size_t kMaxStateDrops = 8;

// Rows of one step whose greedy tokens the gpu_worker returns (StepReply::row_tokens): a verify
// window is the last token plus at most kMaxTokenRows - 1 drafted ones.
inline constexpr std::size_t kMaxTokenRows = 16;

// Written by the gpu_worker once a step is done (both step channels), before it rings the step
// done doorbell (doorbell channel) or replies over ZeroMQ.
inline constexpr std::size_t kStepErrorBytes = 1024;
struct StepReply {
  std::uint64_t seq;            // the step answered
  std::uint32_t ok;             // 1: done; 0: failed, `error` says why
  std::int32_t token;           // StepHeader::greedy_token: the last row's argmax; else -1
  // StepHeader::check_finite: the last row's first non-finite logit as index * 2 + 1 for a NaN,
  // index * 2 for an infinity; -1 when finite or not asked. Written by the step before `ok`.
  std::int32_t nonfinite;
  // StepHeader::greedy_token with logit_rows R <= kMaxTokenRows: every row's argmax and (with
  // check_finite) first non-finite logit, rows in order; `token` / `nonfinite` repeat row R - 1.
  std::int32_t row_tokens[kMaxTokenRows];
  std::int32_t row_nonfinite[kMaxTokenRows];
  // StepHeader::state_save: the bytes the saved sequence takes in the gpu_worker (0: none saved);
  // state_store_bytes: all the sequences it holds after the step's drops, save and load.
  std::uint64_t state_saved_bytes;
  std::uint64_t state_store_bytes;
  // StepHeader::mtp_drafts: the drafts, which follow logit row mtp_row's greedy token
  // (row_tokens[mtp_row]); mtp_n_drafts -1 when none could be made (the backend has no MTP head,
  // the head fell behind the sequence) or none were asked.
  std::int32_t mtp_n_drafts;
  std::int32_t mtp_row;
  std::int32_t mtp_draft[kMaxTokenRows];
  // A batched step (StepHeader::n_segments) with greedy_token: each segment's last logit row's
  // greedy token, segment order (-1 past n_segments).
  std::int32_t segment_token[kMaxSegments];
  std::uint32_t error_bytes;    // of `error`, at most kStepErrorBytes
  char error[kStepErrorBytes];
};

// Written by the gpu_worker before it rings the workers' request doorbells.
struct ExpertRequest {
  std::uint64_t seq;
  std::uint32_t layer;
  std::uint32_t n_tokens;
  // A RAM-tier expert of this layer the gpu_worker computes itself this time (it copies the
  // arena slot over PCIe while the workers compute the rest; gpu_worker --device-takes-from), or
  // -1: the workers skip it as they skip resident ones.
  std::int32_t device_expert;
  // n > 0: the gpu_worker computes every RAM-tier expert of this layer with at least n rows in
  // the step itself (a long step's Backend::stage_experts); the workers compute the other
  // RAM-tier ones and their FILE-tier ones. 0: none staged.
  std::uint32_t device_stages_from_rows;
  // FILE-tier experts of this layer named by the gpu_worker (bit e of `marked`: expert e), read
  // per `mode` (ExpertRequestMode): the ones the device computes from the file cache this time
  // (the workers skip them), the ones to read into the cache before it looks (kFill), or the ones
  // whose cache slot was refilled under the device's copy (kRedo: only those, computed here).
  std::uint32_t mode;
  std::uint64_t marked[8];
};
inline constexpr std::int64_t kMaxMarkedExperts = 8 * 64;   // ExpertRequest::marked's bits

enum ExpertRequestMode : std::uint32_t {
  kComputeRequest = 0,   // compute the plan's experts of this worker, but the marked FILE-tier ones
  kFillRequest = 1,      // compute nothing: the marked FILE-tier experts of this worker into its file cache
  kRedoRequest = 2,      // compute only the marked experts of this worker (their rows of the plan)
};
inline bool expert_marked(const ExpertRequest& r, std::int64_t e) {
  return e >= 0 && e < kMaxMarkedExperts && ((r.marked[e / 64] >> (e % 64)) & 1) != 0;
}

// Written by a cpu worker that cannot compute request `seq` (its FILE-tier reads failed: a read
// error, a truncated shard) before it rings its done doorbell with that seq: the gpu_worker then
// fails the step with this text instead of waiting out its deadline. A later seq means no error.
struct WorkerError {
  std::uint64_t seq;
  std::uint32_t bytes;   // of text, at most kStepErrorBytes
  char text[kStepErrorBytes];
};

// ExpertRequest::device_stages_from_rows' rule, one place for both sides (the gpu_worker stages by
// it, the cpu workers skip by it): a RAM-tier expert with `rows` rows in the step is the device's.
// It reads the placement's tier, which every process has whatever its backend and options (the
// arena layout exists only where the arena is mapped).
inline bool device_stages(std::uint32_t from_rows, Tier tier, std::int32_t rows) {
  return from_rows > 0 && tier == Tier::kRam && rows >= static_cast<std::int32_t>(from_rows);
}

// Segment ids announced for job validation (ShmRef.segment_id).
inline constexpr std::uint32_t kExchangeSegmentId = 1;
inline constexpr std::uint32_t kArenaSegmentId = 2;   // the expert arena the io_worker fills

// The exchange segment: small headers, then the per-step tensors, then one request and one done
// doorbell per cpu_expert_worker.
struct ExchangeLayout {
  shm::ShmLayout layout;
  static ExchangeLayout build(const model::HParams& hp, int max_tokens, int n_cpu_workers, int long_step_rows = 0);
  const shm::Region& region(const char* name) const { return layout.region(name); }
  static std::size_t request_bell(int worker) { return static_cast<std::size_t>(2 * worker); }
  static std::size_t done_bell(int worker) { return static_cast<std::size_t>(2 * worker + 1); }
};
// Region names: "step" StepHeader, "expert_req" ExpertRequest, "tokens" int32[max(max_tokens, long_step_rows)],
// "hidden" float[max_tokens][n_embd] (normalised MoE input), "chosen" int32[max_tokens][k],
// "step_reply" StepReply, "step_server" StepServerRecord (coordinator/step_bell.h), "step_bells"
// two doorbells (step request, step done), "weights" float[max_tokens][k], "expert_out" float[max_tokens * k][n_embd] (packed per expert,
// see ExpertPlan), "logits" float[max_tokens][n_vocab], "resident" uint8[n_layer][n_expert] (1:
// the gpu_worker computes that expert now; it writes this between steps, the cpu workers skip
// those experts), "worker_errors" WorkerError[n_cpu_workers], "bells" doorbells.

// The expert arena (coordinator/placement.h decides what is in it): one compact slot per
// RAM-tier expert, in (layer, expert) order, then per cpu worker plan.cache_slots file-cache
// slots that FILE-tier experts are read into and kept in (cpu_expert_worker/expert_cache.h), then
// the cache's directory: a CacheSlotHeader (coordinator/expert_cache_directory.h) per cache slot,
// worker by worker, so any process mapping the arena can find and check a cached expert. An
// expert's gate, up and down parts each start on a 4 KiB boundary (the bracket O_DIRECT reads
// need when the io_worker fills them). Every process derives it from the model and the plan
// file, so offsets agree.
struct ArenaLayout {
  struct ExpertSlot {
    std::array<std::size_t, 3> offset{};   // gate, up, down: byte offset in the arena
    std::array<std::size_t, 3> bytes{};
  };
  std::int64_t n_expert = 0;
  std::vector<std::int32_t> ram_index;   // [layer * n_expert + expert]: index into ram_slots, -1 unless RAM
  std::vector<ExpertSlot> ram_slots;
  std::size_t cache_offset = 0;          // first cache slot (worker 0, slot 0)
  std::size_t cache_slot_bytes = 0;
  std::int64_t cache_slots = 0;          // per worker
  std::size_t directory_offset = 0;      // CacheSlotHeader of worker 0's slot 0; worker w's start at w * cache_slots
  std::size_t total_bytes = 0;

  static ArenaLayout build(const model::Model& m, const PlacementPlan& plan);
  const ExpertSlot& ram_slot(std::int64_t il, std::int64_t e) const {
    return ram_slots[static_cast<std::size_t>(ram_index[static_cast<std::size_t>(il * n_expert + e)])];
  }
  // Where layer il's expert parts go in cache slot `slot` of cpu worker `worker`.
  ExpertSlot cache_slot(const model::Model& m, std::int64_t il, int worker, std::int64_t slot) const;
  // Byte offset of cpu worker `worker`'s first directory entry.
  std::size_t directory_of(int worker) const {
    return directory_offset + static_cast<std::size_t>(worker) * static_cast<std::size_t>(cache_slots) * kCacheSlotHeaderBytes;
  }
  // Bytes of one arena slot of layer il: its three parts, each rounded up to 4 KiB (the span from
  // the gate's offset to the end of the down part's rounding).
  static std::size_t slot_bytes(const model::MoeWeights& moe);
  // Where the gate, up and down parts start in such a slot (0 for the gate).
  static std::array<std::size_t, 3> part_offsets(const model::MoeWeights& moe);
  // Gate, up and down of expert (il, e) as matrices reading from `s` in `arena`.
  static std::array<model::Matrix, 3> bind(const model::Model& m, std::int64_t il, std::int64_t e,
                                           const ExpertSlot& s, const std::byte* arena);
};

// Where expert e's gate (0), up (1) or down (2) rows of layer il sit in the model file.
struct FileRange {
  std::uint32_t file_index = 0;   // shard
  std::uint64_t offset = 0;       // from the start of that shard
  std::uint64_t bytes = 0;
};
FileRange expert_file_range(const model::Model& m, std::int64_t il, std::int64_t e, int which);

// Interleaved so that both workers get a share of every layer's popular low ids.
inline int expert_owner(std::int64_t expert, int n_cpu_workers) {
  return static_cast<int>(expert % n_cpu_workers);
}

// One layer's routing as expert jobs: slots (t * k + s) grouped by expert in ascending id, each
// expert's rows packed contiguously in expert_out in ascending slot order. Both the gpu_worker
// (to build job lists and to find slot outputs) and the workers (doorbell path) compute it.
struct ExpertPlan {
  std::vector<std::int32_t> start;     // [n_expert + 1]: packed row range of expert e
  std::vector<std::int32_t> slot_of;   // [max_tokens * k]: packed row -> slot
  std::vector<std::int32_t> row_of;    // [max_tokens * k]: slot -> packed row
  std::vector<std::int32_t> cursor;    // [n_expert]: fill position while building
  void reserve(std::int64_t n_expert, std::int64_t max_slots);
  void build(const std::int32_t* chosen, std::int64_t n_slots, std::int64_t n_expert);
  std::int32_t count(std::int64_t e) const { return start[e + 1] - start[e]; }
};

}  // namespace moraine::group
