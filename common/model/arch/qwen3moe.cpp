// qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B; HF Qwen3MoeForCausalLM). Every layer:
//   h = x + o( attention( rope(rmsnorm_q(q(n1(x)))), rope(rmsnorm_k(k(n1(x)))), v(n1(x)) ) )
//   y = h + sum_{e in topk(softmax(router(n2(h))))} w_e * down_e( silu(gate_e(.)) * up_e(.) )
// GQA, per-head RMSNorm on q and k before NEOX RoPE over the whole head, softmax router,
// top-k weights renormalised to one (norm_topk_prob), SwiGLU experts.
#include "common/model/arch/arch.h"
#include "common/model/hparams.h"

namespace moraine::model {

namespace {

void read_keys(const KeyReader& r, HParams& hp) {
  // llama.cpp always renormalises for this family; a converter that knows the HF config's
  // norm_topk_prob writes expert_weights_norm so a model trained without it runs right too.
  hp.norm_topk_prob = r.flag("expert_weights_norm", true);
  hp.recurrent.assign(static_cast<size_t>(hp.n_layer), false);
}

LayerRecipe layer_recipe(const HParams& hp, int64_t) {
  LayerRecipe L;
  L.mixer.kind = MixerKind::Attention;
  L.mixer.attn.qk_norm = true;
  L.mixer.attn.rope.n_rot = hp.n_rot;
  L.mixer.attn.rope.freq_base = hp.rope_freq_base;
  L.ffn.kind = FfnKind::Moe;
  L.ffn.router.kind = RouterKind::SoftmaxTopK;
  L.ffn.router.renormalize = hp.norm_topk_prob;
  L.ffn.experts.act = Activation::SwiGlu;
  L.ffn.experts.n_ff = hp.n_ff_exp;
  return L;
}

void write_keys(const HParams&, const std::string&, KeyList&) {}

}  // namespace

const ArchDesc& arch_qwen3moe() {
  static const ArchDesc d{
      "qwen3moe",
      {"Qwen3MoeForCausalLM"},
      {{"expert_weights_norm", "true", "renormalise the top-k router weights (HF norm_topk_prob)"}},
      {
          {TensorRole::TokEmbd, "token_embd.weight", "model.embed_tokens.weight"},
          {TensorRole::OutputNorm, "output_norm.weight", "model.norm.weight"},
          {TensorRole::Output, "output.weight", "lm_head.weight"},
          {TensorRole::AttnNorm, "attn_norm.weight", "input_layernorm.weight"},
          {TensorRole::AttnQ, "attn_q.weight", "self_attn.q_proj.weight"},
          {TensorRole::AttnK, "attn_k.weight", "self_attn.k_proj.weight"},
          {TensorRole::AttnV, "attn_v.weight", "self_attn.v_proj.weight"},
          {TensorRole::AttnO, "attn_output.weight", "self_attn.o_proj.weight"},
          {TensorRole::AttnQNorm, "attn_q_norm.weight", "self_attn.q_norm.weight"},
          {TensorRole::AttnKNorm, "attn_k_norm.weight", "self_attn.k_norm.weight"},
          {TensorRole::FfnNorm, "ffn_norm.weight", "post_attention_layernorm.weight"},
          {TensorRole::Router, "ffn_gate_inp.weight", "mlp.gate.weight"},
          {TensorRole::GateExps, "ffn_gate_exps.weight", "mlp.experts.{E}.gate_proj.weight"},
          {TensorRole::UpExps, "ffn_up_exps.weight", "mlp.experts.{E}.up_proj.weight"},
          {TensorRole::DownExps, "ffn_down_exps.weight", "mlp.experts.{E}.down_proj.weight"},
      },
      read_keys,
      layer_recipe,
      write_keys,
  };
  return d;
}

}  // namespace moraine::model
