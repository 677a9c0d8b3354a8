// qwen2moe (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B; HF Qwen2MoeForCausalLM), as llama.cpp's
// "qwen2moe" loads it — an architecture made only of parts the others have:
//   h = x + o( attention( rope(q(n1(x)) + bq), rope(k(.) + bk), v(.) + bv ) )
//   y = h + sum_{e in topk(softmax(router(n2(h))))} p_e * swiglu_e(n2(h)) + sigmoid(g_s . n2(h)) * shared(n2(h))
// GQA with q/k/v biases and no q/k norm, NEOX RoPE over the whole head, softmax router whose
// top-k probabilities are used as they are (llama.cpp never renormalises for this family),
// SwiGLU experts, a gated shared expert.
#include "common/gguf/gguf.h"
#include "common/model/arch/arch.h"
#include "common/model/hparams.h"

namespace moraine::model {

namespace {

void read_keys(const KeyReader& r, HParams& hp) {
  hp.norm_topk_prob = false;
  hp.n_ff_shexp = r.count("expert_shared_feed_forward_length", hp.n_ff > 0 ? hp.n_ff : -1);
  hp.recurrent.assign(static_cast<size_t>(hp.n_layer), false);
}

LayerRecipe layer_recipe(const HParams& hp, int64_t) {
  LayerRecipe L;
  L.mixer.kind = MixerKind::Attention;
  L.mixer.attn.qkv_bias = true;
  L.mixer.attn.rope.n_rot = hp.n_rot;
  L.mixer.attn.rope.freq_base = hp.rope_freq_base;
  L.ffn.kind = FfnKind::Moe;
  L.ffn.router.kind = RouterKind::SoftmaxTopK;
  L.ffn.router.renormalize = false;
  L.ffn.experts.act = Activation::SwiGlu;
  L.ffn.experts.n_ff = hp.n_ff_exp;
  L.ffn.shared = {true, true, hp.n_ff_shexp};
  return L;
}

void write_keys(const HParams& hp, const std::string& a, KeyList& m) {
  m.emplace_back(a + "expert_shared_feed_forward_length", gguf::Value::u32(static_cast<uint32_t>(hp.n_ff_shexp)));
}

}  // namespace

const ArchDesc& arch_qwen2moe() {
  static const ArchDesc d{
      "qwen2moe",
      {"Qwen2MoeForCausalLM"},
      {{"expert_shared_feed_forward_length", "feed_forward_length", "shared expert width"}},
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
          {TensorRole::FfnNorm, "ffn_norm.weight", "post_attention_layernorm.weight"},
          {TensorRole::Router, "ffn_gate_inp.weight", "mlp.gate.weight"},
          {TensorRole::GateExps, "ffn_gate_exps.weight", "mlp.experts.{E}.gate_proj.weight"},
          {TensorRole::UpExps, "ffn_up_exps.weight", "mlp.experts.{E}.up_proj.weight"},
          {TensorRole::DownExps, "ffn_down_exps.weight", "mlp.experts.{E}.down_proj.weight"},
          {TensorRole::SharedRouter, "ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight"},
          {TensorRole::GateShexp, "ffn_gate_shexp.weight", "mlp.shared_expert.gate_proj.weight"},
          {TensorRole::UpShexp, "ffn_up_shexp.weight", "mlp.shared_expert.up_proj.weight"},
          {TensorRole::DownShexp, "ffn_down_shexp.weight", "mlp.shared_expert.down_proj.weight"},
      },
      read_keys,
      layer_recipe,
      write_keys,
  };
  return d;
}

}  // namespace moraine::model
