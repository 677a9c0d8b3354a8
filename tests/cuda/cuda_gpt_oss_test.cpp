// gpt-oss on the CUDA backend (issue 28): the backend driven as the gpu_worker drives it (embed,
// layer_whole per layer or layer_begin / layer_end, advance, logits; decode from a captured graph)
// against the reference executor (common/reference, which matches llama.cpp on gpt-oss to 6.6e-7:
// tests/reference/arch_llama_test.cpp), on
//  - moraine-synth's gpt-oss-tiny (n_embd 256, 8 heads of 32 over 2 kv heads, window 8 on even
//    layers, YaRN factor 32, 8 experts top-2 of width 256): Q4_K experts with Q8_0 elsewhere (the
//    fused MoE kernel's gpt-oss build serves the experts), MXFP4 experts (as the released files),
//    the Q4_K file with an F16 KV cache, and all F32;
//  - tests/reference/tiny_arch_model.h's F32 gpt-oss (heads of 16, window 4, F32 experts: the
//    per-expert matvec path with swiglu_experts), with YaRN's correction dims rounded (llama.cpp)
//    and fractional (rope.scaling.yarn_truncate false: gpt-oss's own config).
// Bounds: the golden tests' (tests/cuda/cuda_backend_golden_test.cpp, tests/reference/
// float_order_bound.h): F32 weights 1e-4 of max |logit|; quantized weights (or an F16 cache)
// max(floor, 2 x the reference's own gap over 32 other float orders of its dots on the same rows).
// Checked: logits at every position of a 40-token prompt (5x the synth window: sliding layers
// slide), of a 100-token prompt through the tiled attention_prefill (and, as the golden test's long
// prefill, through cuBLAS / the expert GEMMs: finite, the reference's top token at clear margins),
// greedy tokens identical to the reference's (a parting only at a
// near tie within the bound, as the golden test allows), decode after prefill bit-identical to a
// fresh prefill, and the even experts on the device with the odd ones from the host
// (reference::routed_expert, as the cpu workers run them).
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "gpu_worker/backend.h"
#include "tests/cuda/cuda_arch_test.h"
#include "tests/cuda/cuda_test_support.h"
#include "tests/reference/tiny_arch_model.h"
#include "tests/synth/synth_run.h"

namespace moraine {
namespace {

namespace fs = std::filesystem;

struct Case {
  std::string name;     // also the file's
  std::string synth;    // moraine-synth's type arguments; empty: tiny_arch_model's F32 file
  bool quantized;
  model::KvType kv = model::KvType::F32;
  bool yarn_truncate = true;   // the tiny file's rope.scaling.yarn_truncate (false: HF's fractional dims)
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

fs::path model_file(const Case& c) {
  static const fs::path dir = fs::temp_directory_path() / ("moraine-cuda-gpt-oss-" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string stem = c.synth.empty() ? (c.yarn_truncate ? "tiny_f32" : "tiny_f32_fractional") : c.synth;
  fs::path p = dir / (std::to_string(std::hash<std::string>{}(stem)) + ".gguf");
  if (fs::exists(p)) return p;
  if (c.synth.empty()) {
    std::vector<std::vector<float>> data;
    model::HParams hp = test::tiny_hparams("gpt-oss");
    hp.rope_yarn_truncate = c.yarn_truncate;
    for (int64_t il = 0; il < hp.n_layer; ++il) hp.recipes[il] = hp.desc->layer_recipe(hp, il);
    test::tiny_writer(hp, 7, data).write(p.string());
    return p;
  }
  const test::SynthRun r = test::run_synth("--shape gpt-oss-tiny --vocab-size 512 --seed 5 " + c.synth + " -o " + p.string(),
                                           dir.string());
  if (r.status != 0) throw std::runtime_error("moraine-synth " + c.synth + " failed:\n" + r.err);
  return p;
}

class CudaGptOss : public cuda_arch_test::ArchTest<Case> {};

TEST_P(CudaGptOss, LoadsWithEveryPart) {
  const model::LayerRecipe& r0 = model_->layers[0].recipe;
  EXPECT_GT(r0.mixer.attn.sliding_window, 0);
  EXPECT_EQ(model_->layers[1].recipe.mixer.attn.sliding_window, 0);
  EXPECT_TRUE(r0.mixer.attn.sinks && r0.mixer.attn.qkv_bias && r0.mixer.attn.o_bias);
  EXPECT_EQ(r0.mixer.attn.rope.scaling, model::RopeScaling::Yarn);
  EXPECT_EQ(r0.mixer.attn.rope.yarn_truncate, GetParam().yarn_truncate);
  EXPECT_EQ(r0.ffn.router.kind, model::RouterKind::TopKSoftmax);
  EXPECT_EQ(r0.ffn.experts.act, model::Activation::SwiGluClamped);
  EXPECT_TRUE(r0.ffn.experts.biases);
}

// 40 tokens: at least 5 windows, in one step below the tiled threshold (split-KV or flash-decoding
// attention, the matvecs, moe_fused in 16-token groups).
TEST_P(CudaGptOss, PrefillLogitsMatchAtEveryPosition) {
  checks().expect_prefill(*backend_, cuda_arch_test::prompt(*model_, 40, 1), "prefill");
}

// 100 tokens through the long-step kernels, as the golden test's LongPrefillMatchesTheReference:
// the tiled attention (attention_prefill with the window and sinks; over the F16 cache too) with the
// per-row matmuls within the bound at every position (the split-KV kernel on the same rows printed
// beside it); with the cuBLAS matmuls (BF16 inputs: not the reference's quantized dots, their bound
// is gemm_prefill_test's per product; the experts' GEMM path with swiglu_experts and the down bias)
// finite logits and the top token of the reference with float activations (kFloatDots: cuBLAS's
// arithmetic before its 16-bit rounding) wherever that reference's top two are clearly apart.
TEST_P(CudaGptOss, LongPromptThroughTiledPrefill) {
  checks().expect_long_prefill(cuda_arch_test::prompt(*model_, 100, 2));
}

TEST_P(CudaGptOss, GreedyTokensAndDecodeEqualsPrefill) {
  checks().expect_greedy_and_decode(*backend_, cuda_arch_test::prompt(*model_, 30, 3), 24);
}

// The even experts on the device, the odd ones from the host (reference::routed_expert: biases
// and clamped SwiGLU there too), through layer_begin / layer_end; prefill then six decode steps.
TEST_P(CudaGptOss, SplitExpertsMatchTheReference) {
  checks().expect_split_experts(cuda_arch_test::prompt(*model_, 24, 4));
}

// Without a device too: every file's recipes use only parts the CUDA backend lists (the load-time
// refusal, model::check_supported, would name the first one it lacks).
TEST(CudaGptOssSupport, BackendListsEveryPartOfTheFiles) {
  for (const Case& c : {Case{"synth_q4k", "--map _exps.=q4_k --default q8_0", true}, Case{"tiny_f32", "", false}}) {
    const model::Model m = model::Model::load(model_file(c).string());
    EXPECT_NO_THROW(model::check_supported(m, gpu_worker::cuda_backend_support())) << c.name;
  }
}

// The group's decode step (the gpu_worker with cpu workers): one launch with in-graph hand-offs
// (handoff_begin), the odd experts computed here at each layer the device hands over, gives the
// layer-by-layer split's logits bit for bit (the golden test's HandoffStepEqualsLayerByLayer).
TEST_P(CudaGptOss, HandoffStepEqualsLayerByLayer) {
  checks().expect_handoff_equals_layers(cuda_arch_test::prompt(*model_, 20, 5));
}

INSTANTIATE_TEST_SUITE_P(
    Files, CudaGptOss,
    ::testing::Values(Case{"synth_q4k", "--map _exps.=q4_k --default q8_0", true},
                      Case{"synth_mxfp4", "--map _exps.=mxfp4 --default q8_0", true},
                      Case{"synth_q4k_f16kv", "--map _exps.=q4_k --default q8_0", true, model::KvType::F16},
                      Case{"synth_f32", "--map _exps.=f32 --map ffn_gate_inp=f32 --default f32", false},
                      Case{"tiny_f32", "", false},
                      Case{"tiny_f32_fractional", "", false, model::KvType::F32, false}),
    [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

}  // namespace
}  // namespace moraine
