// The prefill bound's model-side arithmetic (tools/bench/prefill_bound.h) against numbers worked
// out by hand: FLOPs per prompt token of tiny synth qwen3moe / qwen3next files, the expected
// distinct experts a step copies, and the bound of the two parts.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "common/model/model.h"
#include "tests/reference/synthetic_model.h"
#include "tools/bench/prefill_bound.h"

namespace moraine::bench {
namespace {

model::Model load_synth(const testing::SyntheticSpec& spec, std::string& path) {
  path = testing::temp_path("prefill-bound");
  testing::SyntheticModel sm(spec);
  sm.write(path);
  return model::Model::load(path);
}

// SyntheticSpec's defaults: n_embd 64, n_vocab 97, 4 heads of 16 (2 kv heads), 6 experts top-2 of
// n_ff 32; qwen3next adds a shared expert of 48 and DeltaNet layers (2 key heads, 4 value heads of 16).
TEST(PrefillModel, Qwen3MoeFlopsPerTokenByHand) {
  std::string path;
  const model::Model m = load_synth(testing::SyntheticSpec{}, path);
  const PrefillModel p = prefill_model(m);
  // Per layer: q 2*64*64 + k 2*64*32 + v 2*64*32 + o 2*64*64 = 24576; router 2*64*6 = 768;
  // two experts of gate + up + down, 3 * 2*32*64 each = 2 * 12288 = 24576.
  constexpr double kLayer = 24576 + 768 + 24576;
  EXPECT_DOUBLE_EQ(p.weight_flops, 2 * kLayer);
  EXPECT_DOUBLE_EQ(p.head_flops, 2.0 * 97 * 64);
  EXPECT_DOUBLE_EQ(p.deltanet_flops, 0.0);
  ASSERT_EQ(p.attention.size(), 2u);
  EXPECT_DOUBLE_EQ(p.attention[0].flops_per_position, 2.0 * 4 * (16 + 16));   // Q K^T and P V
  EXPECT_EQ(p.attention[0].window, 0);
  // An 8-token prompt: each query sees 4.5 positions on average; the head runs for the last row.
  EXPECT_DOUBLE_EQ(p.flops_per_token(8), 2 * kLayer + 2 * 256 * 4.5 + 2.0 * 97 * 64 / 8);
  EXPECT_EQ(p.n_embd, 64);
  EXPECT_EQ(p.n_ff, 32);
  EXPECT_EQ(p.n_expert, 6);
  EXPECT_EQ(p.n_expert_used, 2);
  EXPECT_EQ(p.gate_type, TensorType::F32);
  std::filesystem::remove(path);
}

TEST(PrefillModel, Qwen3NextFlopsPerTokenByHand) {
  testing::SyntheticSpec spec;
  spec.arch = "qwen3next";
  std::string path;
  const model::Model m = load_synth(spec, path);
  const PrefillModel p = prefill_model(m);
  // MoE of every layer: router 768, two experts 24576, shared gate / up / down 3 * 2*64*48 =
  // 18432, the shared expert's gate vector 2*64 = 128.
  constexpr double kMoe = 768 + 24576 + 18432 + 128;
  // Layer 0 (DeltaNet): qkv 2*64*(2*32 + 64) = 16384, z 2*64*64 = 8192, ba 2*64*8 = 1024,
  // conv taps 2 * 4 * 128 = 1024, out 2*64*64 = 8192.
  constexpr double kDeltaNet = 16384 + 8192 + 1024 + 1024 + 8192;
  // Layer 1 (gated attention): q carries the gate, 2*64*128 = 16384; k, v 4096 each; o 8192.
  constexpr double kAttention = 16384 + 4096 + 4096 + 8192;
  EXPECT_DOUBLE_EQ(p.weight_flops, kDeltaNet + kAttention + 2 * kMoe);
  EXPECT_DOUBLE_EQ(p.deltanet_flops, 7.0 * 4 * 16 * 16);   // 4 value heads, 16 x 16 state each
  ASSERT_EQ(p.attention.size(), 1u);
  EXPECT_DOUBLE_EQ(p.attention[0].flops_per_position, 256.0);
  EXPECT_DOUBLE_EQ(p.attention_flops_per_token(100), 256.0 * 50.5);
  std::filesystem::remove(path);
}

TEST(PrefillModel, MeanCausalContext) {
  EXPECT_DOUBLE_EQ(mean_causal_context(4, 0), 2.5);    // (1 + 2 + 3 + 4) / 4
  EXPECT_DOUBLE_EQ(mean_causal_context(4, 2), 1.75);   // (1 + 2 + 2 + 2) / 4
  EXPECT_DOUBLE_EQ(mean_causal_context(4, 9), 2.5);    // a window wider than the prompt
  EXPECT_DOUBLE_EQ(mean_causal_context(0, 0), 0.0);
}

// One layer of 4 experts top-2, 1000 bytes each: VRAM, RAM, RAM, FILE.
ExpertStaging four_experts() {
  ExpertStaging s;
  s.n_expert = 4;
  s.n_expert_used = 2;
  s.long_step_rows = 8192;
  s.window_rows = 512;
  s.expert_bytes = {1000.0};
  s.tier = {0, 1, 1, 2};
  return s;
}

TEST(PrefillStaging, UniformDistinctExpertsPerStep) {
  const ExpertStaging s = four_experts();
  // Uniform: each row picks an expert with p = k/E = 1/2; two rows use it with 1 - 1/4 = 3/4.
  EXPECT_DOUBLE_EQ(staged_bytes_per_token(s, 2, 1), 2 * 0.75 * 1000 / 2);   // the two RAM experts
  EXPECT_DOUBLE_EQ(staged_bytes_per_token(s, 2, 2), 0.75 * 1000 / 2);       // the FILE one
  EXPECT_DOUBLE_EQ(staged_bytes_per_token(s, 1, 1), 2 * 0.5 * 1000);
  EXPECT_DOUBLE_EQ(staged_bytes_per_token(s, 0, 1), 0.0);
  // The formula at the 30B shape: E (1 - (1 - k/E)^rows) distinct experts, all in RAM.
  ExpertStaging big;
  big.n_expert = 128;
  big.n_expert_used = 8;
  big.expert_bytes = {3.0e6};
  big.tier.assign(128, 1);
  const double distinct = 128 * (1 - std::pow(1 - 8.0 / 128, 16));
  EXPECT_NEAR(staged_bytes_per_token(big, 16, 1), distinct * 3.0e6 / 16, 1e-9 * distinct * 3.0e6 / 16);
}

TEST(PrefillStaging, CensusPopularityPerExpert) {
  ExpertStaging s = four_experts();
  s.popularity = {10, 30, 0, 60};   // shares 0.1, 0.3, 0, 0.6; per row p = 2 x share, at most 1
  // RAM experts 1 (p 0.6) and 2 (never routed): 1 - 0.4^2 = 0.84 and 0, over 2 rows.
  EXPECT_NEAR(staged_bytes_per_token(s, 2, 1), 0.84 * 1000 / 2, 1e-9);
  // FILE expert 3: p = min(1, 1.2), used by every step.
  EXPECT_DOUBLE_EQ(staged_bytes_per_token(s, 2, 2), 1000.0 / 2);
  s.popularity = {0, 0, 0, 0};      // a layer the census never saw: uniform
  EXPECT_DOUBLE_EQ(staged_bytes_per_token(s, 2, 1), 2 * 0.75 * 1000 / 2);
}

TEST(PrefillBoundTest, SlowerPartSetsTheBound) {
  PrefillModel pm;
  pm.weight_flops = 1e9;
  ExpertStaging s = four_experts();
  s.tier = {1, 1, 1, 1};
  s.expert_bytes = {1e6};
  GemmRates gemm;
  gemm.engine_flops_s = 1e15;   // 1e9 FLOPs a token: 1 us
  // 4096 rows use every expert (1 - 2^-4096 == 1): 4 MB a step, 976.5625 B a token, at 1 GB/s 0.977 us.
  const PrefillBound b = prefill_bound(4096, pm, s, "", 1e9, std::nullopt, gemm);
  EXPECT_EQ(b.step_rows, 4096);
  EXPECT_TRUE(b.long_step);
  EXPECT_DOUBLE_EQ(b.pcie_bytes_per_token, 4e6 / 4096);
  ASSERT_TRUE(b.tok_s.has_value()) << b.why_none;
  EXPECT_DOUBLE_EQ(*b.tok_s, 1e6);
  EXPECT_EQ(b.limiting, "gpu");
  gemm.engine_flops_s = 1e16;   // now the copies are slower: 1 / 0.9765625 us
  const PrefillBound c = prefill_bound(4096, pm, s, "", 1e9, std::nullopt, gemm);
  ASSERT_TRUE(c.tok_s.has_value()) << c.why_none;
  EXPECT_DOUBLE_EQ(*c.tok_s, 1.024e6);
  EXPECT_EQ(c.limiting, "pcie");
  // A step longer than long_step_rows copies once per long_step_rows rows.
  s.long_step_rows = 2048;
  const PrefillBound d = prefill_bound(8192, pm, s, "", 1e9, std::nullopt, gemm);
  EXPECT_EQ(d.step_rows, 2048);
  EXPECT_DOUBLE_EQ(d.pcie_bytes_per_token, 4e6 / 2048);
  // One window: the engine runs a short step; the bound is still a long step's.
  EXPECT_FALSE(prefill_bound(512, pm, s, "", 1e9, std::nullopt, gemm).long_step);
}

TEST(PrefillBoundTest, MissingRatesSayWhy) {
  PrefillModel pm;
  pm.weight_flops = 1e9;
  const ExpertStaging s = four_experts();
  GemmRates none;
  none.engine_note = "n/a: no GPU";
  const PrefillBound a = prefill_bound(4096, pm, s, "", 1e9, 1e9, none);
  EXPECT_FALSE(a.tok_s.has_value());
  EXPECT_NE(a.why_none.find("n/a: no GPU"), std::string::npos) << a.why_none;
  GemmRates gemm;
  gemm.engine_flops_s = 1e15;
  const PrefillBound b = prefill_bound(4096, pm, s, "", std::nullopt, 1e9, gemm);
  EXPECT_FALSE(b.tok_s.has_value());
  EXPECT_NE(b.why_none.find("PCIe"), std::string::npos) << b.why_none;
  const PrefillBound c = prefill_bound(4096, pm, std::nullopt, "the engine computes on the CPU", 1e9, 1e9, gemm);
  EXPECT_FALSE(c.tok_s.has_value());
  EXPECT_EQ(c.why_none, "the engine computes on the CPU");
  EXPECT_DOUBLE_EQ(c.flops_per_token, 1e9);   // the FLOPs are reported even without a bound
}

}  // namespace
}  // namespace moraine::bench
