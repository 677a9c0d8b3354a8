// gpt-oss (gpt-oss-20b / 120b; HF GptOssForCausalLM), as llama.cpp's "gpt-oss" architecture
// loads it. Every layer:
//   h = x + o( attention(rope_yarn(q(n1(x)) + bq), rope_yarn(k(.) + bk), v(.) + bv; sinks) ) + bo
//   y = h + sum_{e in topk(router(n2(h)) + br)} softmax_k(.)_e * (down_e(act(gate_e(.) + bg, up_e(.) + bu)) + bd)
// Attention: GQA without q/k norm, NEOX RoPE over the whole head with YaRN scaling, a learned
// sink logit per head in every softmax; even layers slide over the last sliding_window
// positions, odd ones see everything (attention.sliding_window_pattern, llama.cpp's default 2).
// Router: the k largest logits, softmax over those k. Experts: clamped SwiGLU,
//   g = min(gate, limit); u = clamp(up, -limit, limit); act = g * sigmoid(alpha g) * (u + 1),
//   alpha 1.702, limit 7 (constants in llama.cpp and transformers alike).
#include "common/gguf/gguf.h"
#include "common/model/arch/arch.h"
#include "common/model/hparams.h"

namespace moraine::model {

namespace {

void read_keys(const KeyReader& r, HParams& hp) {
  hp.sliding_window = r.count("attention.sliding_window");
  const int64_t period = r.count("attention.sliding_window_pattern", 2);
  hp.swa_layers.assign(static_cast<size_t>(hp.n_layer), false);
  for (int64_t il = 0; il < hp.n_layer; ++il) hp.swa_layers[il] = il % period < period - 1;
  const std::string scaling = r.text("rope.scaling.type", "none");
  if (scaling == "yarn") {
    hp.rope_scaling = RopeScaling::Yarn;
    hp.rope_scaling_factor = r.real("rope.scaling.factor", 1.0, true);
    hp.rope_orig_ctx = r.count("rope.scaling.original_context_length");
    hp.rope_yarn_truncate = r.flag("rope.scaling.yarn_truncate", true);
  } else if (scaling != "none") {
    r.fail(r.key("rope.scaling.type"), "'" + scaling + "' is not a RoPE scaling gpt-oss uses (yarn or none)");
  }
  hp.expert_weights_scale = r.real("expert_weights_scale", 1.0, false);
  hp.recurrent.assign(static_cast<size_t>(hp.n_layer), false);
}

LayerRecipe layer_recipe(const HParams& hp, int64_t il) {
  LayerRecipe L;
  L.mixer.kind = MixerKind::Attention;
  AttentionPart& a = L.mixer.attn;
  a.qkv_bias = a.o_bias = a.sinks = true;
  a.sliding_window = il < static_cast<int64_t>(hp.swa_layers.size()) && hp.swa_layers[il] ? hp.sliding_window : 0;
  a.rope.n_rot = hp.n_rot;
  a.rope.freq_base = hp.rope_freq_base;
  a.rope.scaling = hp.rope_scaling;
  a.rope.yarn_factor = hp.rope_scaling_factor;
  a.rope.yarn_orig_ctx = hp.rope_orig_ctx;
  a.rope.yarn_truncate = hp.rope_yarn_truncate;
  L.ffn.kind = FfnKind::Moe;
  L.ffn.router.kind = RouterKind::TopKSoftmax;
  L.ffn.router.logit_bias = true;
  L.ffn.router.routed_scale = hp.expert_weights_scale;
  L.ffn.experts.act = Activation::SwiGluClamped;
  L.ffn.experts.biases = true;
  L.ffn.experts.n_ff = hp.n_ff_exp;
  return L;
}

void write_keys(const HParams& hp, const std::string& a, KeyList& m) {
  m.emplace_back(a + "attention.sliding_window", gguf::Value::u32(static_cast<uint32_t>(hp.sliding_window)));
  if (hp.rope_scaling == RopeScaling::Yarn) {
    m.emplace_back(a + "rope.scaling.type", gguf::Value::string("yarn"));
    m.emplace_back(a + "rope.scaling.factor", gguf::Value::f32(static_cast<float>(hp.rope_scaling_factor)));
    m.emplace_back(a + "rope.scaling.original_context_length", gguf::Value::u32(static_cast<uint32_t>(hp.rope_orig_ctx)));
    // Only when off: a file keeps llama.cpp's keys exactly otherwise.
    if (!hp.rope_yarn_truncate) m.emplace_back(a + "rope.scaling.yarn_truncate", gguf::Value::boolean(false));
  }
}

}  // namespace

const ArchDesc& arch_gpt_oss() {
  static const ArchDesc d{
      "gpt-oss",
      {"GptOssForCausalLM"},
      {
          {"attention.sliding_window", nullptr, "window of the sliding layers (128)"},
          {"attention.sliding_window_pattern", "2", "every n-th layer is full attention, the rest slide"},
          {"rope.scaling.type", "none", "yarn for gpt-oss"},
          {"rope.scaling.factor", nullptr, "YaRN factor (required with yarn)"},
          {"rope.scaling.original_context_length", nullptr, "YaRN's trained context (required with yarn)"},
          {"rope.scaling.yarn_truncate", "true", "moraine's: false keeps YaRN's correction dims fractional (HF truncate=false)"},
          {"expert_weights_scale", "1", "routed output's factor"},
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
          {TensorRole::AttnOBias, "attn_output.bias", "self_attn.o_proj.bias"},
          {TensorRole::AttnSinks, "attn_sinks.weight", "self_attn.sinks"},
          {TensorRole::FfnNorm, "post_attention_norm.weight", "post_attention_layernorm.weight"},
          {TensorRole::Router, "ffn_gate_inp.weight", "mlp.router.weight"},
          {TensorRole::RouterBias, "ffn_gate_inp.bias", "mlp.router.bias"},
          // HF fuses gate and up, interleaved per row (gate even, up odd), stored [E, n_embd, 2F].
          {TensorRole::GateExps, "ffn_gate_exps.weight", ""},
          {TensorRole::UpExps, "ffn_up_exps.weight", ""},
          {TensorRole::DownExps, "ffn_down_exps.weight", "mlp.experts.down_proj"},
          {TensorRole::GateExpsBias, "ffn_gate_exps.bias", ""},
          {TensorRole::UpExpsBias, "ffn_up_exps.bias", ""},
          {TensorRole::DownExpsBias, "ffn_down_exps.bias", "mlp.experts.down_proj_bias"},
      },
      read_keys,
      layer_recipe,
      write_keys,
  };
  return d;
}

}  // namespace moraine::model
