// The gpu_worker's side of the conversation cache (coordinator --cache-ram): sequences saved
// from the backend (Backend::save_state) into this process's host memory by the coordinator's
// keys, and loaded back when a request continues one of them. The coordinator decides what is
// kept (least recently used within its budget); this store only does what each step's header
// says (StepHeader::state_drop / state_save / state_load) and reports the bytes.
#pragma once
#include <atomic>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "coordinator/group_layout.h"
#include "gpu_worker/backend.h"

namespace moraine::gpu_worker {

class SequenceStore {
 public:
  // The header's state operations, before the step's reset / rewind: drops, then the save, then
  // the load (group_layout.h). Fills the reply's state_saved_bytes / state_store_bytes. Throws
  // std::runtime_error naming the step and key for a load of a key it does not hold, a save over
  // a key in use, a save of more positions than are cached, or a backend that cannot.
  void apply(uint64_t step, const group::StepHeader& h, Backend& backend, group::StepReply& reply);
  // Read by the stats thread while steps run.
  uint64_t bytes() const { return bytes_.load(); }
  uint64_t size() const { return count_.load(); }

 private:
  struct Saved {
    Backend::HostBuffer buffer;
    size_t bytes = 0;
  };
  // A buffer of at least `bytes` from the free ones (the smallest that fits), else a new one.
  Backend::HostBuffer buffer_for(Backend& backend, size_t bytes);
  void recycle(Backend::HostBuffer b);
  std::unordered_map<uint64_t, Saved> saved_;
  // Buffers of dropped and loaded sequences, kept for the next saves: pinning is slow (~0.25 s
  // for 512 MB on the H200), a copy into pinned memory fast (~10 ms).
  std::vector<Backend::HostBuffer> free_;
  // Not pinned ahead in the background: cudaMallocHost holds the driver while it pins, and the
  // steps beside it stalled (H200, 30B at 12G: follow-ups 0.58-0.69 s against 0.11-0.36 s).
  std::atomic<uint64_t> bytes_{0}, count_{0};
};

}  // namespace moraine::gpu_worker
