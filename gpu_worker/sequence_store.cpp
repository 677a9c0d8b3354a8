#include "gpu_worker/sequence_store.h"

#include <span>
#include <utility>
#include <stdexcept>

namespace moraine::gpu_worker {

void SequenceStore::apply(uint64_t step, const group::StepHeader& h, Backend& backend, group::StepReply& reply) {
  reply.state_saved_bytes = 0;
  const auto fail = [&](const std::string& what) {
    reply.state_store_bytes = bytes_.load();
    throw std::runtime_error("step " + std::to_string(step) + ": " + what);
  };
  for (uint64_t key : h.state_drop) {
    if (key == 0) continue;
    if (auto it = saved_.find(key); it != saved_.end()) {
      bytes_ -= it->second.bytes;
      recycle(std::move(it->second.buffer));
      saved_.erase(it);
    }
  }
  count_ = saved_.size();
  if (h.state_save != 0 || h.state_load != 0) {
    if (!backend.can_save_state()) fail("the conversation cache needs a backend that saves its sequence; this one cannot");
  }
  if (h.state_save != 0) {
    if (saved_.count(h.state_save) != 0) fail("saves conversation " + std::to_string(h.state_save) + ", which is already held");
    const int64_t keep = h.state_save_positions;
    if (keep > backend.n_past())
      fail("saves " + std::to_string(keep) + " positions of conversation " + std::to_string(h.state_save) + ", but " +
           std::to_string(backend.n_past()) + " are cached");
    if (keep < backend.n_past()) backend.rewind(keep);   // a verify step's rejected drafts
    Saved out;
    out.bytes = backend.state_bytes();
    out.buffer = buffer_for(backend, out.bytes);
    try {
      backend.save_state(std::span<uint8_t>(out.buffer.data.get(), out.bytes));
    } catch (...) {
      recycle(std::move(out.buffer));
      throw;
    }
    bytes_ += out.bytes;
    reply.state_saved_bytes = out.bytes;
    saved_.emplace(h.state_save, std::move(out));
    count_ = saved_.size();
  }
  if (h.state_load != 0) {
    auto it = saved_.find(h.state_load);
    if (it == saved_.end()) fail("loads conversation " + std::to_string(h.state_load) + ", which this gpu_worker does not hold");
    backend.load_state(std::span<const uint8_t>(it->second.buffer.data.get(), it->second.bytes));
    bytes_ -= it->second.bytes;
    recycle(std::move(it->second.buffer));
    saved_.erase(it);
    count_ = saved_.size();
  }
  reply.state_store_bytes = bytes_.load();
}

Backend::HostBuffer SequenceStore::buffer_for(Backend& backend, size_t bytes) {
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it)
    if (it->capacity >= bytes && (best == free_.end() || it->capacity < best->capacity)) best = it;
  if (best != free_.end()) {
    Backend::HostBuffer b = std::move(*best);
    free_.erase(best);
    return b;
  }
  // Rounded up so that a later, slightly longer sequence fits a recycled buffer too.
  constexpr size_t kGrain = size_t{32} << 20;
  return backend.host_buffer((bytes + kGrain - 1) / kGrain * kGrain);
}

void SequenceStore::recycle(Backend::HostBuffer b) {
  constexpr size_t kKeptFree = 4;   // at most this many idle buffers (the oldest go back)
  if (!b.data) return;
  free_.push_back(std::move(b));
  if (free_.size() > kKeptFree) free_.erase(free_.begin());
}

}  // namespace moraine::gpu_worker
