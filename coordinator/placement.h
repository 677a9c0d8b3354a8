// Placement: which memory tier holds each routed expert (layer, expert) of a model, decided once
// by the coordinator from the budgets and written beside the group manifest; every other process
// reads that file and never re-plans (so nobody can disagree about where an expert lives).
//   VRAM: the gpu_worker computes it (Backend::routed_experts) from its own copy of the weights.
//   RAM:  copied into a compact slot of the shared arena; its owning cpu_expert_worker computes it.
//   FILE: stays in the model file; the owning cpu_expert_worker has the io_worker read it into one
//         of its file-cache slots in the arena (when a step routes a token to it, or ahead of the
//         layer from the next-layer guess), computes it, and keeps it there until a hotter expert
//         needs the slot (cpu_expert_worker/expert_cache.h).
// Order of filling: dense weights + KV/recurrent state for the context first in VRAM (a budget
// too small for that is an error), then the most popular experts of every layer into VRAM, then
// RAM, the rest FILE. Each tier gives every layer an equal share of its budget first, so one
// layer cannot take the tier; what the shares leave over goes to the most popular experts left.
#pragma once
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/model/kv_type.h"
#include "common/model/model.h"
#include "coordinator/census.h"   // Census: the popularity placement orders experts by

namespace moraine::group {

enum class Tier : std::uint8_t { kVram, kRam, kFile };
const char* tier_name(Tier t);   // "VRAM", "RAM", "FILE"

inline constexpr std::uint64_t kUnlimitedBytes = std::numeric_limits<std::uint64_t>::max();
inline constexpr std::uint64_t kAutoFileCache = kUnlimitedBytes - 1;
// "12G", "512M", "1.5GiB", "4096", "unlimited" (K/M/G/T are powers of 1024). Throws
// std::invalid_argument naming `what` (the flag) and the text.
std::uint64_t parse_byte_budget(const std::string& text, const std::string& what);
std::string format_bytes(std::uint64_t bytes);   // "1.50 GiB", "unlimited"

// Arena parts (gate, up, down of one expert) start on 4 KiB boundaries: the bracket an O_DIRECT
// read by the io_worker needs, and what RAM-tier slots are charged against the RAM budget.
inline constexpr std::uint64_t kArenaAlign = 4096;
inline std::uint64_t arena_align(std::uint64_t n) { return (n + kArenaAlign - 1) / kArenaAlign * kArenaAlign; }

// What placement needs to know about a model.
struct ModelSizes {
  std::int64_t n_layer = 0, n_expert = 0, n_expert_used = 0;
  std::uint64_t dense_bytes = 0;         // every tensor but the trunk layers' routed experts
  std::uint64_t kv_bytes = 0;            // KV cache + recurrent state for `context` tokens, of kv_slots sequences
  // Sequences the gpu_worker caches at once (coordinator --batch-decode: --parallel), each with
  // its own KV cache and recurrent state, all charged in kv_bytes.
  std::int64_t kv_slots = 1;
  model::KvType kv_type = model::KvType::F32;   // the KV cache's elements (recurrent state: floats)
  // Device memory the gpu_worker holds beside weights and KV (context, scratch:
  // coordinator/device_reserve.h); charged against a --vram budget. 0: not on a GPU.
  std::uint64_t device_reserve_bytes = 0;
  std::int64_t context = 0;
  std::vector<std::uint64_t> expert_bytes;       // [layer] gate + up + down of one expert
  std::vector<std::uint64_t> expert_slot_bytes;  // [layer] the same with each part 4 KiB aligned
};
// The KV cache counted at kv_type's element size (an F16 cache: 2 bytes, what the CUDA backend then
// holds), the recurrent state as float32.
ModelSizes model_sizes(const model::Model& m, std::int64_t context, model::KvType kv_type = model::KvType::F32);
// The context the coordinator plans for: `requested` (> 0) capped by the model's
// {arch}.context_length when it has one; 0 asks for min(4096, context_length).
std::int64_t planned_context(const model::Model& m, std::int64_t requested);

struct PlacementInput {
  ModelSizes sizes;
  std::uint64_t vram_budget = kUnlimitedBytes;
  std::uint64_t ram_budget = kUnlimitedBytes;   // the arena: RAM-tier slots + the FILE tier's cache
  int n_cpu_workers = 1;
  Census census;                                // empty: uniform
  // Of ram_budget, what the FILE tier's cache takes when anything is left in the file (at least
  // the staging slots a layer needs); kAutoFileCache: a quarter of ram_budget.
  std::uint64_t file_cache_budget = kAutoFileCache;
};

struct TierTotals {
  std::int64_t experts = 0;
  std::uint64_t bytes = 0;   // RAM: slot bytes (aligned); VRAM and FILE: tensor bytes
};

struct PlacementPlan {
  std::int64_t n_layer = 0, n_expert = 0;
  int n_cpu_workers = 1;
  // FILE-tier experts one worker must hold at once to compute a layer (0 when nothing is FILE),
  // and the file-cache slots of staging_slot_bytes each worker has in the arena (>= staging_slots:
  // the rest keep what was read for later tokens).
  std::int64_t staging_slots = 0;
  std::int64_t cache_slots = 0;
  std::uint64_t staging_slot_bytes = 0;
  std::vector<Tier> tiers;   // [layer * n_expert + expert]
  // Inputs, kept for the log and the stats table.
  std::uint64_t vram_budget = kUnlimitedBytes, ram_budget = kUnlimitedBytes;
  std::uint64_t dense_bytes = 0, kv_bytes = 0, device_reserve_bytes = 0;
  std::int64_t kv_slots = 1;   // ModelSizes::kv_slots: kv_bytes holds this many sequences' KV and state
  std::int64_t context = 0;
  // The KV cache's element type kv_bytes was charged for: the gpu_worker allocates its cache so.
  model::KvType kv_type = model::KvType::F32;
  TierTotals vram, ram, file;

  Tier at(std::int64_t layer, std::int64_t expert) const {
    return tiers[static_cast<std::size_t>(layer * n_expert + expert)];
  }
  // Experts of `layer` in `tier`, ascending.
  std::vector<std::int32_t> experts_in(std::int64_t layer, Tier tier) const;
  // The FILE tier's part of the arena: every worker's cache slots and their directory
  // (group::CacheSlotHeader each, 4 KiB aligned).
  std::uint64_t cache_region_bytes() const { return cache_region_bytes(n_cpu_workers, cache_slots, staging_slot_bytes); }
  static std::uint64_t cache_region_bytes(int n_cpu_workers, std::int64_t slots_per_worker, std::uint64_t slot_bytes);
  // A few lines: per tier experts and bytes, the budgets, dense and KV (log and `moraine stats`).
  std::string table() const;

  void write(const std::string& path) const;   // JSON, atomically (temp file + rename)
  // Throws std::runtime_error naming the file when it is malformed or not for this model.
  static PlacementPlan read(const std::string& path, const ModelSizes& sizes);
};

inline constexpr std::uint64_t kCacheSlotHeaderBytes = 64;   // sizeof(group::CacheSlotHeader)

// Throws std::invalid_argument naming the numbers when the VRAM budget cannot hold the dense
// part, or the RAM budget cannot hold the staging slots that FILE-tier experts need.
PlacementPlan plan_placement(const PlacementInput& in);

}  // namespace moraine::group
