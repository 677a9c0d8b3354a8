// A batched step's header (StepHeader::n_segments > 0, issue 33) turned into backend calls: the
// gpu_worker checks the segment list, runs each segment's reset / rewind / snapshot on its slot,
// and hands the backend the segments (Backend::set_segments) for the step's rows. Apart from
// gpu_worker.cpp so the protocol's rules are tested against the CPU backend without a group.
#pragma once
#include <vector>

#include "coordinator/group_layout.h"
#include "gpu_worker/backend.h"

namespace moraine::gpu_worker {

// Checks the header's segments against the step (n_tokens their rows' sum, logit_rows theirs, at
// most max_tokens rows, distinct slots within backend.slots(), no header-level reset / rewind /
// snapshot / MTP), applies each segment's reset, rewind and snapshot to its slot, checks its first
// position, and returns the segments for set_segments. std::runtime_error naming the segment for
// a bad header (nothing applied when the list itself is bad).
std::vector<Segment> prepare_segments(const group::StepHeader& h, Backend& backend, int64_t max_tokens);

// After the step: StepReply::segment_token from row_tokens (each segment's last logit row), -1
// past the segments or without greedy tokens.
void segment_tokens(const group::StepHeader& h, group::StepReply& reply);

}  // namespace moraine::gpu_worker
