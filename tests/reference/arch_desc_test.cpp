// The architecture descriptions (common/model/arch): each one's tables are consistent, a file
// laid out by its tensor list loads, and a model using a part a backend lacks is refused at
// load with the layer, the part and the backend named (never run wrongly). The gpt-oss parts'
// arithmetic is checked in gpt_oss_reference_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "common/gguf/gguf.h"
#include "common/model/layer_tensors.h"
#include "common/model/model.h"
#include "common/model/model_error.h"
#include "common/reference/executor.h"
#include "gpu_worker/backend.h"
#include "tests/reference/tiny_arch_model.h"

namespace moraine {
namespace {

using gguf::Value;

gguf::GgufWriter tiny_gpt_oss(std::vector<std::vector<float>>& data) {
  return test::tiny_writer(test::tiny_hparams("gpt-oss"), 7, data);
}

TEST(ArchDesc, RegistryListsEveryDescriptionWithConsistentTables) {
  std::set<std::string> names;
  for (const model::ArchDesc* d : model::all_archs()) {
    SCOPED_TRACE(d->name);
    EXPECT_TRUE(names.insert(d->name).second);
    EXPECT_EQ(model::find_arch(d->name), d);
    for (const std::string& hf : d->hf_architectures) EXPECT_EQ(model::find_arch_by_hf(hf), d);
    std::set<std::string> keys, gguf_names;
    for (const model::KeySpec& k : d->keys) EXPECT_TRUE(keys.insert(k.suffix).second) << k.suffix;
    for (const model::KeySpec& k : model::common_keys()) EXPECT_FALSE(keys.count(k.suffix)) << k.suffix;
    std::set<int> roles;
    for (const model::TensorName& t : d->tensors) {
      EXPECT_TRUE(roles.insert(static_cast<int>(t.role)).second) << model::tensor_role_name(t.role);
      EXPECT_TRUE(gguf_names.insert(t.gguf).second) << t.gguf;
    }
  }
  EXPECT_EQ(model::known_arch_names(), "deepseek2, glm4moe, gpt-oss, qwen2moe, qwen35moe, qwen3moe, qwen3next");
  EXPECT_EQ(model::find_arch("llama"), nullptr);
}

TEST(ArchDesc, GptOssLoadsWithItsPartsAndTheReferenceRefusesWhatItLacks) {
  std::vector<std::vector<float>> data;
  const std::string path = (std::filesystem::temp_directory_path() / "arch_desc_gpt_oss.gguf").string();
  tiny_gpt_oss(data).write(path);
  // The tensor table binds every tensor of the file (biases, sinks, post_attention_norm).
  const model::Model m = model::Model::load(path);
  ASSERT_EQ(m.layers.size(), 4u);
  const model::AttentionPart& a0 = m.layers[0].recipe.mixer.attn;
  EXPECT_EQ(a0.sliding_window, 4);
  EXPECT_EQ(m.layers[1].recipe.mixer.attn.sliding_window, 0);
  EXPECT_TRUE(a0.sinks && a0.qkv_bias && a0.o_bias && !a0.qk_norm);
  EXPECT_EQ(a0.rope.scaling, model::RopeScaling::Yarn);
  EXPECT_DOUBLE_EQ(a0.rope.yarn_factor, 32.0);
  EXPECT_EQ(a0.rope.yarn_orig_ctx, 4096);
  EXPECT_EQ(m.layers[0].recipe.ffn.router.kind, model::RouterKind::TopKSoftmax);
  EXPECT_EQ(m.layers[0].recipe.ffn.experts.act, model::Activation::SwiGluClamped);
  EXPECT_EQ(m.layers[0].attn.sinks.size(), 4u);
  EXPECT_EQ(m.layers[1].moe.gate_bias.size(), 4u * 32u);
  EXPECT_EQ(m.layers[1].moe.down_bias.size(), 4u * 64u);
  EXPECT_EQ(m.layers[0].attn.q_bias.size(), 64u);
  EXPECT_EQ(m.layers[2].recipe.mixer.attn.sliding_window, 4);
  EXPECT_EQ(m.layers[3].recipe.mixer.attn.sliding_window, 0);
  EXPECT_FALSE(m.layers[0].attn.q_has_gate);
  EXPECT_FALSE(m.layers[0].recurrent);
  // Both gpu_worker backends run them (the CPU backend the reference's parts, CUDA its own kernels).
  EXPECT_NO_THROW(model::check_supported(m, gpu_worker::cpu_backend_support()));
  EXPECT_NO_THROW(model::check_supported(m, gpu_worker::cuda_backend_support()));
  // One missing part is enough, and it is the one named.
  const model::BackendSupport no_sinks("test backend", {
      model::Feature::Attention, model::Feature::AttnQkvBias, model::Feature::AttnOutputBias, model::Feature::SlidingWindow,
      model::Feature::YarnRope, model::Feature::RouterTopKSoftmax, model::Feature::RouterLogitBias,
      model::Feature::SwiGluClamped, model::Feature::ExpertBiases});
  try {
    model::check_supported(m, no_sinks);
    FAIL() << "a backend without sinks accepted gpt-oss";
  } catch (const model::ModelError& e) {
    EXPECT_NE(std::string(e.what()).find("uses attention sinks, which the test backend"), std::string::npos) << e.what();
  }
  // The reference implements them all.
  EXPECT_NO_THROW(model::check_supported(m, model::reference_support()));
  std::filesystem::remove(path);
}

TEST(ArchDesc, KeyTablesAreEnforcedAndBadYarnIsNamed) {
  std::vector<std::vector<float>> data;
  gguf::GgufWriter w = tiny_gpt_oss(data);
  w.set("gpt-oss.rope.scaling.type", Value::string("longrope"));
  const std::string path = (std::filesystem::temp_directory_path() / "arch_desc_bad_rope.gguf").string();
  w.write(path);
  try {
    (void)model::Model::load(path);
    FAIL() << "loaded a gpt-oss with longrope";
  } catch (const model::ModelError& e) {
    EXPECT_NE(std::string(e.what()).find("gpt-oss.rope.scaling.type: 'longrope'"), std::string::npos) << e.what();
  }
  std::filesystem::remove(path);
}

std::string write_tiny(const std::string& name, std::vector<std::vector<float>>& data,
                       void (*edit)(gguf::GgufWriter&) = nullptr) {
  std::string stem = name;
  for (char& c : stem) c = c == ':' ? '_' : c;
  const std::string path = (std::filesystem::temp_directory_path() / ("arch_desc_" + stem + ".gguf")).string();
  gguf::GgufWriter w = test::tiny_writer(test::tiny_hparams(name), 7, data);
  if (edit != nullptr) edit(w);
  w.write(path);
  return path;
}

// The tiny file of `name` (tiny_hparams) at a path named by tag, with one key set when `key` is given.
std::string tiny_file_with_key(const std::string& name, const std::string& tag, const std::string& key = "",
                       Value value = Value::u32(0)) {
  std::vector<std::vector<float>> data;
  gguf::GgufWriter w = test::tiny_writer(test::tiny_hparams(name), 7, data);
  if (!key.empty()) w.set(key, std::move(value));
  const std::string path = (std::filesystem::temp_directory_path() / ("arch_desc_" + tag + ".gguf")).string();
  w.write(path);
  return path;
}

// deepseek2's keys pick its parts as llama.cpp's do: q LoRA or not, attn_k_b / attn_v_b (with
// key_length_mla) or the fused attn_kv_b, the router from expert_gating_func, leading dense
// layers, ungated shared experts, DeepSeek's YaRN scale.
TEST(ArchDesc, Deepseek2VariantsLoadWithTheirParts) {
  {
    std::vector<std::vector<float>> data;
    const std::string path = write_tiny("deepseek2:lite", data);
    const model::Model m = model::Model::load(path);
    EXPECT_EQ(m.hp.arch_string(), std::string("deepseek2"));
    const model::LayerRecipe& r0 = m.layers[0].recipe;
    const model::LayerRecipe& r1 = m.layers[1].recipe;
    EXPECT_EQ(r0.mixer.kind, model::MixerKind::Mla);
    EXPECT_EQ(r0.ffn.kind, model::FfnKind::Dense);
    EXPECT_EQ(r0.ffn.dense_ff, 48);
    EXPECT_EQ(r1.ffn.kind, model::FfnKind::Moe);
    EXPECT_EQ(r1.ffn.router.kind, model::RouterKind::SoftmaxTopK);
    EXPECT_FALSE(r1.ffn.router.renormalize);
    EXPECT_TRUE(r1.ffn.shared.present && !r1.ffn.shared.gated);
    EXPECT_EQ(r1.ffn.shared.n_ff, 64);
    const model::MlaPart& p = r1.mixer.mla;
    EXPECT_EQ(p.q_lora_rank, 0);
    EXPECT_EQ(p.kv_lora_rank, 32);
    EXPECT_EQ(p.rope_dim, 8);
    EXPECT_EQ(p.nope_dim, 16);
    EXPECT_EQ(p.v_dim, 16);
    EXPECT_TRUE(p.split_kv_b);
    // mscale = 1 + 0.1 * mscale_all_dim * ln(factor), squared over sqrt(nope + rope); cos and sin unscaled.
    const double mscale = 1.0 + 0.1 * 0.707 * std::log(40.0);
    EXPECT_NEAR(p.kq_scale, mscale * mscale / std::sqrt(24.0), 1e-6);
    EXPECT_NEAR(r1.mixer.attn.rope.attn_factor * (1.0 + 0.1 * std::log(40.0)), 1.0, 1e-12);
    EXPECT_TRUE(m.layers[1].mla.q && !m.layers[1].mla.q_a && !m.layers[1].mla.kv_b);
    EXPECT_EQ(m.layers[1].mla.k_b.n_expert, 4);   // one matrix per head
    EXPECT_EQ(m.layers[1].mla.k_b.expert(0).n_cols, 16);
    EXPECT_EQ(m.layers[1].mla.v_b.expert(0).n_rows, 16);
    EXPECT_TRUE(m.layers[0].dense.gate && !m.layers[0].moe.router);
    EXPECT_NO_THROW(model::check_supported(m, model::reference_support()));
    // The gpu_worker's CPU backend runs the reference's MLA; the CUDA backend has none: refused, naming it.
    EXPECT_NO_THROW(model::check_supported(m, gpu_worker::cpu_backend_support()));
    for (const model::BackendSupport* b : {&gpu_worker::cuda_backend_support()}) {
      try {
        model::check_supported(m, *b);
        FAIL() << b->name() << " accepted a deepseek2 model";
      } catch (const model::ModelError& e) {
        EXPECT_NE(std::string(e.what()).find("deepseek2 layer 0 uses multi-head latent attention (MLA)"), std::string::npos)
            << e.what();
      }
    }
    std::filesystem::remove(path);
  }
  {
    std::vector<std::vector<float>> data;
    const std::string path = write_tiny("deepseek2:kv_b", data);
    const model::Model m = model::Model::load(path);
    EXPECT_FALSE(m.layers[1].recipe.mixer.mla.split_kv_b);
    EXPECT_TRUE(m.layers[1].mla.kv_b && !m.layers[1].mla.k_b);
    EXPECT_EQ(m.layers[1].mla.kv_b.n_rows, 4 * (16 + 16));
    std::filesystem::remove(path);
  }
  {
    std::vector<std::vector<float>> data;
    const std::string path = write_tiny("deepseek2:v3", data);
    const model::Model m = model::Model::load(path);
    const model::LayerRecipe& r1 = m.layers[1].recipe;
    EXPECT_EQ(r1.mixer.mla.q_lora_rank, 24);
    EXPECT_TRUE(m.layers[1].mla.q_a && m.layers[1].mla.q_b && !m.layers[1].mla.q);
    EXPECT_EQ(m.layers[1].mla.q_a_norm.size(), 24u);
    EXPECT_EQ(r1.ffn.router.kind, model::RouterKind::SigmoidGroupTopK);
    EXPECT_TRUE(r1.ffn.router.renormalize && r1.ffn.router.score_bias);
    EXPECT_DOUBLE_EQ(r1.ffn.router.routed_scale, 2.5);
    EXPECT_EQ(m.layers[1].moe.score_bias.size(), 8u);
    const double mscale = 1.0 + 0.1 * std::log(40.0);
    EXPECT_NEAR(r1.mixer.mla.kq_scale, mscale * mscale / std::sqrt(24.0), 1e-6);
    std::filesystem::remove(path);
  }
  {
    // A sigmoid router without exp_probs_b in the file (llama.cpp's tensor is optional): no choice bias.
    model::HParams hp = test::tiny_hparams("deepseek2:v3");
    hp.expert_score_bias = false;
    for (int64_t il = 0; il < hp.n_layer; ++il) hp.recipes[static_cast<size_t>(il)] = hp.desc->layer_recipe(hp, il);
    std::vector<std::vector<float>> data;
    const std::string path = (std::filesystem::temp_directory_path() / "arch_desc_deepseek2_nobias.gguf").string();
    test::tiny_writer(hp, 7, data).write(path);
    const model::Model m = model::Model::load(path);
    EXPECT_EQ(m.layers[1].recipe.ffn.router.kind, model::RouterKind::SigmoidGroupTopK);
    EXPECT_FALSE(m.layers[1].recipe.ffn.router.score_bias);
    EXPECT_TRUE(m.layers[1].moe.score_bias.empty());
    std::filesystem::remove(path);
  }
}

TEST(ArchDesc, Deepseek2BadKeysAreNamed) {
  const auto refused = [](const std::string& name, void (*edit)(gguf::GgufWriter&), const std::string& want) {
    std::vector<std::vector<float>> data;
    const std::string path = write_tiny(name, data, edit);
    try {
      (void)model::Model::load(path);
      ADD_FAILURE() << "loaded: " << want;
    } catch (const model::ModelError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    std::filesystem::remove(path);
  };
  refused("deepseek2:lite", [](gguf::GgufWriter& w) { w.set("deepseek2.attention.key_length", Value::u32(24)); },
          "deepseek2.attention.key_length: must be kv_lora_rank + rope.dimension_count");
  refused("deepseek2:lite", [](gguf::GgufWriter& w) { w.set("deepseek2.expert_gating_func", Value::u32(3)); },
          "deepseek2.expert_gating_func: only softmax (1) and sigmoid (2)");
  refused("deepseek2:kv_b", [](gguf::GgufWriter& w) { w.set("deepseek2.attention.value_length_mla", Value::u32(16)); },
          "key_length_mla and value_length_mla come together");
  refused("deepseek2:v3", [](gguf::GgufWriter& w) { w.set("deepseek2.attention.temperature_scale", Value::f32(0.1f)); },
          "deepseek2.attention.temperature_scale: attention temperature scaling is not implemented");
  refused("deepseek2:lite", [](gguf::GgufWriter& w) { w.set("deepseek2.expert_group_count", Value::u32(2)); },
          "group-limited softmax routing (DeepSeek-V2 236B) is not implemented");
  // Without MLA the value width must still be the key width.
  refused("qwen3moe", [](gguf::GgufWriter& w) { w.set("qwen3moe.attention.value_length", Value::u32(8)); },
          "qwen3moe.attention.value_length: differs from key_length (8 vs 16)");
}

// The message of the ModelError that loading path throws ("" when it loads).
std::string load_error(const std::string& path) {
  try {
    (void)model::Model::load(path);
  } catch (const model::ModelError& e) {
    std::filesystem::remove(path);
    return e.what();
  }
  std::filesystem::remove(path);
  return "";
}

TEST(ArchDesc, Glm4MoeBindsDenseMoeAndNextnLayers) {
  const std::string path = tiny_file_with_key("glm4moe", "glm4moe");
  const model::Model m = model::Model::load(path);
  ASSERT_EQ(m.layers.size(), 4u);
  EXPECT_EQ(m.hp.n_dense_lead, 1);
  EXPECT_EQ(m.hp.n_nextn, 1);
  EXPECT_FALSE(m.hp.attn_qk_norm);
  // Layer 0: a dense SwiGLU FFN of feed_forward_length, no router.
  const model::LayerWeights& L0 = m.layers[0];
  EXPECT_EQ(L0.recipe.ffn.kind, model::FfnKind::Dense);
  EXPECT_EQ(L0.dense.gate.n_rows, 48);
  EXPECT_EQ(L0.dense.down.n_rows, 64);
  EXPECT_FALSE(L0.moe.router);
  // Layers 1..3: the sigmoid router with its score bias, scaled, an ungated shared expert.
  const model::LayerWeights& L1 = m.layers[1];
  EXPECT_EQ(L1.recipe.ffn.kind, model::FfnKind::Moe);
  EXPECT_EQ(L1.recipe.ffn.router.kind, model::RouterKind::SigmoidGroupTopK);
  EXPECT_TRUE(L1.recipe.ffn.router.renormalize);
  EXPECT_DOUBLE_EQ(L1.recipe.ffn.router.routed_scale, 2.5);
  EXPECT_EQ(L1.moe.score_bias.size(), 4u);
  EXPECT_TRUE(L1.moe.shared_up);
  EXPECT_TRUE(L1.moe.shared_router.empty());
  EXPECT_TRUE(L1.recipe.mixer.attn.qkv_bias && !L1.recipe.mixer.attn.qk_norm);
  EXPECT_EQ(L1.attn.q_bias.size(), 64u);
  const std::vector<model::Feature> f = model::layer_features(L1.recipe, m.hp.head_dim);
  for (model::Feature want : {model::Feature::PartialRope, model::Feature::RouterSigmoidGroupTopK,
                              model::Feature::RoutedScaling, model::Feature::SharedExpertUngated})
    EXPECT_NE(std::find(f.begin(), f.end(), want), f.end()) << model::feature_name(want);
  // The nextn block: a MoE layer's tensors and the nextn projections, bound (not run).
  ASSERT_EQ(m.nextn.size(), 1u);
  EXPECT_EQ(m.nextn[0].eh_proj.n_cols, 128);
  EXPECT_EQ(m.nextn[0].enorm.size(), 64u);
  EXPECT_TRUE(m.nextn[0].block.moe.router);
  EXPECT_EQ(m.nextn[0].block.moe.score_bias.size(), 4u);
  EXPECT_TRUE(m.nextn[0].shared_head_head);
  EXPECT_NO_THROW(model::check_supported(m, model::reference_support()));
  // Both backends run them: the CUDA backend's sigmoid group router, routed scale, ungated
  // shared expert and dense layers (tests/cuda/cuda_glm4moe_test.cpp against the reference).
  EXPECT_NO_THROW(model::check_supported(m, gpu_worker::cpu_backend_support()));
  EXPECT_NO_THROW(model::check_supported(m, gpu_worker::cuda_backend_support()));
  std::filesystem::remove(path);
}

TEST(ArchDesc, Glm4MoeQkNormComesFromTheTensorsAndBadRoutingKeysAreNamed) {
  {
    const std::string path = tiny_file_with_key("glm4moe:qknorm_groups", "glm4moe_qk");
    const model::Model m = model::Model::load(path);
    EXPECT_TRUE(m.hp.attn_qk_norm);
    EXPECT_TRUE(m.layers[2].recipe.mixer.attn.qk_norm);
    EXPECT_EQ(m.layers[2].attn.q_norm.size(), 16u);
    EXPECT_EQ(m.layers[2].recipe.ffn.router.n_group, 4);
    EXPECT_EQ(m.layers[2].recipe.ffn.router.topk_group, 1);
    EXPECT_FALSE(m.layers[2].recipe.ffn.router.renormalize);
    std::filesystem::remove(path);
  }
  EXPECT_NE(load_error(tiny_file_with_key("glm4moe", "glm4moe_gating", "glm4moe.expert_gating_func", Value::u32(1)))
                .find("glm4moe.expert_gating_func: 1 is not sigmoid"), std::string::npos);
  EXPECT_NE(load_error(tiny_file_with_key("glm4moe:qknorm_groups", "glm4moe_groups", "glm4moe.expert_group_count", Value::u32(5)))
                .find("glm4moe.expert_group_count: does not divide expert_count 12"), std::string::npos);
  EXPECT_NE(load_error(tiny_file_with_key("glm4moe", "glm4moe_dense", "glm4moe.leading_dense_block_count", Value::u32(5)))
                .find("leading_dense_block_count: exceeds"), std::string::npos);
  EXPECT_EQ(load_error(tiny_file_with_key("glm4moe", "glm4moe_ok")), "");
}

TEST(ArchDesc, Qwen35MoeBindsItsDeltaNetLayoutAndRefusesSectionsItCannotTurn) {
  const std::string path = tiny_file_with_key("qwen35moe", "qwen35moe");
  const model::Model m = model::Model::load(path);
  ASSERT_EQ(m.layers.size(), 4u);
  ASSERT_EQ(m.nextn.size(), 1u);
  const model::LayerWeights& L0 = m.layers[0];
  EXPECT_TRUE(L0.recurrent);
  EXPECT_TRUE(L0.recipe.mixer.delta.v_heads_tiled && L0.recipe.mixer.delta.split_ba);
  EXPECT_EQ(L0.delta.beta.n_rows, 4);
  EXPECT_EQ(L0.delta.alpha.n_rows, 4);
  EXPECT_FALSE(L0.delta.ba);
  EXPECT_FALSE(m.layers[3].recurrent);
  EXPECT_TRUE(m.layers[3].attn.q_has_gate);
  EXPECT_FALSE(m.nextn[0].block.recurrent);
  EXPECT_NO_THROW(model::check_supported(m, model::reference_support()));
  EXPECT_NO_THROW(model::check_supported(m, gpu_worker::cpu_backend_support()));
  // The CUDA kernels take the tiled heads and split beta / alpha (tests/cuda/cuda_qwen35moe_test.cpp).
  EXPECT_NO_THROW(model::check_supported(m, gpu_worker::cuda_backend_support()));
  std::filesystem::remove(path);
  // Pair 1 of 4 falls to the fourth (image) position part under sections [1, 0, 0, 3].
  std::vector<Value> sec = {Value::i32(1), Value::i32(0), Value::i32(0), Value::i32(3)};
  EXPECT_NE(load_error(tiny_file_with_key("qwen35moe", "qwen35moe_sec", "qwen35moe.rope.dimension_sections",
                                  Value::array(gguf::ValueType::INT32, std::move(sec))))
                .find("rotary pair 1 falls to the fourth position part"), std::string::npos);
}

TEST(ArchDesc, FeaturesOfTheQwenRecipesAreTheReferencesOwn) {
  model::HParams hp;
  hp.desc = model::find_arch("qwen3next");
  hp.n_layer = 4;
  hp.head_dim = 64;
  hp.n_rot = 16;
  hp.n_ff_exp = hp.n_ff_shexp = 32;
  hp.recurrent = {true, true, true, false};
  for (int64_t il = 0; il < 4; ++il) {
    const model::LayerRecipe r = hp.desc->layer_recipe(hp, il);
    for (model::Feature f : model::layer_features(r, hp.head_dim)) {
      EXPECT_TRUE(model::reference_support().has(f)) << model::feature_name(f);
    }
  }
  const model::LayerRecipe full = hp.desc->layer_recipe(hp, 3);
  const std::vector<model::Feature> f = model::layer_features(full, hp.head_dim);
  EXPECT_NE(std::find(f.begin(), f.end(), model::Feature::PartialRope), f.end());
  EXPECT_NE(std::find(f.begin(), f.end(), model::Feature::AttnOutputGate), f.end());
  EXPECT_NE(std::find(f.begin(), f.end(), model::Feature::SharedExpertGated), f.end());
}

}  // namespace
}  // namespace moraine
