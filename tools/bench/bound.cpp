#include "tools/bench/bound.h"

namespace moraine::bench {

Bound decode_bound(const std::array<double, kTierCount>& bytes_per_token, const TierBandwidth& bandwidth) {
  Bound b;
  double worst_s = 0.0;
  for (int t = 0; t < kTierCount; ++t) {
    const double bytes = bytes_per_token[t];
    if (bytes <= 0.0) continue;
    if (!bandwidth[t] || *bandwidth[t] <= 0.0) {
      b.why_none = std::string("tier ") + kTierNames[t] + " reads bytes but its bandwidth was not measured";
      return b;
    }
    const double s = bytes / *bandwidth[t];
    if (s > worst_s) {
      worst_s = s;
      b.limiting = static_cast<Tier>(t);
    }
  }
  if (worst_s <= 0.0) {
    b.why_none = "the engine reports no bytes per token";
    return b;
  }
  b.tok_s = 1.0 / worst_s;
  return b;
}

DiskBound disk_bound(const EngineStats::FileCache& fc, double run_tok_s, const std::optional<double>& disk_bytes_per_s) {
  DiskBound d;
  if (fc.tokens == 0) {
    d.why_none = "the run computed no positions";
    return d;
  }
  d.bytes_per_token = static_cast<double>(fc.bytes_read) / static_cast<double>(fc.tokens);
  if (d.bytes_per_token <= 0) {
    d.why_none = "the run read nothing from the model file (every FILE-tier expert it used was in the file cache)";
  } else if (!disk_bytes_per_s || *disk_bytes_per_s <= 0) {
    d.why_none = "the disk's O_DIRECT rate was not measured";
  } else {
    d.tok_s = *disk_bytes_per_s / d.bytes_per_token;
    if (run_tok_s > 0) d.share = run_tok_s / *d.tok_s;
  }
  return d;
}

}  // namespace moraine::bench
