// deepseek2 (DeepSeek-V2-Lite, V2, V2.5, V3, R1; HF DeepseekV2ForCausalLM / DeepseekV3ForCausalLM),
// as llama.cpp's "deepseek2" loads it. Every layer:
//   h = x + mla(n1(x))                       (multi-head latent attention, parts.h's MlaPart)
//   y = h + ffn(n2(h)): the first leading_dense_block_count layers a dense SwiGLU FFN, the rest
//       sum_{e in topk} w_e * swiglu_e(.) + shared(.)   (ungated shared experts, one SwiGLU of
//       expert_shared_count * expert width)
// The router follows expert_gating_func: softmax (V2, V2-Lite; the default when the key is
// absent, as llama.cpp takes it for older files) or sigmoid with the exp_probs_b choice bias
// and group-limited top-k (V3, R1; group-limited softmax, V2 236B, is refused); top-k weights renormalised when expert_weights_norm, then
// times expert_weights_scale. q with LoRA (attention.q_lora_rank > 0: V2, V3) or direct
// (V2-Lite). A file with attention.key_length_mla holds attn_k_b / attn_v_b (what llama.cpp's
// converter writes today; key_length / value_length then describe the cached latent); older
// files hold the fused attn_kv_b and key_length / value_length are the decompressed head dims.
// RoPE: NORM pairing over rope.dimension_count dims; DeepSeek's YaRN scales the attention by
// mscale^2, mscale = 1 + 0.1 * mscale_all_dim * ln(factor), where the yarn_log_multiplier key
// holds 0.1 * mscale_all_dim (llama.cpp's reading, which leaves cos and sin unscaled).
#include <cmath>

#include "common/gguf/gguf.h"
#include "common/model/arch/arch.h"
#include "common/model/hparams.h"

namespace moraine::model {

namespace {

void read_rope(const KeyReader& r, HParams& hp) {
  const std::string scaling = r.text("rope.scaling.type", "none");
  if (scaling == "yarn") {
    hp.rope_scaling = RopeScaling::Yarn;
    hp.rope_scaling_factor = r.real("rope.scaling.factor", 1.0, true);
    hp.rope_orig_ctx = r.count("rope.scaling.original_context_length");
  } else if (scaling == "none" || (scaling == "linear" && r.real("rope.scaling.factor", 1.0, false) == 1.0)) {
    hp.rope_scaling = RopeScaling::None;
  } else {
    r.fail(r.key("rope.scaling.type"), "'" + scaling + "' is not a RoPE scaling deepseek2 uses (yarn or none)");
  }
  // The key holds 0.1 * mscale_all_dim (the converter's legacy scaling); llama.cpp undoes it.
  hp.rope_yarn_log_mul = r.real("rope.scaling.yarn_log_multiplier", 0.0, false) / 0.1;
  hp.rope_attn_factor = r.real("rope.scaling.attn_factor", 1.0, false);
}

void read_keys(const KeyReader& r, HParams& hp) {
  hp.n_dense_lead = r.count("leading_dense_block_count", 0, /*allow_zero=*/true);
  if (hp.n_dense_lead > hp.n_layer) r.fail(r.key("leading_dense_block_count"), "exceeds the layer count");
  if (hp.n_dense_lead > 0 && hp.n_ff == 0) r.fail(r.key("feed_forward_length"), "required with dense layers");
  hp.q_lora_rank = r.count("attention.q_lora_rank", 0, /*allow_zero=*/true);
  hp.kv_lora_rank = r.count("attention.kv_lora_rank");
  hp.mla_split_kv_b = r.has("attention.key_length_mla");
  if (hp.mla_split_kv_b != r.has("attention.value_length_mla"))
    r.fail(r.key("attention.value_length_mla"), "key_length_mla and value_length_mla come together");
  if (hp.mla_split_kv_b) {
    // key_length / value_length then describe the cache: [latent | rotary key] and the latent.
    hp.mla_head_k = r.count("attention.key_length_mla");
    hp.mla_head_v = r.count("attention.value_length_mla");
    if (hp.head_dim != hp.kv_lora_rank + hp.n_rot)
      r.fail(r.key("attention.key_length"), "must be kv_lora_rank + rope.dimension_count with key_length_mla");
    if (hp.head_dim_v != hp.kv_lora_rank)
      r.fail(r.key("attention.value_length"), "must be kv_lora_rank with value_length_mla");
  } else {
    hp.mla_head_k = hp.head_dim;
    hp.mla_head_v = hp.head_dim_v;
  }
  if (hp.mla_head_k <= hp.n_rot) r.fail(r.key("rope.dimension_count"), "leaves no key dims without RoPE");
  hp.n_ff_shexp = hp.n_ff_exp * r.count("expert_shared_count", -1, /*allow_zero=*/true);
  hp.expert_weights_scale = r.real("expert_weights_scale", 1.0, false);
  hp.norm_topk_prob = r.flag("expert_weights_norm", false);
  hp.sigmoid_gating = false;
  switch (r.count("expert_gating_func", 1)) {
    case 1: break;   // softmax
    case 2: hp.sigmoid_gating = true; break;
    default: r.fail(r.key("expert_gating_func"), "only softmax (1) and sigmoid (2) are deepseek2's");
  }
  // exp_probs_b is optional to llama.cpp (V3 files have it): the first MoE layer's tells.
  hp.expert_score_bias = hp.n_dense_lead < hp.n_layer &&
                         r.has_tensor("blk." + std::to_string(hp.n_dense_lead) + ".exp_probs_b.bias");
  if (hp.expert_score_bias && !hp.sigmoid_gating)
    r.fail(r.key("expert_gating_func"), "softmax routing with a choice bias (exp_probs_b) is not implemented");
  hp.n_expert_groups = r.count("expert_group_count", 1, /*allow_zero=*/true);
  hp.n_group_used = r.count("expert_group_used_count", 1, /*allow_zero=*/true);
  if (hp.n_expert_groups > 1) {
    if (!hp.sigmoid_gating)   // DeepSeek-V2 / V2.5 (236B): llama.cpp limits softmax choices to groups too
      r.fail(r.key("expert_group_count"), "group-limited softmax routing (DeepSeek-V2 236B) is not implemented");
    if (hp.n_expert % hp.n_expert_groups != 0) r.fail(r.key("expert_group_count"), "does not divide expert_count");
    if (hp.n_group_used < 1 || hp.n_group_used >= hp.n_expert_groups)
      r.fail(r.key("expert_group_used_count"), "must be at least 1 and below expert_group_count");
    if (hp.n_group_used * (hp.n_expert / hp.n_expert_groups) < hp.n_expert_used)
      r.fail(r.key("expert_group_used_count"), "leaves fewer experts than expert_used_count");
  }
  read_rope(r, hp);
  // Mistral-Large-3's per-position query temperature (llama.cpp's inp_attn_scale).
  if (r.has("attention.temperature_scale"))
    r.fail(r.key("attention.temperature_scale"), "attention temperature scaling is not implemented");
  hp.recurrent.assign(static_cast<size_t>(hp.n_layer), false);
}

// llama.cpp's attention scale and RoPE attn_factor for deepseek2 (llama_context's yarn_attn_factor,
// then the deepseek2 graph's mscale): under YaRN with a log multiplier cos and sin stay unscaled
// and the scores take mscale^2.
void mla_scales(const HParams& hp, RopePart& rope, MlaPart& m) {
  const bool yarn = hp.rope_scaling == RopeScaling::Yarn;
  const double s = yarn ? hp.rope_scaling_factor : 1.0;
  const auto get_mscale = [s](double mscale) { return s <= 1.0 ? 1.0 : 0.1 * mscale * std::log(s) + 1.0; };
  const double lm = hp.rope_yarn_log_mul;
  double attn_factor = 1.0;
  if (yarn) {
    attn_factor = lm != 0.0 ? get_mscale(lm != 1.0 ? lm : 1.0) / get_mscale(lm) : get_mscale(1.0);
    attn_factor /= 1.0 + 0.1 * std::log(s);
  }
  attn_factor *= hp.rope_attn_factor;
  rope.attn_factor = attn_factor;
  const double mscale = attn_factor * (1.0 + 0.1 * std::log(s)) * (1.0 + 0.1 * lm * std::log(s));
  m.kq_scale = mscale * mscale / std::sqrt(static_cast<double>(hp.mla_head_k));
}

LayerRecipe layer_recipe(const HParams& hp, int64_t il) {
  LayerRecipe L;
  L.mixer.kind = MixerKind::Mla;
  MlaPart& m = L.mixer.mla;
  m.q_lora_rank = hp.q_lora_rank;
  m.kv_lora_rank = hp.kv_lora_rank;
  m.rope_dim = hp.n_rot;
  m.nope_dim = hp.mla_head_k - hp.n_rot;
  m.v_dim = hp.mla_head_v;
  m.split_kv_b = hp.mla_split_kv_b;
  RopePart& rope = L.mixer.attn.rope;
  rope.n_rot = hp.n_rot;
  rope.freq_base = hp.rope_freq_base;
  rope.scaling = hp.rope_scaling;
  rope.yarn_factor = hp.rope_scaling_factor;
  rope.yarn_orig_ctx = hp.rope_orig_ctx;
  mla_scales(hp, rope, m);
  if (il < hp.n_dense_lead) {
    L.ffn.kind = FfnKind::Dense;
    L.ffn.dense_ff = hp.n_ff;
    return L;
  }
  L.ffn.kind = FfnKind::Moe;
  RouterPart& router = L.ffn.router;
  router.kind = hp.sigmoid_gating ? RouterKind::SigmoidGroupTopK : RouterKind::SoftmaxTopK;
  router.renormalize = hp.norm_topk_prob;
  router.score_bias = hp.expert_score_bias;
  router.routed_scale = hp.expert_weights_scale;
  router.n_group = hp.n_expert_groups;
  router.topk_group = hp.n_group_used;
  L.ffn.experts.act = Activation::SwiGlu;
  L.ffn.experts.n_ff = hp.n_ff_exp;
  if (hp.n_ff_shexp > 0) L.ffn.shared = {true, false, hp.n_ff_shexp};
  return L;
}

void write_keys(const HParams& hp, const std::string& a, KeyList& m) {
  const auto u32 = [](int64_t x) { return gguf::Value::u32(static_cast<uint32_t>(x)); };
  m.emplace_back(a + "attention.value_length", u32(hp.head_dim_v));
  m.emplace_back(a + "leading_dense_block_count", u32(hp.n_dense_lead));
  // llama.cpp requires q_lora_rank for every deepseek2 but the V2-Lite shapes; 0: q directly.
  m.emplace_back(a + "attention.q_lora_rank", u32(hp.q_lora_rank));
  m.emplace_back(a + "attention.kv_lora_rank", u32(hp.kv_lora_rank));
  if (hp.mla_split_kv_b) {
    m.emplace_back(a + "attention.key_length_mla", u32(hp.mla_head_k));
    m.emplace_back(a + "attention.value_length_mla", u32(hp.mla_head_v));
  }
  m.emplace_back(a + "expert_shared_count", u32(hp.n_ff_exp > 0 ? hp.n_ff_shexp / hp.n_ff_exp : 0));
  m.emplace_back(a + "expert_weights_scale", gguf::Value::f32(static_cast<float>(hp.expert_weights_scale)));
  m.emplace_back(a + "expert_weights_norm", gguf::Value::boolean(hp.norm_topk_prob));
  m.emplace_back(a + "expert_gating_func", u32(hp.sigmoid_gating ? 2 : 1));
  if (hp.n_expert_groups > 1) {
    m.emplace_back(a + "expert_group_count", u32(hp.n_expert_groups));
    m.emplace_back(a + "expert_group_used_count", u32(hp.n_group_used));
  }
  if (hp.rope_scaling == RopeScaling::Yarn) {
    m.emplace_back(a + "rope.scaling.type", gguf::Value::string("yarn"));
    m.emplace_back(a + "rope.scaling.factor", gguf::Value::f32(static_cast<float>(hp.rope_scaling_factor)));
    m.emplace_back(a + "rope.scaling.original_context_length", u32(hp.rope_orig_ctx));
    if (hp.rope_yarn_log_mul != 0.0)
      m.emplace_back(a + "rope.scaling.yarn_log_multiplier", gguf::Value::f32(static_cast<float>(0.1 * hp.rope_yarn_log_mul)));
  }
}

}  // namespace

const ArchDesc& arch_deepseek2() {
  static const ArchDesc d{
      "deepseek2",
      {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"},
      {
          {"leading_dense_block_count", "0", "leading layers with a dense FFN"},
          {"attention.q_lora_rank", "0", "q LoRA rank (0: q projected directly)"},
          {"attention.kv_lora_rank", nullptr, "the cached latent's width"},
          {"attention.key_length_mla", "(none)", "decompressed q.k head dims; present: attn_k_b / attn_v_b"},
          {"attention.value_length_mla", "(none)", "decompressed value head dims (with key_length_mla)"},
          {"expert_shared_count", nullptr, "shared experts (one SwiGLU of count * expert width)"},
          {"expert_weights_scale", "1", "routed output's factor"},
          {"expert_weights_norm", "false", "renormalise the top-k weights"},
          {"expert_gating_func", "1", "1 softmax, 2 sigmoid"},
          {"expert_group_count", "1", "expert groups of the group-limited top-k (sigmoid router)"},
          {"expert_group_used_count", "1", "the groups a token's experts come from"},
          {"rope.scaling.type", "none", "yarn or none"},
          {"rope.scaling.factor", "1", "YaRN factor (required with yarn)"},
          {"rope.scaling.original_context_length", nullptr, "YaRN's trained context (required with yarn)"},
          {"rope.scaling.yarn_log_multiplier", "0", "0.1 * mscale_all_dim"},
          {"rope.scaling.attn_factor", "1", "RoPE attention factor"},
          {"attention.temperature_scale", "(none)", "refused: query temperature scaling (Mistral-Large-3)"},
      },
      {
          {TensorRole::TokEmbd, "token_embd.weight", "model.embed_tokens.weight"},
          {TensorRole::OutputNorm, "output_norm.weight", "model.norm.weight"},
          {TensorRole::Output, "output.weight", "lm_head.weight"},
          {TensorRole::AttnNorm, "attn_norm.weight", "input_layernorm.weight"},
          {TensorRole::AttnQ, "attn_q.weight", "self_attn.q_proj.weight"},
          {TensorRole::MlaQA, "attn_q_a.weight", "self_attn.q_a_proj.weight"},
          {TensorRole::MlaQANorm, "attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight"},
          {TensorRole::MlaQB, "attn_q_b.weight", "self_attn.q_b_proj.weight"},
          {TensorRole::MlaKvAMqa, "attn_kv_a_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight"},
          {TensorRole::MlaKvANorm, "attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight"},
          {TensorRole::MlaKvB, "attn_kv_b.weight", "self_attn.kv_b_proj.weight"},
          // The converter splits kv_b_proj per head into these two, k_b transposed.
          {TensorRole::MlaKB, "attn_k_b.weight", ""},
          {TensorRole::MlaVB, "attn_v_b.weight", ""},
          {TensorRole::AttnO, "attn_output.weight", "self_attn.o_proj.weight"},
          {TensorRole::FfnNorm, "ffn_norm.weight", "post_attention_layernorm.weight"},
          {TensorRole::FfnGate, "ffn_gate.weight", "mlp.gate_proj.weight"},
          {TensorRole::FfnUp, "ffn_up.weight", "mlp.up_proj.weight"},
          {TensorRole::FfnDown, "ffn_down.weight", "mlp.down_proj.weight"},
          {TensorRole::Router, "ffn_gate_inp.weight", "mlp.gate.weight"},
          {TensorRole::ScoreBias, "exp_probs_b.bias", "mlp.gate.e_score_correction_bias"},
          {TensorRole::GateExps, "ffn_gate_exps.weight", "mlp.experts.{E}.gate_proj.weight"},
          {TensorRole::UpExps, "ffn_up_exps.weight", "mlp.experts.{E}.up_proj.weight"},
          {TensorRole::DownExps, "ffn_down_exps.weight", "mlp.experts.{E}.down_proj.weight"},
          {TensorRole::GateShexp, "ffn_gate_shexp.weight", "mlp.shared_experts.gate_proj.weight"},
          {TensorRole::UpShexp, "ffn_up_shexp.weight", "mlp.shared_experts.up_proj.weight"},
          {TensorRole::DownShexp, "ffn_down_shexp.weight", "mlp.shared_experts.down_proj.weight"},
          // Multi-token-prediction blocks (nextn_predict_layers; llama.cpp's converter skips DeepSeek's).
          {TensorRole::NextnEhProj, "nextn.eh_proj.weight", ""},
          {TensorRole::NextnEnorm, "nextn.enorm.weight", ""},
          {TensorRole::NextnHnorm, "nextn.hnorm.weight", ""},
          {TensorRole::NextnEmbedTokens, "nextn.embed_tokens.weight", ""},
          {TensorRole::NextnSharedHeadHead, "nextn.shared_head_head.weight", ""},
          {TensorRole::NextnSharedHeadNorm, "nextn.shared_head_norm.weight", ""},
      },
      read_keys,
      layer_recipe,
      write_keys,
  };
  return d;
}

}  // namespace moraine::model
