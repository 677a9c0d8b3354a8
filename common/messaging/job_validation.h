#pragma once
// Range checks on a parsed job descriptor before a worker touches shared memory with it: every
// (segment, offset, length) must lie inside a segment announced at session start, every layer,
// expert id and token row must be in range. A descriptor is hostile until checked: a worker that
// trusted an offset would write outside the exchange buffers.
#include <cstdint>
#include <string>
#include <vector>

#include "proto/jobs.pb.h"

namespace moraine::messaging {

struct SegmentBounds {
  std::uint32_t segment_id = 0;
  std::uint64_t bytes = 0;     // data bytes of the segment
};

struct JobLimits {
  std::vector<SegmentBounds> segments;
  std::uint32_t n_layers = 0;
  std::uint32_t n_experts = 0;
  std::uint32_t max_tokens = 0;   // rows in one step (prefill chunk size)
  std::uint32_t max_row_bytes = 0;
  std::vector<std::uint64_t> file_bytes{};   // read_jobs: size of each model file (shard), by file_index
};

// Empty when the job is acceptable, else what is wrong and where (field path and values).
std::string validate_job(const moraine::jobs::JobEnvelope& job, const JobLimits& limits);

}  // namespace moraine::messaging
