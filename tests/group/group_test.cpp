// The process group end to end: coordinator + gpu_worker (CPU backend) + two cpu_expert_workers
// started by deploy/moraine-supervisor generate exactly the reference executor's greedy tokens,
// with logits bit-identical (the workers run the reference kernels), over both hand-offs and
// both step channels (the exchange's step doorbells, a LayerStep over ZeroMQ). Without the logits
// dump the coordinator asks for greedy tokens only: the gpu_worker picks them (StepHeader::
// greedy_token) and they are still the reference's.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "tests/group/greedy_tokens.h"
#include "tests/group/group_harness.h"

namespace moraine::group_test {
namespace {

namespace fs = std::filesystem;

struct Case {
  std::string model;
  std::string weights;   // "f32", "q8_0", "kmix", "hub"
  std::string handoff;
  std::string step_channel = "doorbell";
  // > 0: long steps (--long-step-rows) of this many rows in windows of 4 (--max-tokens 4): the
  // gpu_worker runs each layer over the windows (10-row steps: windows of 4, 4 and 2).
  int long_step_rows = 0;
  std::string name() const {
    return param_name(model) + "_" + weights + "_" + handoff + (step_channel == "zmq" ? "_zmqsteps" : "") +
           (long_step_rows > 0 ? "_long_steps" : "");
  }
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name(); }

class GroupMatchesReference : public ::testing::TestWithParam<Case> {};

TEST_P(GroupMatchesReference, GreedyTokensAndLogits) {
  const Case& c = GetParam();
  constexpr int kTokens = 12;
  const auto [dir, model, prompt, ref] = golden_case(c.model, c.weights, "model", kTokens);

  GroupOptions o;
  o.model = model;
  o.handoff = c.handoff;
  o.extra_args = {"--coordinator-arg=--step-channel=" + c.step_channel};
  if (c.long_step_rows > 0) {
    ASSERT_GT(prompt.size(), static_cast<size_t>(c.long_step_rows)) << "the prompt must take a full long step";
    o.max_tokens = 4;
    o.extra_args.push_back("--coordinator-arg=--long-step-rows=" + std::to_string(c.long_step_rows));
  }
  o.logits_dump = dir + "/logits.f32";
  Group g(o);
  const Generation gen = generate(g.socket_dir(), prompt, kTokens);
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, ref.ids);

  // Every sampled row's logits, as the coordinator saw them in shared memory.
  const std::vector<float> got = read_logits_dump(o.logits_dump, ref.logits.size());
  ASSERT_FALSE(::testing::Test::HasFailure());
  const size_t first_diff = first_bit_difference(got, ref.logits);
  EXPECT_EQ(first_diff, got.size()) << "logit " << first_diff << ": group " << got[first_diff] << " vs reference "
                                    << ref.logits[first_diff];
  EXPECT_EQ(coordinator_counter(g.socket_dir(), "greedy_worker_tokens"), 0u) << "the logits dump needs the logits";
  g.stop();
  fs::remove_all(dir);
}

// Greedy decode without the logits crossing: every token is the gpu_worker's (the counter), and
// they are the reference's, over both step channels; a second request on the same group with
// check_logits set also takes the gpu_worker's tokens (which then checks the logits where they are:
// StepHeader::check_finite; group_fault_test's CheckLogitsNamesANonFiniteLogit has the NaN) and
// gets the same tokens.
class GroupGreedyTokens : public ::testing::TestWithParam<Case> {};

TEST_P(GroupGreedyTokens, TheGpuWorkerPicksTheReferenceTokens) {
  const Case& c = GetParam();
  constexpr int kTokens = 12;
  const auto [dir, model, prompt, ref] = golden_case(c.model, c.weights, "greedy", kTokens);
  GroupOptions o;
  o.model = model;
  o.handoff = c.handoff;
  o.extra_args = {"--coordinator-arg=--step-channel=" + c.step_channel};
  ASSERT_NO_FATAL_FAILURE(expect_worker_greedy_tokens(o, prompt, ref.ids, kTokens));
  fs::remove_all(dir);
}

// Speculative decode: suffix drafts verified as windows give the reference's greedy tokens
// (the CPU backend's rows are the reference's bits), with drafts accepted and rejected on the
// way (rejected ones are dropped from the cache: StepHeader::rewind); over both step channels.
// The prompt's continuation loops (repeating_prompt). A model with DeltaNet layers rewinds to the
// state saved before the window (StepHeader::snapshot) and feeds the accepted tokens again.
class GroupSpeculation : public ::testing::TestWithParam<Case> {};

TEST_P(GroupSpeculation, VerifiedDraftsGiveTheReferenceTokens) {
  const Case& c = GetParam();
  constexpr int kTokens = 32;
  const auto [dir, model, golden, unused] = golden_case(c.model, c.weights, "spec", 1);
  const std::vector<int32_t> prompt = repeating_prompt(c.model);
  const ReferenceRun ref = reference_greedy(model, prompt, kTokens);
  GroupOptions o;
  o.model = model;
  o.handoff = c.handoff;
  o.extra_args = {"--coordinator-arg=--step-channel=" + c.step_channel};
  ASSERT_NO_FATAL_FAILURE(expect_speculative_tokens(o, prompt, ref.ids, kTokens));
  fs::remove_all(dir);
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (const char* m : {"qwen3moe_odd", "qwen3moe_k256", "qwen3next_odd", "qwen3next_k256"}) v.push_back({m, "f32", "doorbell"});
  v.push_back({"qwen3moe_odd", "q8_0", "doorbell"});
  v.push_back({"qwen3next_odd", "q8_0", "doorbell"});
  // K-quant blocks are 256 wide: only the *_k256 models have rows that take them.
  v.push_back({"qwen3moe_k256", "kmix", "doorbell"});
  v.push_back({"qwen3next_k256", "kmix", "doorbell"});
  v.push_back({"qwen3moe_k256", "hub", "doorbell"});
  v.push_back({"qwen3next_k256", "hub", "doorbell"});
  // The ZeroMQ reference hand-off.
  v.push_back({"qwen3moe_odd", "f32", "zmq"});
  v.push_back({"qwen3next_k256", "kmix", "zmq"});
  // Long steps over windows, bit for bit the reference's as consecutive steps are.
  v.push_back({"qwen3moe_odd", "f32", "doorbell", "doorbell", 10});
  v.push_back({"qwen3next_k256", "kmix", "doorbell", "doorbell", 10});
  // Steps as LayerStep round trips over ZeroMQ (--step-channel zmq).
  v.push_back({"qwen3next_odd", "f32", "doorbell", "zmq"});
  // gpt-oss: F32 experts (the reference kernel in the cpu workers), Q4_K ones (their production
  // kernels, biased clamped SwiGLU), and a long step over windows (sliding-window layers).
  v.push_back({"synth:gpt-oss-tiny", "f32", "doorbell"});
  v.push_back({"synth:gpt-oss-tiny", "kmix", "doorbell"});
  v.push_back({"synth:gpt-oss-tiny", "kmix", "zmq"});
  v.push_back({"synth:gpt-oss-tiny", "kmix", "doorbell", "doorbell", 10});
  // Every other description the reference runs, on its tiny F32 file: glm4moe (dense leading
  // layer, sigmoid group-limited router, routed scaling, ungated shared expert), qwen2moe,
  // qwen35moe (tiled value heads, split beta/alpha), deepseek2 (MLA: its latent cache).
  for (const char* a : {"tiny:glm4moe", "tiny:glm4moe:qknorm_groups", "tiny:qwen2moe", "tiny:gpt-oss", "tiny:qwen35moe",
                        "tiny:deepseek2:lite", "tiny:deepseek2:v3", "tiny:deepseek2:kv_b"})
    v.push_back({a, "f32", "doorbell"});
  v.push_back({"tiny:glm4moe", "f32", "doorbell", "doorbell", 10});
  v.push_back({"tiny:deepseek2:v3", "f32", "doorbell", "doorbell", 10});
  return v;
}

std::vector<Case> greedy_cases() {
  return {{"qwen3moe_odd", "f32", "doorbell", "doorbell"}, {"qwen3next_k256", "kmix", "doorbell", "doorbell"},
          {"qwen3moe_odd", "q8_0", "zmq", "zmq"}, {"synth:gpt-oss-tiny", "kmix", "doorbell", "doorbell"}};
}

INSTANTIATE_TEST_SUITE_P(Golden, GroupMatchesReference, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name(); });
INSTANTIATE_TEST_SUITE_P(Golden, GroupGreedyTokens, ::testing::ValuesIn(greedy_cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name(); });
INSTANTIATE_TEST_SUITE_P(Golden, GroupSpeculation,
                         ::testing::Values(Case{"qwen3moe_odd", "f32", "doorbell"},
                                           Case{"qwen3moe_k256", "kmix", "doorbell", "zmq"},
                                           Case{"qwen3next_k256", "kmix", "doorbell"}),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name(); });

}  // namespace
}  // namespace moraine::group_test
