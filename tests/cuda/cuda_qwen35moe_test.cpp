// qwen35moe (Qwen3.5-MoE) on the CUDA backend (issue 28) against the reference executor
// (common/reference, which matches llama.cpp on qwen35moe: tests/reference/arch_llama_test.cpp),
// with the checks of tests/cuda/cuda_arch_test.h. qwen35moe is qwen3next's hybrid with its Gated
// DeltaNet layers laid out otherwise: value head j reads key head j % n_k (tiled), and beta and
// alpha come from ssm_beta and ssm_alpha, one row per value head (the backend stacks the two into
// one matrix when their formats agree, else runs them apart); its interleaved M-RoPE turns text
// positions as NEOX RoPE on the rotary pairs, so attention is qwen3next's. Files, all with more
// value heads than key heads (tiled and grouped heads differ):
//  - moraine-synth's qwen35moe-tiny (n_embd 256, 4 heads of 64 over 2 kv heads, 16 of them
//    rotated; DeltaNet 4 key heads, 8 value heads of 32; 16 experts top-4 of width 128, a gated
//    shared expert): Q4_K experts with Q8_0 elsewhere (moe_fused, the captured decode step, the
//    in-graph hand-off), the same with an F16 KV cache, and with ssm_beta in F16 beside a Q8_0
//    ssm_alpha (the unstacked path);
//  - tests/reference/tiny_arch_model.h's F32 qwen35moe (2 key heads, 4 value heads of 16; the
//    per-expert matvec path), and the same quantized to Q8_0 by moraine-quantize.
// Checked: logits at every position of a 40-token prompt, of a 100-token prompt through the tiled
// attention and cuBLAS, greedy tokens, decode after prefill bit-identical to a fresh prefill, the
// even experts on the device with the odd ones from the host, and the in-graph hand-off.
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "gpu_worker/backend.h"
#include "tests/cuda/cuda_arch_test.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

namespace fs = std::filesystem;

struct Case {
  std::string name;       // printed
  std::string synth;      // moraine-synth's type arguments (qwen35moe-tiny); empty: tiny_arch_model's file
  bool quantized;
  model::KvType kv = model::KvType::F32;
  std::string quantize = "";   // moraine-quantize's arguments for the tiny file (empty: F32)
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

fs::path model_file(const Case& c) {
  return cuda_arch_test::arch_file("qwen35moe", c.synth.empty() ? "" : "qwen35moe-tiny", c.synth, "qwen35moe",
                                   c.quantize);
}

const std::vector<Case>& cases() {
  static const std::vector<Case> v = {
      Case{"synth_q4k", "--map _exps.=q4_k --default q8_0", true},
      Case{"synth_q4k_f16kv", "--map _exps.=q4_k --default q8_0", true, model::KvType::F16},
      Case{"synth_beta_f16", "--map _exps.=q4_k --map ssm_beta=f16 --default q8_0", true},
      Case{"tiny_f32", "", false},
      Case{"tiny_q8", "", true, model::KvType::F32, "--default q8_0"},
  };
  return v;
}

class CudaQwen35Moe : public cuda_arch_test::ArchTest<Case> {};

TEST_P(CudaQwen35Moe, LoadsWithEveryPart) {
  const model::HParams& hp = model_->hp;
  EXPECT_GT(hp.ssm_n_v_heads, hp.ssm_n_k_heads);   // else tiled and grouped heads coincide
  for (int64_t il = 0; il < 3; ++il) {
    const model::LayerWeights& L = model_->layers[il];
    ASSERT_TRUE(L.recurrent) << "layer " << il;
    EXPECT_TRUE(L.recipe.mixer.delta.v_heads_tiled && L.recipe.mixer.delta.split_ba) << "layer " << il;
    EXPECT_TRUE(L.delta.beta && L.delta.alpha && !L.delta.ba) << "layer " << il;
    EXPECT_EQ(L.delta.beta.n_rows, hp.ssm_n_v_heads);
    // The unstacked case really has two formats (synth_beta_f16), the others one.
    EXPECT_EQ(L.delta.beta.type != L.delta.alpha.type, GetParam().name == "synth_beta_f16") << "layer " << il;
  }
  const model::LayerRecipe& r3 = model_->layers[3].recipe;
  EXPECT_FALSE(model_->layers[3].recurrent);
  EXPECT_TRUE(r3.mixer.attn.qk_norm && r3.mixer.attn.output_gate);
  EXPECT_LT(r3.mixer.attn.rope.n_rot, hp.head_dim);   // partial RoPE
  EXPECT_TRUE(r3.ffn.shared.present && r3.ffn.shared.gated);
}

// 40 tokens in one step below the tiled threshold (split-KV attention, the DeltaNet token loop).
TEST_P(CudaQwen35Moe, PrefillLogitsMatchAtEveryPosition) {
  checks().expect_prefill(*backend_, cuda_arch_test::prompt(*model_, 40, 1), "prefill");
}

// 100 tokens: the tiled attention, and cuBLAS for the projections (ba among them) and the experts.
TEST_P(CudaQwen35Moe, LongPromptThroughTiledPrefill) {
  // The tiny Q8_0 file is chaotic at 100 rows: a 1e-6 change of one weight moves the reference's
  // own logits by 0.0094 of max (session 21), so no bound separates a bug from noise there; its
  // 40-row prefill and its decode are checked above and below, the long prefill on the other four.
  if (GetParam().name == "tiny_q8") GTEST_SKIP() << "the tiny Q8_0 file amplifies float order at 100 rows";
  checks().expect_long_prefill(cuda_arch_test::prompt(*model_, 100, 2));
}

// Decode steps of one token (the fused DeltaNet decode kernel) from a captured graph.
TEST_P(CudaQwen35Moe, GreedyTokensAndDecodeEqualsPrefill) {
  checks().expect_greedy_and_decode(*backend_, cuda_arch_test::prompt(*model_, 30, 3), 24);
}

TEST_P(CudaQwen35Moe, SplitExpertsMatchTheReference) {
  checks().expect_split_experts(cuda_arch_test::prompt(*model_, 24, 4));
}

TEST_P(CudaQwen35Moe, HandoffStepEqualsLayerByLayer) {
  checks().expect_handoff_equals_layers(cuda_arch_test::prompt(*model_, 20, 5));
}

INSTANTIATE_TEST_SUITE_P(Files, CudaQwen35Moe, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// Without a device too: every file's recipes use only parts the CUDA backend lists (the load-time
// refusal, model::check_supported, would name the first one it lacks).
TEST(CudaQwen35MoeSupport, BackendListsEveryPartOfTheFiles) {
  for (const Case& c : cases()) {
    const model::Model m = model::Model::load(model_file(c).string());
    EXPECT_NO_THROW(model::check_supported(m, gpu_worker::cuda_backend_support())) << c.name;
  }
}

}  // namespace
}  // namespace moraine
