#include "gpu_worker/step_segments.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace moraine::gpu_worker {

std::vector<Segment> prepare_segments(const group::StepHeader& h, Backend& backend, int64_t max_tokens) {
  const std::string step = "batched step " + std::to_string(h.step_seq);
  if (h.n_segments == 0 || h.n_segments > group::kMaxSegments || h.n_segments > static_cast<uint32_t>(backend.slots()))
    throw std::runtime_error(step + ": " + std::to_string(h.n_segments) + " segments, expected 1.." +
                             std::to_string(std::min<int64_t>(group::kMaxSegments, backend.slots())) +
                             " (the backend's sequence slots)");
  if (h.reset || h.rewind || h.snapshot || h.mtp)
    throw std::runtime_error(step + ": reset / rewind / snapshot / mtp are per segment in a batched step");
  std::vector<uint8_t> seen(static_cast<size_t>(backend.slots()), 0);
  int64_t rows = 0, logit_rows = 0;
  for (uint32_t i = 0; i < h.n_segments; ++i) {
    const group::StepSegment& g = h.segments[i];
    const std::string where = step + ", segment " + std::to_string(i) + " (slot " + std::to_string(g.slot) + ")";
    if (g.slot >= static_cast<uint32_t>(backend.slots()) || seen[g.slot]++)
      throw std::runtime_error(where + ": a slot out of range (" + std::to_string(backend.slots()) + " slots) or named twice");
    if (g.rows == 0 || g.logit_rows == 0 || g.logit_rows > g.rows)
      throw std::runtime_error(where + ": " + std::to_string(g.rows) + " rows with " + std::to_string(g.logit_rows) + " logit rows");
    rows += g.rows;
    logit_rows += g.logit_rows;
  }
  if (rows != h.n_tokens || logit_rows != h.logit_rows || rows > max_tokens)
    throw std::runtime_error(step + ": its segments hold " + std::to_string(rows) + " rows with " + std::to_string(logit_rows) +
                             " logit rows, the header says " + std::to_string(h.n_tokens) + " and " +
                             std::to_string(h.logit_rows) + " (at most " + std::to_string(max_tokens) + " rows)");
  std::vector<Segment> out;
  for (uint32_t i = 0; i < h.n_segments; ++i) {
    const group::StepSegment& g = h.segments[i];
    const std::string where = step + ", segment " + std::to_string(i) + " (slot " + std::to_string(g.slot) + ")";
    backend.select_slot(static_cast<int>(g.slot));
    if (g.reset) backend.reset();
    if (g.rewind && !g.reset && g.first_position < backend.n_past()) {
      if (!backend.can_rewind()) throw std::runtime_error(where + ": a rewind, but this backend and model cannot");
      backend.rewind(g.first_position);
    }
    if (g.first_position != backend.n_past())
      throw std::runtime_error(where + ": starts at position " + std::to_string(g.first_position) + " but " +
                               std::to_string(backend.n_past()) + " positions are cached");
    if (g.snapshot) {
      if (!backend.can_rewind()) throw std::runtime_error(where + ": a snapshot, but this backend cannot rewind");
      backend.snapshot();
    }
    out.push_back({static_cast<int32_t>(g.slot), g.first_position, g.rows, g.logit_rows});
  }
  backend.select_slot(static_cast<int>(h.slot < static_cast<uint32_t>(backend.slots()) ? h.slot : 0));
  return out;
}

void segment_tokens(const group::StepHeader& h, group::StepReply& reply) {
  std::fill_n(reply.segment_token, group::kMaxSegments, -1);
  if (!h.greedy_token) return;
  uint32_t r = 0;
  for (uint32_t i = 0; i < h.n_segments && i < group::kMaxSegments; ++i) {
    r += h.segments[i].logit_rows;
    if (r >= 1 && r <= group::kMaxTokenRows) reply.segment_token[i] = reply.row_tokens[r - 1];
  }
}

}  // namespace moraine::gpu_worker
