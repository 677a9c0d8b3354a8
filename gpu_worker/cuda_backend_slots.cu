// The CUDA backend's sequence slots (cuda_backend_impl.h, backend.h; issue 33): which slot the
// per-sequence calls act on, a step's segments, their positions, and the rows logits() reads.
// The rules are the CPU backend's (cpu_backend.cpp), checked in the same order.
#include "gpu_worker/cuda_backend_impl.h"

#include <stdexcept>
#include <string>

namespace moraine::gpu_worker::cuda_impl {

void CudaBackend::select_slot(int slot) {
  if (slot < 0 || slot >= slots_)
    throw std::invalid_argument("CUDA backend: slot " + std::to_string(slot) + ", it has " + std::to_string(slots_));
  selected_ = slot;
}

void CudaBackend::check_segments(std::span<const Segment> segments) const {
  if (segments.empty() || segments.size() > static_cast<size_t>(slots_))
    throw std::invalid_argument("CUDA backend: a step of " + std::to_string(segments.size()) + " segments, it has " +
                                std::to_string(slots_) + " slots");
  std::vector<uint8_t> seen(static_cast<size_t>(slots_), 0);
  int64_t logit_rows = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& g = segments[i];
    const std::string where = "CUDA backend: segment " + std::to_string(i) + " (slot " + std::to_string(g.slot) + ")";
    if (g.slot < 0 || g.slot >= slots_ || seen[static_cast<size_t>(g.slot)]++)
      throw std::invalid_argument(where + ": a slot out of range or named twice");
    if (g.rows <= 0 || g.logit_rows <= 0 || g.logit_rows > g.rows)
      throw std::invalid_argument(where + ": " + std::to_string(g.rows) + " rows with " + std::to_string(g.logit_rows) +
                                  " logit rows");
    if (g.first_position != past_[static_cast<size_t>(g.slot)])
      throw std::invalid_argument(where + ": first position " + std::to_string(g.first_position) + ", the slot caches " +
                                  std::to_string(past_[static_cast<size_t>(g.slot)]));
    logit_rows += g.logit_rows;
  }
  if (logit_rows > static_cast<int64_t>(group::kMaxTokenRows) && token_out_ != nullptr)
    throw std::invalid_argument("CUDA backend: greedy tokens of " + std::to_string(logit_rows) + " rows, at most " +
                                std::to_string(group::kMaxTokenRows));
}

void CudaBackend::set_segments(std::span<const Segment> segments) {
  check_segments(segments);
  pending_.assign(segments.begin(), segments.end());
}

void CudaBackend::reset() {
  use_device();
  zero_slot_states(selected_);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  past_[static_cast<size_t>(selected_)] = 0;
  snapshot_pos_[static_cast<size_t>(selected_)] = -1;
}

void CudaBackend::advance(int64_t n) { advance_step(n); }

// The step's positions are cached: each segment's slot moves on by its rows (a plain step's slot
// by n, the whole step's rows, as layer-by-layer callers pass).
void CudaBackend::advance_step(int64_t n) {
  if (!segmented_) {
    past_[static_cast<size_t>(segments_.at(0).slot)] += n;
    return;
  }
  if (n != step_rows_)
    throw std::invalid_argument("CUDA backend: advance by " + std::to_string(n) + " rows after a step of " +
                                std::to_string(step_rows_));
  for (const Segment& g : segments_) past_[static_cast<size_t>(g.slot)] += g.rows;
}

std::vector<int64_t> CudaBackend::step_key(std::initializer_list<int64_t> lead) const {
  std::vector<int64_t> key(lead);
  key.push_back(step_rows_);
  key.push_back(segmented_ ? 1 : 0);
  for (const Segment& g : segments_) {
    key.push_back(g.slot);
    if (!segmented_) continue;
    key.push_back(g.rows);
    key.push_back(g.logit_rows);
  }
  return key;
}

// Segments of the current window (a segmented step has one window: begin_step refuses longer
// ones). A plain step: the window's rows of its slot, at the window's position.
const std::vector<CudaBackend::MixSegment>& CudaBackend::mix_segments() {
  mix_.clear();
  if (!segmented_) {
    const Segment& g = segments_.at(0);
    mix_.push_back({g.slot, 0, step_n_, 0, g.first_position + window_first_});
    return mix_;
  }
  for (size_t i = 0; i < segments_.size(); ++i)
    mix_.push_back({segments_[i].slot, segment_first_[i], segments_[i].rows, static_cast<int>(i), segments_[i].first_position});
  return mix_;
}

// Each segment's last logit_rows rows into y_, in order: one head over all of them reads its
// weights once for the step (rows of a matvec are independent, so each row's logits are those of
// its segment run alone).
void CudaBackend::enqueue_gather_logit_rows() {
  const int64_t d = m_.hp.n_embd;
  int64_t r = 0;
  for (size_t i = 0; i < segments_.size(); ++i) {
    const Segment& g = segments_[i];
    const int64_t from = segment_first_[i] + g.rows - g.logit_rows;
    CUDA_CHECK(cudaMemcpyAsync(y_.get() + r * d, x_.get() + from * d, static_cast<size_t>(g.logit_rows * d) * sizeof(float),
                               cudaMemcpyDeviceToDevice, stream_));
    r += g.logit_rows;
  }
}

}  // namespace moraine::gpu_worker::cuda_impl
