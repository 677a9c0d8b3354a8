#pragma once
// Random, valid expert job lists over a real segment layout, shared by the messaging tests.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "common/messaging/job_codec.h"
#include "common/messaging/job_validation.h"
#include "common/shm/shm_layout.h"
#include "proto/jobs.pb.h"

namespace moraine::test {

inline constexpr std::uint32_t kSegmentId = 7;
inline constexpr std::uint32_t kLayers = 48;
inline constexpr std::uint32_t kExperts = 128;
inline constexpr std::uint32_t kMaxTokens = 16;
inline constexpr std::uint32_t kHidden = 64;                 // floats per row
inline constexpr std::uint32_t kRowBytes = kHidden * sizeof(float);
inline constexpr std::uint32_t kTopK = 8;

inline shm::ShmLayout exchange_layout() {
  shm::ShmLayout layout;
  layout.add("activations", std::size_t{kMaxTokens} * kRowBytes, 4096)
      .add("routing", std::size_t{kMaxTokens} * kTopK * sizeof(float), 64)
      .add("outputs", std::size_t{kMaxTokens} * kTopK * kRowBytes, 4096)
      .add_doorbells("handoff", 2);
  return layout;
}

inline messaging::JobLimits exchange_limits(const shm::ShmLayout& layout) {
  return {{{kSegmentId, layout.total_bytes()}}, kLayers, kExperts, kMaxTokens, 4 * kRowBytes};
}

inline void set_ref(jobs::ShmRef* ref, const shm::Region& region, std::uint64_t length) {
  ref->set_segment_id(kSegmentId);
  ref->set_offset(region.offset);
  ref->set_length(length);
}

// n_tokens rows, each routed to kTopK distinct experts; one job per distinct expert, its output
// rows packed one after another in the outputs region.
inline jobs::JobEnvelope random_expert_jobs(std::mt19937_64& rng, const shm::ShmLayout& layout, std::uint64_t seq) {
  jobs::JobEnvelope envelope;
  envelope.set_version(messaging::kJobProtocolVersion);
  envelope.set_seq(seq);
  auto* list = envelope.mutable_expert_jobs();
  const std::uint32_t n_tokens = 1 + static_cast<std::uint32_t>(rng() % kMaxTokens);
  list->set_step_seq(seq * 10);
  list->set_layer(static_cast<std::uint32_t>(rng() % kLayers));
  list->set_n_tokens(n_tokens);
  list->set_row_bytes(kRowBytes);
  set_ref(list->mutable_activations(), layout.region("activations"), std::uint64_t{n_tokens} * kRowBytes);
  set_ref(list->mutable_routing(), layout.region("routing"), std::uint64_t{n_tokens} * kTopK * sizeof(float));
  set_ref(list->mutable_outputs(), layout.region("outputs"), layout.region("outputs").bytes);
  list->set_done_seq(seq);
  std::vector<std::vector<std::uint32_t>> rows_of(kExperts);
  std::vector<std::uint32_t> experts(kExperts);
  std::iota(experts.begin(), experts.end(), 0u);
  for (std::uint32_t t = 0; t < n_tokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    for (std::uint32_t k = 0; k < kTopK; ++k) rows_of[experts[k]].push_back(t);
  }
  std::uint64_t offset = 0;
  for (std::uint32_t e = 0; e < kExperts; ++e) {
    if (rows_of[e].empty()) continue;
    auto* job = list->add_jobs();
    job->set_expert_id(e);
    for (std::uint32_t row : rows_of[e]) job->add_token_rows(row);
    job->set_output_offset(offset);
    offset += std::uint64_t{rows_of[e].size()} * kRowBytes;
  }
  return envelope;
}

}  // namespace moraine::test
