#include "gpu_worker/file_stage.h"

#include <utility>

namespace moraine::gpu_worker {

FileStager::FileStager(std::vector<group::CacheDirectory> dirs, std::int64_t n_expert)
    : dirs_(std::move(dirs)), n_expert_(n_expert), at_(static_cast<size_t>(n_expert)) {}

void FileStager::index_layer(std::int32_t il) {
  layer_ = il;
  for (Hit& h : at_) h = Hit{};
  for (size_t w = 0; w < dirs_.size(); ++w) {
    const group::CacheDirectory& d = dirs_[w];
    for (std::int64_t s = 0; s < d.size(); ++s) {
      const std::uint64_t seq = d.seq(s);
      if (seq == 0 || (seq & 1) != 0 || d.layer(s) != il) continue;
      const std::int32_t e = d.expert(s);
      if (e < 0 || e >= n_expert_) continue;
      at_[static_cast<size_t>(e)] = {e, static_cast<int>(w), s, 0};
    }
  }
}

FileStager::Hit FileStager::find(std::int32_t e) const {
  if (e < 0 || e >= n_expert_ || layer_ < 0) return {};
  Hit h = at_[static_cast<size_t>(e)];
  if (h.slot < 0) return {};
  h.token = dirs_[static_cast<size_t>(h.worker)].snapshot(h.slot, layer_, e);
  return h.token != 0 ? h : Hit{};
}

std::vector<std::int32_t> FileStager::torn(std::int64_t force_first) {
  std::vector<std::int32_t> out;
  for (size_t i = 0; i < pending_.size(); ++i) {
    const Hit& h = pending_[i];
    if (static_cast<std::int64_t>(i) < force_first || !dirs_[static_cast<size_t>(h.worker)].still_valid(h.slot, h.token))
      out.push_back(h.expert);
  }
  pending_.clear();
  return out;
}

}  // namespace moraine::gpu_worker
