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

}  // namespace moraine::bench
