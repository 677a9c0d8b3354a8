// qwen3next (Qwen3-Next-80B-A3B; HF Qwen3NextForCausalLM). Layers alternate two token mixers: a
// Gated DeltaNet (linear attention with a recurrent state) in most layers, gated full attention
// in every full_attention_interval-th. Every layer:
//   h = x + mixer(n1(x));   y = h + moe(n2(h)) + sigmoid(dot(n2(h), g_s)) * shared_expert(n2(h))
// Gated attention: q projection yields [query | gate] per head; per-head RMSNorm on q and k;
//   NEOX RoPE over the first n_rot dims (partial rotary); out = o(attn * sigmoid(gate)).
// Gated DeltaNet: qkv = conv1d_causal(qkv_proj(x)) -> silu; q, k L2-normalised per head;
//   g = a * softplus(alpha + dt_bias) (a = -exp(A_log)); beta = sigmoid(b); per value head:
//   S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q / sqrt(d_k);
//   out = ssm_out(rmsnorm(o) * w * silu(z)).
// Norm weights are stored with HF's "1 + w" already folded in by the converter, except the
// gated norm (ssm_norm), whose HF weight is used as is. Multi-token-prediction blocks (nextn)
// follow the trunk: a full-attention block plus the nextn projections.
#include "common/gguf/gguf.h"
#include "common/model/arch/arch.h"
#include "common/model/hparams.h"

namespace moraine::model {

namespace {

void read_recurrent_layers(const KeyReader& r, HParams& hp) {
  hp.recurrent.assign(static_cast<size_t>(hp.n_layer), false);
  if (const gguf::Array* a = r.array("attention.recurrent_layers"); a != nullptr) {
    if (static_cast<int64_t>(a->items.size()) < hp.n_layer) {
      r.fail(r.key("attention.recurrent_layers"), "has " + std::to_string(a->items.size()) + " entries for " +
                                                      std::to_string(hp.n_layer) + " layers");
    }
    for (int64_t i = 0; i < hp.n_layer; ++i) {
      std::optional<bool> b = a->items[i].as_bool();
      if (!b) {
        if (std::optional<int64_t> x = a->items[i].as_i64()) b = *x != 0;
      }
      if (!b) r.fail(r.key("attention.recurrent_layers"), "entries must be bools");
      hp.recurrent[i] = *b;
    }
    hp.full_attention_interval = r.count("full_attention_interval", 0, true);
  } else {
    hp.full_attention_interval = r.count("full_attention_interval", 4);
    for (int64_t i = 0; i < hp.n_layer; ++i) hp.recurrent[i] = (i + 1) % hp.full_attention_interval != 0;
  }
}

void read_keys(const KeyReader& r, HParams& hp) {
  hp.norm_topk_prob = r.flag("expert_weights_norm", true);
  hp.n_ff_shexp = r.count("expert_shared_feed_forward_length", hp.n_ff_exp);
  hp.ssm_conv_kernel = r.count("ssm.conv_kernel");
  hp.ssm_head_k_dim = r.count("ssm.state_size");
  hp.ssm_n_k_heads = r.count("ssm.group_count");
  hp.ssm_n_v_heads = r.count("ssm.time_step_rank");
  const int64_t inner = r.count("ssm.inner_size");
  if (inner % hp.ssm_n_v_heads != 0) r.fail(r.key("ssm.inner_size"), "not a multiple of ssm.time_step_rank");
  hp.ssm_head_v_dim = inner / hp.ssm_n_v_heads;
  if (hp.ssm_n_v_heads % hp.ssm_n_k_heads != 0) {
    r.fail(r.key("ssm.time_step_rank"), "value heads " + std::to_string(hp.ssm_n_v_heads) +
                                            " not a multiple of key heads (ssm.group_count) " +
                                            std::to_string(hp.ssm_n_k_heads));
  }
  if (hp.ssm_head_v_dim != hp.ssm_head_k_dim) {
    r.fail(r.key("ssm.inner_size"), "value head dim " + std::to_string(hp.ssm_head_v_dim) +
                                        " differs from key head dim (ssm.state_size) " +
                                        std::to_string(hp.ssm_head_k_dim));
  }
  read_recurrent_layers(r, hp);
}

LayerRecipe layer_recipe(const HParams& hp, int64_t il) {
  LayerRecipe L;
  // nextn blocks (il >= n_layer) are full attention.
  L.mixer.kind = hp.is_recurrent(il) ? MixerKind::GatedDeltaNet : MixerKind::Attention;
  L.mixer.attn.qk_norm = true;
  L.mixer.attn.output_gate = true;
  L.mixer.attn.rope.n_rot = hp.n_rot;
  L.mixer.attn.rope.freq_base = hp.rope_freq_base;
  L.ffn.kind = FfnKind::Moe;
  L.ffn.router.kind = RouterKind::SoftmaxTopK;
  L.ffn.router.renormalize = hp.norm_topk_prob;
  L.ffn.experts.act = Activation::SwiGlu;
  L.ffn.experts.n_ff = hp.n_ff_exp;
  L.ffn.shared = {true, true, hp.n_ff_shexp};
  return L;
}

void write_keys(const HParams& hp, const std::string& a, KeyList& m) {
  const auto u32 = [](int64_t x) { return gguf::Value::u32(static_cast<uint32_t>(x)); };
  m.emplace_back(a + "expert_shared_feed_forward_length", u32(hp.n_ff_shexp));
  m.emplace_back(a + "ssm.conv_kernel", u32(hp.ssm_conv_kernel));
  m.emplace_back(a + "ssm.state_size", u32(hp.ssm_head_k_dim));
  m.emplace_back(a + "ssm.group_count", u32(hp.ssm_n_k_heads));
  m.emplace_back(a + "ssm.time_step_rank", u32(hp.ssm_n_v_heads));
  m.emplace_back(a + "ssm.inner_size", u32(hp.ssm_head_v_dim * hp.ssm_n_v_heads));
  std::vector<gguf::Value> rec;
  // llama.cpp wants one entry per block, nextn blocks included (as its converter writes).
  for (int64_t i = 0; i < hp.n_layer + hp.n_nextn; ++i) rec.push_back(gguf::Value::boolean(hp.is_recurrent(i)));
  m.emplace_back(a + "attention.recurrent_layers", gguf::Value::array(gguf::ValueType::BOOL, std::move(rec)));
  m.emplace_back(a + "full_attention_interval", u32(hp.full_attention_interval));
}

}  // namespace

const ArchDesc& arch_qwen3next() {
  static const ArchDesc d{
      "qwen3next",
      {"Qwen3NextForCausalLM"},
      {
          {"expert_weights_norm", "true", "renormalise the top-k router weights (HF norm_topk_prob)"},
          {"expert_shared_feed_forward_length", "expert_feed_forward_length", "shared expert width"},
          {"ssm.conv_kernel", nullptr, "DeltaNet causal conv1d width"},
          {"ssm.state_size", nullptr, "DeltaNet key (and value) head dim"},
          {"ssm.group_count", nullptr, "DeltaNet key heads"},
          {"ssm.time_step_rank", nullptr, "DeltaNet value heads"},
          {"ssm.inner_size", nullptr, "value heads * value head dim"},
          {"attention.recurrent_layers", "(from full_attention_interval)", "per layer: DeltaNet or attention"},
          {"full_attention_interval", "4", "every n-th layer is full attention"},
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
          {TensorRole::AttnQNorm, "attn_q_norm.weight", "self_attn.q_norm.weight"},
          {TensorRole::AttnKNorm, "attn_k_norm.weight", "self_attn.k_norm.weight"},
          // in_proj_qkvz is split and regrouped into these two by the converter.
          {TensorRole::DnQkv, "attn_qkv.weight", ""},
          {TensorRole::DnGate, "attn_gate.weight", ""},
          {TensorRole::DnQkvzLegacy, "ssm_in.weight", "linear_attn.in_proj_qkvz.weight"},
          {TensorRole::DnBa, "ssm_ba.weight", "linear_attn.in_proj_ba.weight"},
          {TensorRole::DnConv, "ssm_conv1d.weight", "linear_attn.conv1d.weight"},
          {TensorRole::DnDtBias, "ssm_dt.bias", "linear_attn.dt_bias"},
          {TensorRole::DnA, "ssm_a", "linear_attn.A_log"},
          {TensorRole::DnNorm, "ssm_norm.weight", "linear_attn.norm.weight"},
          {TensorRole::DnOut, "ssm_out.weight", "linear_attn.out_proj.weight"},
          // llama.cpp names HF's post_attention_layernorm post_attention_norm for this family.
          {TensorRole::FfnNorm, "post_attention_norm.weight", "post_attention_layernorm.weight"},
          {TensorRole::Router, "ffn_gate_inp.weight", "mlp.gate.weight"},
          {TensorRole::GateExps, "ffn_gate_exps.weight", "mlp.experts.{E}.gate_proj.weight"},
          {TensorRole::UpExps, "ffn_up_exps.weight", "mlp.experts.{E}.up_proj.weight"},
          {TensorRole::DownExps, "ffn_down_exps.weight", "mlp.experts.{E}.down_proj.weight"},
          {TensorRole::SharedRouter, "ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight"},
          {TensorRole::GateShexp, "ffn_gate_shexp.weight", "mlp.shared_expert.gate_proj.weight"},
          {TensorRole::UpShexp, "ffn_up_shexp.weight", "mlp.shared_expert.up_proj.weight"},
          {TensorRole::DownShexp, "ffn_down_shexp.weight", "mlp.shared_expert.down_proj.weight"},
          {TensorRole::NextnEhProj, "nextn.eh_proj.weight", "{M}fc.weight"},
          {TensorRole::NextnEnorm, "nextn.enorm.weight", "{M}pre_fc_norm_embedding.weight"},
          {TensorRole::NextnHnorm, "nextn.hnorm.weight", "{M}pre_fc_norm_hidden.weight"},
          {TensorRole::NextnEmbedTokens, "nextn.embed_tokens.weight", ""},
          {TensorRole::NextnSharedHeadHead, "nextn.shared_head_head.weight", ""},
          {TensorRole::NextnSharedHeadNorm, "nextn.shared_head_norm.weight", "{M}norm.weight"},
      },
      read_keys,
      layer_recipe,
      write_keys,
  };
  return d;
}

}  // namespace moraine::model
