// What a placement leaves to the disk: the planner's expected share of a decode token's
// routed-expert reads that come from the model file (FILE-tier experts the file cache does not
// keep), the bytes per token that reads, and the tok/s that bounds at a disk rate, measured at
// start by a short O_DIRECT read of the model file or given (coordinator --disk-rate).
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "common/model/model.h"
#include "coordinator/census.h"
#include "coordinator/placement.h"

namespace moraine::group {

struct DiskEstimate {
  double routed_reads = 0;   // routed-expert reads of one decode token: k per MoE layer
  double file_reads = 0;     // of those, expected on FILE-tier experts
  double cache_hits = 0;     // of file_reads, expected found in the file cache
  double disk_bytes = 0;     // bytes per token read from the file for the rest
  bool from_census = false;  // popularity from the census, else uniform routing (k/E each)
  double fraction() const { return routed_reads > 0 ? (file_reads - cache_hits) / routed_reads : 0.0; }
};

// Expert e of layer il is used by a token with p = min(1, k * count_e / sum of the layer's
// counts) (uniform: k / E). The cache: every worker keeps its hottest FILE-tier experts (the
// LFU the workers run, seeded from the same census) in cache_slots - staging_slots slots; the
// staging slots are refilled by every layer's misses, so they keep nothing for the next token.
// `census` empty: uniform.
DiskEstimate estimate_disk_reads(const PlacementPlan& plan, const ModelSizes& sizes, const Census& census);

struct DiskRate {
  std::optional<double> bytes_per_s;
  std::string how;   // "measured: ...", "given: --disk-rate ...", or why there is no rate
};
// O_DIRECT reads of `path` (8 MiB requests spread over the file, 4 threads) for about `seconds`
// or at most 256 MiB, whichever ends first; no rate (and why) when O_DIRECT or the read fails.
DiskRate measure_disk_rate(const std::string& path, double seconds = 0.25);

// One line for the plan: "  disk reads: P% of routed-expert reads per token from the file
// (...), B/token; at R: at most T tok/s (how)". No rate: the bound is left out, saying why.
std::string disk_line(const DiskEstimate& d, const DiskRate& rate);

// The plan's line for model `m` (coordinator --print-plan and its log at start): the rate from
// `rate_text` ("auto": measured on the largest shard, only when some expert is FILE-tier; else
// bytes per second, "1.5G"). Throws std::invalid_argument naming --disk-rate for a bad rate.
std::string plan_disk_line(const std::string& rate_text, const model::Model& m, const PlacementPlan& plan, const Census& census);

}  // namespace moraine::group
