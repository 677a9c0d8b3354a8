// Range checks on job descriptors: random valid lists pass; each single out-of-range field is
// refused with a message naming the field.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <random>
#include <string>

#include "common/messaging/job_codec.h"
#include "common/messaging/job_validation.h"
#include "tests/messaging/job_fixture.h"

namespace {

using moraine::jobs::JobEnvelope;
using moraine::messaging::decode_job;
using moraine::messaging::encode_job;
using moraine::messaging::validate_job;
using namespace moraine::test;

TEST(JobValidation, RandomValidListsPassAndSurviveTheCodec) {
  const auto layout = exchange_layout();
  const auto limits = exchange_limits(layout);
  std::mt19937_64 rng(4242);
  std::string wire;
  for (std::uint64_t seq = 1; seq <= 300; ++seq) {
    const JobEnvelope job = random_expert_jobs(rng, layout, seq);
    ASSERT_EQ(validate_job(job, limits), "") << job.DebugString();
    encode_job(job, wire);
    JobEnvelope back;
    ASSERT_EQ(decode_job(std::as_bytes(std::span(wire.data(), wire.size())), moraine::messaging::kDefaultMaxJobBytes, back), "");
    ASSERT_EQ(back.SerializeAsString(), wire);
    ASSERT_EQ(back.expert_jobs().jobs_size(), job.expert_jobs().jobs_size());
  }
}

struct Mutation {
  const char* name;
  std::function<void(moraine::jobs::ExpertJobList&)> apply;
  const char* expect;  // substring of the error
};

TEST(JobValidation, EachOutOfRangeFieldIsRefusedByName) {
  const auto layout = exchange_layout();
  const auto limits = exchange_limits(layout);
  const std::uint64_t seg = layout.total_bytes();
  const std::vector<Mutation> mutations = {
      {"unknown segment", [](auto& l) { l.mutable_activations()->set_segment_id(9); }, "expert_jobs.activations: unknown segment id 9"},
      {"offset past end", [&](auto& l) { l.mutable_activations()->set_offset(seg - 10); }, "is outside segment"},
      {"offset wraps", [](auto& l) { l.mutable_outputs()->set_offset(UINT64_MAX - 8); }, "expert_jobs.outputs: range"},
      {"length wraps", [](auto& l) { l.mutable_routing()->set_length(UINT64_MAX); }, "expert_jobs.routing: range"},
      {"activations too short", [](auto& l) { l.mutable_activations()->set_length(l.row_bytes() * l.n_tokens() - 1); }, "is less than"},
      {"layer", [](auto& l) { l.set_layer(kLayers); }, "expert_jobs.layer 48"},
      {"no tokens", [](auto& l) { l.set_n_tokens(0); }, "expert_jobs.n_tokens 0"},
      {"too many tokens", [](auto& l) { l.set_n_tokens(kMaxTokens + 1); }, "expert_jobs.n_tokens 17"},
      {"row bytes", [](auto& l) { l.set_row_bytes(0); }, "expert_jobs.row_bytes 0"},
      {"expert id", [](auto& l) { l.mutable_jobs(l.jobs_size() - 1)->set_expert_id(kExperts); }, ".expert_id 128"},
      {"token row", [](auto& l) { l.mutable_jobs(0)->set_token_rows(0, l.n_tokens()); }, "jobs[0].token_rows[0]"},
      {"empty job", [](auto& l) { l.mutable_jobs(0)->clear_token_rows(); }, "jobs[0]: no token rows"},
      {"output past end", [](auto& l) { l.mutable_jobs(0)->set_output_offset(l.outputs().length() - 1); }, "run past expert_jobs.outputs"},
      {"output offset wraps", [](auto& l) { l.mutable_jobs(0)->set_output_offset(UINT64_MAX); }, "run past"},
      {"no jobs", [](auto& l) { l.clear_jobs(); }, "expert_jobs: no jobs"},
  };
  std::mt19937_64 rng(777);
  for (const Mutation& m : mutations) {
    for (int round = 0; round < 20; ++round) {
      JobEnvelope job = random_expert_jobs(rng, layout, 1 + round);
      m.apply(*job.mutable_expert_jobs());
      const std::string error = validate_job(job, limits);
      EXPECT_NE(error.find(m.expect), std::string::npos) << m.name << ": got '" << error << "'";
    }
  }
}

TEST(JobValidation, LayerStepRanges) {
  const auto layout = exchange_layout();
  const auto limits = exchange_limits(layout);
  JobEnvelope job;
  job.set_version(moraine::messaging::kJobProtocolVersion);
  auto* step = job.mutable_layer_step();
  step->set_layer(3);
  step->set_n_tokens(4);
  step->set_row_bytes(kRowBytes);
  set_ref(step->mutable_activations(), layout.region("activations"), 4 * kRowBytes);
  set_ref(step->mutable_output(), layout.region("outputs"), 4 * kRowBytes);
  EXPECT_EQ(validate_job(job, limits), "");
  step->mutable_output()->set_offset(layout.total_bytes() - 4 * kRowBytes + 1);
  EXPECT_NE(validate_job(job, limits).find("layer_step.output: range"), std::string::npos);
  job.clear_layer_step();
  EXPECT_EQ(validate_job(job, limits), "job descriptor has no body");
}

}  // namespace
