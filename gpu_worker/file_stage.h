// What a long step's device takes from the FILE tier's host cache (the cpu workers' file-cache
// slots in the arena, coordinator/expert_cache_directory.h): the gpu_worker looks a layer's
// FILE-tier experts up in every worker's directory, stages the whole ones from their slots as it
// stages RAM-tier experts (Backend::stage_experts, copied straight from the pinned arena), and
// once those copies have landed checks each slot's seqlock token: a slot refilled since the
// lookup (the owning worker's read-ahead or demand reads evict by heat and never ask the device)
// may have been copied torn, so that expert is dropped from the device (Backend::unstage_expert)
// and its owner computes it (ExpertRequest kRedoRequest). No copy is used unchecked.
#pragma once
#include <cstdint>
#include <vector>

#include "coordinator/expert_cache_directory.h"

namespace moraine::gpu_worker {

class FileStager {
 public:
  struct Hit {
    std::int32_t expert = -1;
    int worker = -1;
    std::int64_t slot = -1;
    std::uint64_t token = 0;   // CacheDirectory::snapshot's
  };
  FileStager() = default;
  // dirs[w]: cpu worker w's part of the directory.
  FileStager(std::vector<group::CacheDirectory> dirs, std::int64_t n_expert);
  bool empty() const { return dirs_.empty(); }

  // Which slot holds each expert of layer il whole now (one pass over every directory entry;
  // several slots of one expert: the last one found). Experts outside [0, n_expert) are ignored.
  void index_layer(std::int32_t il);
  // After index_layer(il): expert e's slot and token, snapshot again (a slot refilled since the
  // pass is not found); expert -1 when none.
  Hit find(std::int32_t e) const;

  // Copies of these slots were queued; torn() after they landed: the experts whose slot was
  // refilled (or begun to be) since their token, in the order added. Clears the list.
  // force_first: the first that many are reported torn whatever their slot says (fault
  // injection, gpu_worker --fault-tear-file-copies: the recovery path runs on demand).
  void add_pending(const Hit& h) { pending_.push_back(h); }
  bool has_pending() const { return !pending_.empty(); }
  void clear_pending() { pending_.clear(); }   // a layer left half-done (a failed step)
  std::vector<std::int32_t> torn(std::int64_t force_first = 0);

 private:
  std::vector<group::CacheDirectory> dirs_;
  std::int64_t n_expert_ = 0;
  std::int32_t layer_ = -1;
  std::vector<Hit> at_;   // [expert] index_layer's result
  std::vector<Hit> pending_;
};

}  // namespace moraine::gpu_worker
