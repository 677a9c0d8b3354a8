// glm4moe (GLM-4.5 / 4.5-Air) on the CUDA backend (issue 28) against the reference executor
// (common/reference, which matches llama.cpp on glm4moe: tests/reference/arch_llama_test.cpp), with
// the checks of tests/cuda/cuda_arch_test.h, on
//  - moraine-synth's glm4moe-tiny (n_embd 256, 8 heads of 32 over 2 kv heads, half rotary, q/k/v
//    biases, one dense layer of width 512, 8 experts top-2 of width 256 with the choice bias and a
//    shared expert): Q4_K experts with Q8_0 elsewhere (moe_fused, the captured decode step, the
//    in-graph hand-off; the dense layer's Q8_0 matvecs and, for long steps, its cuBLAS GEMMs), and
//    the same file with an F16 KV cache;
//  - tests/reference/tiny_arch_model.h's F32 glm4moe (routed scale 2.5, renormalised, shared
//    expert, a leading dense layer; the per-expert matvec path) and its "qknorm_groups" variant
//    (q/k norm after the biases, 12 experts in 4 groups of which 1 is used, not renormalised),
//    the latter also quantized to Q8_0 by moraine-quantize (moe_fused and the graph on it).
// Checked: logits at every position of a 40-token prompt, of a 100-token prompt through the tiled
// attention and cuBLAS, greedy tokens, decode after prefill bit-identical to a fresh prefill, the
// even experts on the device with the odd ones from the host (the combine with the routed scale
// and the ungated shared expert over the cpu workers' rows), and the in-graph hand-off.
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
  std::string name;       // also the file's
  std::string synth;      // moraine-synth's type arguments (glm4moe-tiny); empty: tiny_arch_model's file
  bool quantized;
  model::KvType kv = model::KvType::F32;
  std::string tiny = "glm4moe";   // tiny_hparams' name of the tiny file
  std::string quantize = "";      // moraine-quantize's arguments for the tiny file (empty: F32)
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

fs::path model_file(const Case& c) {
  return cuda_arch_test::arch_file("glm4moe", c.synth.empty() ? "" : "glm4moe-tiny", c.synth, c.tiny, c.quantize);
}

class CudaGlm4Moe : public cuda_arch_test::ArchTest<Case> {};

TEST_P(CudaGlm4Moe, LoadsWithEveryPart) {
  const model::LayerRecipe& r0 = model_->layers[0].recipe;
  const model::LayerRecipe& r1 = model_->layers[1].recipe;
  EXPECT_EQ(r0.ffn.kind, model::FfnKind::Dense);
  EXPECT_TRUE(backend_->layer_on_device(0));   // a dense layer runs whole on the device
  EXPECT_EQ(r1.ffn.kind, model::FfnKind::Moe);
  EXPECT_EQ(r1.ffn.router.kind, model::RouterKind::SigmoidGroupTopK);
  EXPECT_TRUE(r1.ffn.router.score_bias && !model_->layers[1].moe.score_bias.empty());
  EXPECT_TRUE(r1.ffn.shared.present && !r1.ffn.shared.gated);
  EXPECT_TRUE(r1.mixer.attn.qkv_bias);
  EXPECT_LT(r1.mixer.attn.rope.n_rot, model_->hp.head_dim);   // partial RoPE
  EXPECT_EQ(r1.mixer.attn.qk_norm, GetParam().tiny == "glm4moe:qknorm_groups");
}

// 40 tokens in one step below the tiled threshold (split-KV / flash-decoding attention, the
// matvecs, moe_fused in 16-token groups or the per-expert matvecs).
TEST_P(CudaGlm4Moe, PrefillLogitsMatchAtEveryPosition) {
  checks().expect_prefill(*backend_, cuda_arch_test::prompt(*model_, 40, 1), "prefill");
}

// 100 tokens: the tiled attention, and cuBLAS for the dense layer's and the experts' matmuls.
TEST_P(CudaGlm4Moe, LongPromptThroughTiledPrefill) {
  checks().expect_long_prefill(cuda_arch_test::prompt(*model_, 100, 2));
}

TEST_P(CudaGlm4Moe, GreedyTokensAndDecodeEqualsPrefill) {
  checks().expect_greedy_and_decode(*backend_, cuda_arch_test::prompt(*model_, 30, 3), 24);
}

// The even experts on the device, the odd ones from the host; the dense layer whole on the device.
TEST_P(CudaGlm4Moe, SplitExpertsMatchTheReference) {
  checks().expect_split_experts(cuda_arch_test::prompt(*model_, 24, 4));
}

TEST_P(CudaGlm4Moe, HandoffStepEqualsLayerByLayer) {
  checks().expect_handoff_equals_layers(cuda_arch_test::prompt(*model_, 20, 5));
}

INSTANTIATE_TEST_SUITE_P(
    Files, CudaGlm4Moe,
    ::testing::Values(Case{"synth_q4k", "--map _exps.=q4_k --default q8_0", true},
                      Case{"synth_q4k_f16kv", "--map _exps.=q4_k --default q8_0", true, model::KvType::F16},
                      Case{"tiny_f32", "", false},
                      Case{"tiny_f32_qknorm_groups", "", false, model::KvType::F32, "glm4moe:qknorm_groups"},
                      Case{"tiny_q8_qknorm_groups", "", true, model::KvType::F32, "glm4moe:qknorm_groups",
                           "--default q8_0"}),
    [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// Without a device too: every file's recipes use only parts the CUDA backend lists (the load-time
// refusal, model::check_supported, would name the first one it lacks).
TEST(CudaGlm4MoeSupport, BackendListsEveryPartOfTheFiles) {
  for (const Case& c : {Case{"synth_q4k", "--map _exps.=q4_k --default q8_0", true}, Case{"tiny_f32", "", false},
                        Case{"tiny_f32_qknorm_groups", "", false, model::KvType::F32, "glm4moe:qknorm_groups"},
                        Case{"tiny_q8_qknorm_groups", "", true, model::KvType::F32, "glm4moe:qknorm_groups", "--default q8_0"}}) {
    const model::Model m = model::Model::load(model_file(c).string());
    EXPECT_NO_THROW(model::check_supported(m, gpu_worker::cuda_backend_support())) << c.name;
  }
}

}  // namespace
}  // namespace moraine
