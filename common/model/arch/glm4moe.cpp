// glm4moe (GLM-4.5, GLM-4.5-Air; HF Glm4MoeForCausalLM), as llama.cpp's "glm4moe" loads it:
//   h = x + o( attention( rope(nq(q(n1(x)) + bq)), rope(nk(k(.) + bk)), v(.) + bv ) )
//   dense layers (the first leading_dense_block_count): y = h + down(silu(gate(n2(h))) * up(n2(h)))
//   MoE layers: y = h + scale * sum_{e in choice} w_e * swiglu_e(n2(h)) + shared(n2(h))
// GQA with q/k/v biases, NEOX RoPE over the first n_rot dims (partial_rotary_factor 0.5), a
// per-head q/k RMSNorm only where the file has its tensors (GLM-4.5 355B, not Air). Router:
//   s = sigmoid(router(n2(h))); the choice ranks s + exp_probs_b (the score-correction bias),
//   group-limited when expert_group_count > 1 (deepseek v3's; GLM-4.5 has one group);
//   w_e = s_e of the chosen, renormalised when expert_weights_norm, times expert_weights_scale.
// The shared expert has no gate. block_count counts nextn_predict_layers multi-token-prediction
// blocks after the trunk (a MoE layer's tensors plus nextn.*): bound, not run (llama.cpp's main
// graph does not run them either).
#include "common/gguf/gguf.h"
#include "common/model/arch/arch.h"
#include "common/model/hparams.h"

namespace moraine::model {

namespace {

constexpr int64_t kGatingSigmoid = 2;   // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID

void read_routing(const KeyReader& r, HParams& hp) {
  const int64_t gating = r.count("expert_gating_func", kGatingSigmoid);
  if (gating != kGatingSigmoid)
    r.fail(r.key("expert_gating_func"), std::to_string(gating) + " is not sigmoid (2), the gating glm4moe uses");
  hp.expert_weights_scale = r.real("expert_weights_scale", 1.0, false);
  hp.norm_topk_prob = r.flag("expert_weights_norm", false);
  hp.n_expert_groups = r.count("expert_group_count", 1, true);
  if (hp.n_expert_groups == 0) hp.n_expert_groups = 1;
  hp.n_group_used = r.count("expert_group_used_count", hp.n_expert_groups == 1 ? 1 : -1, true);
  if (hp.n_expert_groups > 1) {
    const int64_t per = hp.n_expert / hp.n_expert_groups;
    if (per * hp.n_expert_groups != hp.n_expert)
      r.fail(r.key("expert_group_count"), "does not divide expert_count " + std::to_string(hp.n_expert));
    if (hp.n_group_used < 1 || hp.n_group_used > hp.n_expert_groups || hp.n_group_used * per < hp.n_expert_used)
      r.fail(r.key("expert_group_used_count"), std::to_string(hp.n_group_used) + " groups of " + std::to_string(per) +
                                                   " cannot hold expert_used_count " + std::to_string(hp.n_expert_used));
  }
}

void read_keys(const KeyReader& r, HParams& hp) {
  const int64_t n_shared = r.count("expert_shared_count", -1, true);
  hp.n_ff_shexp = n_shared * hp.n_ff_exp;
  hp.n_dense_lead = r.count("leading_dense_block_count", 0, true);
  if (hp.n_dense_lead > hp.n_layer) r.fail(r.key("leading_dense_block_count"), "exceeds the trunk's layers");
  if (hp.n_dense_lead > 0 && hp.n_ff == 0) r.fail(r.key("feed_forward_length"), "required with dense layers");
  read_routing(r, hp);
  // M-RoPE sections (GLM-4.5V) would rotate parts of each head by other position ids.
  if (const gguf::Array* a = r.array("rope.dimension_sections"); a != nullptr) {
    for (const gguf::Value& v : a->items)
      if (v.as_i64().value_or(0) != 0) r.fail(r.key("rope.dimension_sections"), "M-RoPE (the vision model's) is not implemented");
  }
  // Optional in llama.cpp too: only the tensors say whether this model has q/k norms.
  hp.attn_qk_norm = r.has_tensor("blk.0.attn_q_norm.weight");
  hp.recurrent.assign(static_cast<size_t>(hp.n_layer), false);
}

LayerRecipe layer_recipe(const HParams& hp, int64_t il) {
  LayerRecipe L;
  L.mixer.kind = MixerKind::Attention;
  L.mixer.attn.qkv_bias = true;
  L.mixer.attn.qk_norm = hp.attn_qk_norm;
  L.mixer.attn.rope.n_rot = hp.n_rot;
  L.mixer.attn.rope.freq_base = hp.rope_freq_base;
  if (il < hp.n_dense_lead) {
    L.ffn.kind = FfnKind::Dense;
    L.ffn.dense_ff = hp.n_ff;
    return L;
  }
  L.ffn.kind = FfnKind::Moe;
  RouterPart& rt = L.ffn.router;
  rt.kind = RouterKind::SigmoidGroupTopK;
  rt.renormalize = hp.norm_topk_prob;
  rt.score_bias = true;
  rt.n_group = hp.n_expert_groups;
  rt.topk_group = hp.n_group_used;
  rt.routed_scale = hp.expert_weights_scale;
  L.ffn.experts.act = Activation::SwiGlu;
  L.ffn.experts.n_ff = hp.n_ff_exp;
  L.ffn.shared = {hp.n_ff_shexp > 0, false, hp.n_ff_shexp};
  return L;
}

void write_keys(const HParams& hp, const std::string& a, KeyList& m) {
  const auto u32 = [](int64_t x) { return gguf::Value::u32(static_cast<uint32_t>(x)); };
  m.emplace_back(a + "expert_shared_count", u32(hp.n_ff_exp > 0 ? hp.n_ff_shexp / hp.n_ff_exp : 0));
  m.emplace_back(a + "leading_dense_block_count", u32(hp.n_dense_lead));
  m.emplace_back(a + "expert_weights_scale", gguf::Value::f32(static_cast<float>(hp.expert_weights_scale)));
  m.emplace_back(a + "expert_weights_norm", gguf::Value::boolean(hp.norm_topk_prob));
  m.emplace_back(a + "expert_gating_func", u32(kGatingSigmoid));
  if (hp.n_expert_groups > 1) {
    m.emplace_back(a + "expert_group_count", u32(hp.n_expert_groups));
    m.emplace_back(a + "expert_group_used_count", u32(hp.n_group_used));
  }
}

}  // namespace

const ArchDesc& arch_glm4moe() {
  static const ArchDesc d{
      "glm4moe",
      {"Glm4MoeForCausalLM"},
      {
          {"expert_shared_count", nullptr, "shared experts (their width: count * expert_feed_forward_length)"},
          {"leading_dense_block_count", "0", "the first layers run a dense FFN (HF first_k_dense_replace)"},
          {"expert_weights_scale", "1", "routed output's factor (HF routed_scaling_factor)"},
          {"expert_weights_norm", "false", "renormalise the chosen weights (HF norm_topk_prob)"},
          {"expert_gating_func", "2", "router scores: 2 = sigmoid, the only one glm4moe uses"},
          {"expert_group_count", "1", "expert groups of group-limited routing (HF n_group)"},
          {"expert_group_used_count", "1", "groups a token's experts come from (HF topk_group)"},
          {"rope.dimension_sections", "(none)", "M-RoPE sections (vision models): refused when non-zero"},
      },
      {
          {TensorRole::TokEmbd, "token_embd.weight", "model.embed_tokens.weight"},
          {TensorRole::OutputNorm, "output_norm.weight", "model.norm.weight"},
          {TensorRole::Output, "output.weight", "lm_head.weight"},
          {TensorRole::AttnNorm, "attn_norm.weight", "input_layernorm.weight"},
          {TensorRole::AttnQ, "attn_q.weight", "self_attn.q_proj.weight"},
          {TensorRole::AttnK, "attn_k.weight", "self_attn.k_proj.weight"},
          {TensorRole::AttnV, "attn_v.weight", "self_attn.v_proj.weight"},
          {TensorRole::AttnO, "attn_output.weight", "self_attn.o_proj.weight"},
          {TensorRole::AttnQBias, "attn_q.bias", "self_attn.q_proj.bias"},
          {TensorRole::AttnKBias, "attn_k.bias", "self_attn.k_proj.bias"},
          {TensorRole::AttnVBias, "attn_v.bias", "self_attn.v_proj.bias"},
          {TensorRole::AttnQNorm, "attn_q_norm.weight", "self_attn.q_norm.weight"},
          {TensorRole::AttnKNorm, "attn_k_norm.weight", "self_attn.k_norm.weight"},
          {TensorRole::FfnNorm, "post_attention_norm.weight", "post_attention_layernorm.weight"},
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
          // The MTP block is model.layers.{n_layer} in HF, its extra tensors beside the layer's own.
          {TensorRole::NextnEhProj, "nextn.eh_proj.weight", "eh_proj.weight"},
          {TensorRole::NextnEnorm, "nextn.enorm.weight", "enorm.weight"},
          {TensorRole::NextnHnorm, "nextn.hnorm.weight", "hnorm.weight"},
          {TensorRole::NextnEmbedTokens, "nextn.embed_tokens.weight", "embed_tokens.weight"},
          {TensorRole::NextnSharedHeadHead, "nextn.shared_head_head.weight", "shared_head.head.weight"},
          {TensorRole::NextnSharedHeadNorm, "nextn.shared_head_norm.weight", "shared_head.norm.weight"},
      },
      read_keys,
      layer_recipe,
      write_keys,
  };
  return d;
}

}  // namespace moraine::model
