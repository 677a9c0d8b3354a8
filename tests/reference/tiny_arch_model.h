// Tiny seeded GGUFs of a registered architecture, every key and tensor from its description
// (common keys + ArchDesc::write_keys, common/model/layer_tensors.h's list), random F32 values.
// For the loader and refusal tests and for the reference against llama.cpp
// (arch_llama_test.cpp): a row in tiny_hparams is all a new architecture needs there.
#pragma once
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/gguf/gguf.h"
#include "common/model/layer_tensors.h"

namespace moraine::test {

// deepseek2's MLA: latent 32, rotary key 8, per head 16 nope + 8 rope dims of q.k and 16 value
// dims; one leading dense layer (width 48); DeepSeek's YaRN (factor 40 over 4096). "lite"
// (V2-Lite-like): q directly, softmax router without renormalising, 2 shared experts,
// mscale_all_dim 0.707, attn_k_b / attn_v_b; "kv_b": the same with the older fused attn_kv_b;
// "v3" (V3-like): q LoRA (rank 24), sigmoid router with the choice bias, 8 experts in 4 groups
// of which 2 are used, top-3, renormalised, scale 2.5, one shared expert, mscale_all_dim 1;
// "v3_nobias": V3-like without exp_probs_b.
inline void tiny_deepseek2(model::HParams& hp, const std::string& variant) {
  hp.kv_lora_rank = 32;
  hp.n_rot = 8;
  hp.mla_head_k = 16 + hp.n_rot;
  hp.mla_head_v = 16;
  hp.n_ff = 48;
  hp.n_dense_lead = 1;
  hp.rope_scaling = model::RopeScaling::Yarn;
  hp.rope_scaling_factor = 40.0;
  hp.rope_orig_ctx = 4096;
  if (variant == "lite" || variant == "kv_b") {
    hp.rope_yarn_log_mul = 0.707;
    hp.n_ff_shexp = 2 * hp.n_ff_exp;
    hp.norm_topk_prob = false;
    hp.mla_split_kv_b = variant == "lite";
  } else if (variant == "v3" || variant == "v3_nobias") {
    hp.q_lora_rank = 24;
    hp.rope_yarn_log_mul = 1.0;
    hp.sigmoid_gating = true;
    hp.expert_score_bias = variant == "v3";   // exp_probs_b is optional to llama.cpp
    hp.norm_topk_prob = true;
    hp.expert_weights_scale = 2.5;
    hp.n_expert = 8;
    hp.n_expert_used = 3;
    hp.n_expert_groups = 4;
    hp.n_group_used = 2;
    hp.n_ff_shexp = hp.n_ff_exp;
    hp.mla_split_kv_b = true;
  } else {
    throw std::invalid_argument("tiny_hparams: no deepseek2 variant '" + variant + "' (lite, kv_b, v3, v3_nobias)");
  }
  // The split layout caches [latent | rotary key] as one kv head; the fused one is plain MHA.
  hp.n_head_kv = hp.mla_split_kv_b ? 1 : hp.n_head;
  hp.head_dim = hp.mla_split_kv_b ? hp.kv_lora_rank + hp.n_rot : hp.mla_head_k;
  hp.head_dim_v = hp.mla_split_kv_b ? hp.kv_lora_rank : hp.mla_head_v;
}

// The DeltaNet hybrids' shape: layers 0-2 DeltaNet (2 key heads, 4 value heads of 16), 3 attention.
inline void tiny_delta_net(model::HParams& hp) {
  hp.ssm_conv_kernel = 4;
  hp.ssm_head_k_dim = hp.ssm_head_v_dim = 16;
  hp.ssm_n_k_heads = 2;
  hp.ssm_n_v_heads = 4;
  hp.full_attention_interval = 4;
  hp.recurrent = {true, true, true, false};
  hp.n_ff_shexp = 48;
  hp.n_rot = 8;   // partial rotary
}

// 4 layers of n_embd 64, 4 heads of 16 (2 kv heads), 4 experts top-2 of width 32, vocab 320.
// gpt-oss: sliding (window 4) and full layers alternating, YaRN factor 32 over 4096.
// glm4moe: 1 leading dense layer (width 48), half-rotary heads, routed scale 2.5, a shared
// expert, one nextn block; "glm4moe:qknorm_groups" adds q/k norm and 12 experts in 4 groups of
// which 1 is used, without renormalising. qwen3next, qwen35moe: tiny_delta_net, one nextn block.
// deepseek2: tiny_deepseek2 ("deepseek2:lite", ":kv_b", ":v3").
// `name` is an architecture, or one and a variant after ':'.
inline model::HParams tiny_hparams(const std::string& name) {
  const std::string arch = name.substr(0, name.find(':'));
  const std::string variant = name.find(':') == std::string::npos ? "" : name.substr(name.find(':') + 1);
  model::HParams hp;
  hp.desc = model::find_arch(arch);
  if (hp.desc == nullptr) throw std::invalid_argument("tiny_hparams: unknown architecture " + arch);
  hp.n_layer = 4;
  hp.n_embd = 64;
  hp.n_vocab = 320;
  hp.n_head = 4;
  hp.n_head_kv = 2;
  hp.head_dim = hp.n_rot = 16;
  hp.n_expert = 4;
  hp.n_expert_used = 2;
  hp.n_ff_exp = 32;
  hp.n_ff = 32;
  hp.rope_freq_base = 10000.0;
  hp.rms_eps = 1e-5;
  hp.recurrent.assign(4, false);
  if (arch == "gpt-oss") {
    hp.rope_freq_base = 150000.0;
    hp.sliding_window = 4;
    hp.swa_layers = {true, false, true, false};
    hp.rope_scaling = model::RopeScaling::Yarn;
    hp.rope_scaling_factor = 32.0;
    hp.rope_orig_ctx = 4096;
  } else if (arch == "qwen2moe") {
    hp.n_ff_shexp = 48;
    hp.norm_topk_prob = false;
  } else if (arch == "deepseek2") {
    tiny_deepseek2(hp, variant);
  } else if (arch == "glm4moe") {
    hp.n_rot = 8;
    hp.n_ff = 48;
    hp.n_dense_lead = 1;
    hp.n_ff_shexp = hp.n_ff_exp;
    hp.norm_topk_prob = true;
    hp.expert_weights_scale = 2.5;
    hp.n_nextn = 1;
    if (variant == "qknorm_groups") {
      hp.attn_qk_norm = true;
      hp.n_expert = 12;
      hp.n_expert_groups = 4;
      hp.n_group_used = 1;
      hp.norm_topk_prob = false;
    } else if (!variant.empty()) {
      throw std::invalid_argument("tiny_hparams: no glm4moe variant " + variant);
    }
  } else if (arch == "qwen3next" || arch == "qwen35moe") {
    tiny_delta_net(hp);
    hp.n_nextn = 1;
  } else if (arch != "qwen3moe") {
    throw std::invalid_argument("tiny_hparams: no tiny shape for " + arch + " yet");
  }
  if (arch != "glm4moe" && arch != "deepseek2" && !variant.empty()) throw std::invalid_argument("tiny_hparams: no variant " + name);
  for (int64_t il = 0; il < hp.n_layer + hp.n_nextn; ++il) hp.recipes.push_back(hp.desc->layer_recipe(hp, il));
  return hp;
}

// Metadata plus tensors; `data` keeps the values alive until the writer has written.
inline gguf::GgufWriter tiny_writer(const model::HParams& hp, uint32_t seed, std::vector<std::vector<float>>& data) {
  using gguf::Value;
  gguf::GgufWriter w;
  const std::string a = std::string(hp.desc->name) + ".";
  const auto u32 = [](int64_t x) { return Value::u32(static_cast<uint32_t>(x)); };
  w.set("general.architecture", Value::string(hp.desc->name));
  w.set(a + "block_count", u32(hp.n_layer + hp.n_nextn));
  if (hp.n_nextn > 0) w.set(a + "nextn_predict_layers", u32(hp.n_nextn));
  w.set(a + "context_length", u32(hp.rope_orig_ctx > 0 ? 32 * hp.rope_orig_ctx : 4096));
  w.set(a + "embedding_length", u32(hp.n_embd));
  w.set(a + "feed_forward_length", u32(hp.n_ff));
  w.set(a + "attention.head_count", u32(hp.n_head));
  w.set(a + "attention.head_count_kv", u32(hp.n_head_kv));
  w.set(a + "attention.key_length", u32(hp.head_dim));
  w.set(a + "attention.value_length", u32(hp.head_dim));
  w.set(a + "rope.freq_base", Value::f32(static_cast<float>(hp.rope_freq_base)));
  w.set(a + "attention.layer_norm_rms_epsilon", Value::f32(static_cast<float>(hp.rms_eps)));
  w.set(a + "expert_count", u32(hp.n_expert));
  w.set(a + "expert_used_count", u32(hp.n_expert_used));
  w.set(a + "expert_feed_forward_length", u32(hp.n_ff_exp));
  model::KeyList own;
  hp.desc->write_keys(hp, a, own);
  for (auto& [k, v] : own) w.set(k, std::move(v));
  w.set(a + "rope.dimension_count", u32(hp.n_rot));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const model::TensorSlot& s : model::model_tensors(hp)) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    using R = model::TensorRole;
    const bool norm = s.role == R::AttnNorm || s.role == R::FfnNorm || s.role == R::OutputNorm ||
                      s.role == R::MlaQANorm || s.role == R::MlaKvANorm;
    const bool vec = s.shape.size() == 1 || s.role == R::GateExpsBias || s.role == R::UpExpsBias ||
                     s.role == R::DownExpsBias;
    // Rows read shape[0] inputs: 1/sqrt(fan-in) keeps activations O(1); the routers and the LM
    // head get more, for decisive routing and logits of a few units.
    const float fan_in = static_cast<float>(s.shape[0]);
    const float scale = s.role == R::TokEmbd || s.role == R::AttnSinks                    ? 1.0f
                        : s.role == R::ScoreBias                                        ? 0.5f
                        : s.role == R::Router || s.role == R::Output || s.role == R::SharedRouter ? 3.0f / std::sqrt(fan_in)
                        : norm                                                          ? 0.1f
                        : vec                                                           ? 0.2f
                                                                                        : 1.0f / std::sqrt(fan_in);
    for (float& x : v) x = (norm ? 1.0f : 0.0f) + scale * normal(rng);
    data.push_back(std::move(v));
    w.add_tensor(s.name, s.shape, TensorType::F32, data.back().data(), static_cast<uint64_t>(n) * 4);
  }
  return w;
}

}  // namespace moraine::test
