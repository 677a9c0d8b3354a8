#include "cpu_expert_worker/expert_cache.h"

#include <algorithm>
#include <stdexcept>

namespace moraine::cpu_worker {

ExpertCache::ExpertCache(group::CacheDirectory dir, std::int64_t n_layer, std::int64_t n_expert, const group::Census& seed,
                         std::uint64_t aging_uses)
    : dir_(dir), n_layer_(n_layer), n_expert_(n_expert), aging_uses_(std::max<std::uint64_t>(1, aging_uses)),
      heat_(static_cast<std::size_t>(n_layer * n_expert), 0.0), where_(static_cast<std::size_t>(n_layer * n_expert), -1),
      holds_(static_cast<std::size_t>(dir.size()), -1), pinned_(static_cast<std::size_t>(dir.size()), 0),
      filling_(static_cast<std::size_t>(dir.size()), 0), read_ahead_(static_cast<std::size_t>(dir.size()), 0) {
  if (!seed.counts.empty()) {
    if (static_cast<std::int64_t>(seed.counts.size()) != n_layer) throw std::invalid_argument("ExpertCache: census of another shape");
    for (std::int64_t il = 0; il < n_layer; ++il) {
      const std::vector<std::uint64_t>& row = seed.counts[static_cast<std::size_t>(il)];
      if (static_cast<std::int64_t>(row.size()) != n_expert) throw std::invalid_argument("ExpertCache: census of another shape");
      const std::uint64_t top = *std::max_element(row.begin(), row.end());
      if (top == 0) continue;
      for (std::int64_t e = 0; e < n_expert; ++e) {
        heat_[index(il, e)] = kSeedHeat * static_cast<double>(row[static_cast<std::size_t>(e)]) / static_cast<double>(top);
      }
    }
  }
}

std::int64_t ExpertCache::adopt() {
  for (std::int64_t s = 0; s < dir_.size(); ++s) {
    const std::uint64_t seq = dir_.seq(s);
    if (seq == 0) continue;
    const std::int32_t il = dir_.layer(s), e = dir_.expert(s);
    const bool named = il >= 0 && il < n_layer_ && e >= 0 && e < n_expert_;
    if ((seq & 1) != 0 || !named || where_[index(il, e)] >= 0) {
      dir_.abandon(s);
      continue;
    }
    where_[index(il, e)] = static_cast<std::int32_t>(s);
    holds_[static_cast<std::size_t>(s)] = static_cast<std::int64_t>(index(il, e));
    ++filled_;
  }
  return filled_;
}

void ExpertCache::touch(std::int64_t il, std::int64_t e) {
  heat_[index(il, e)] += 1.0;
  if (++uses_ % aging_uses_ == 0) {
    for (double& h : heat_) h *= 0.5;
  }
}

ExpertCache::Found ExpertCache::find(std::int64_t il, std::int64_t e) const {
  const std::int32_t s = where_[index(il, e)];
  if (s < 0 || filling_[static_cast<std::size_t>(s)] != 0) return {};
  const std::uint64_t token = dir_.snapshot(s, static_cast<std::int32_t>(il), static_cast<std::int32_t>(e));
  return token == 0 ? Found{} : Found{s, token};
}

std::int64_t ExpertCache::victim(std::int64_t il, std::int64_t e, bool read_ahead) const {
  std::int64_t best = -1;
  double coldest = 0;
  for (std::int64_t s = 0; s < dir_.size(); ++s) {
    const std::size_t i = static_cast<std::size_t>(s);
    if (pinned_[i] != 0 || filling_[i] != 0) continue;
    if (holds_[i] < 0) return s;
    const double h = heat_[static_cast<std::size_t>(holds_[i])];
    if (best < 0 || h < coldest) {
      best = s;
      coldest = h;
    }
  }
  if (best >= 0 && read_ahead && coldest > heat(il, e) + 1.0) return -1;
  return best;
}

void ExpertCache::forget(std::int64_t s) {
  const std::size_t i = static_cast<std::size_t>(s);
  if (holds_[i] >= 0) {
    where_[static_cast<std::size_t>(holds_[i])] = -1;
    holds_[i] = -1;
    --filled_;
  }
  read_ahead_[i] = 0;
}

void ExpertCache::begin_fill(std::int64_t s, std::int64_t il, std::int64_t e) {
  if (where_[index(il, e)] >= 0) throw std::logic_error("ExpertCache: expert filled twice");
  forget(s);
  if (!dir_.begin_fill(s, static_cast<std::int32_t>(il), static_cast<std::int32_t>(e))) {
    throw std::logic_error("ExpertCache: slot " + std::to_string(s) + " is being filled by another writer");
  }
  const std::size_t i = static_cast<std::size_t>(s);
  holds_[i] = static_cast<std::int64_t>(index(il, e));
  where_[static_cast<std::size_t>(holds_[i])] = static_cast<std::int32_t>(s);
  ++filled_;
  filling_[i] = 1;
  pinned_[i] = 1;
}

void ExpertCache::end_fill(std::int64_t s) {
  filling_[static_cast<std::size_t>(s)] = 0;
  dir_.end_fill(s);
}

void ExpertCache::abandon(std::int64_t s) {
  forget(s);
  filling_[static_cast<std::size_t>(s)] = 0;
  dir_.abandon(s);
}

void ExpertCache::unpin_all() { std::fill(pinned_.begin(), pinned_.end(), 0); }

bool ExpertCache::take_read_ahead(std::int64_t s) {
  const bool was = read_ahead_[static_cast<std::size_t>(s)] != 0;
  read_ahead_[static_cast<std::size_t>(s)] = 0;
  return was;
}

}  // namespace moraine::cpu_worker
