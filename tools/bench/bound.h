// The decode speed the machine allows: each tier's bytes per token over its measured bandwidth
// is a time per token; the slowest tier sets the bound (tiers are read concurrently, so the
// bound is 1 / max, not 1 / sum).
#pragma once
#include <array>
#include <optional>
#include <string>

#include "tools/bench/bench_engine.h"

namespace moraine::bench {

// Bytes per second per tier; nullopt where it could not be measured (no GPU, O_DIRECT refused).
using TierBandwidth = std::array<std::optional<double>, kTierCount>;

struct Bound {
  std::optional<double> tok_s;       // nullopt: a tier with bytes has no measured bandwidth
  std::optional<Tier> limiting;      // the tier with the largest time per token
  std::string why_none;              // set when tok_s is nullopt
};

Bound decode_bound(const std::array<double, kTierCount>& bytes_per_token, const TierBandwidth& bandwidth);

// The disk alone as the limit of a run with a FILE tier: the bytes the run read from the model
// file per position over the measured O_DIRECT rate, and the share of it the run's tok/s reached.
struct DiskBound {
  double bytes_per_token = 0;   // file_cache.bytes_read / file_cache.tokens
  std::optional<double> tok_s, share;
  std::string why_none;         // set when tok_s is nullopt
};
DiskBound disk_bound(const EngineStats::FileCache& fc, double run_tok_s, const std::optional<double>& disk_bytes_per_s);

}  // namespace moraine::bench
