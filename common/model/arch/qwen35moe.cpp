// qwen35moe (Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B; HF Qwen3_5MoeForCausalLM), as llama.cpp's
// "qwen35moe" loads it: qwen3next's hybrid (see qwen3next.cpp for the formulas), with
//   - DeltaNet beta and alpha as two projections (ssm_beta, ssm_alpha), one row per value head,
//     instead of ssm_ba grouped per key head;
//   - value heads in tiled order: value head j reads key head j % n_k_heads (llama.cpp's
//     converter reorders HF's grouped heads so, for ggml's broadcast), not j / (n_v / n_k);
//   - interleaved M-RoPE (rope.dimension_sections, required). With text positions (the same id
//     in its t, h and w parts, 0 in the fourth) every pair whose section is t, h or w turns as
//     NEOX RoPE does; sections that leave a pair to the fourth part are refused;
//   - the router's weights always renormalised (no expert_weights_norm key).
// Gated attention with q/k norm, softmax router, a gated shared expert, nextn blocks after the
// trunk (full attention; bound, not run) as qwen3next.
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

// ggml's interleaved M-RoPE gives pair i the position part by its sector i % sum(sections):
// t, h, w by sector % 3 while within 3 * that section, else the fourth (0 for text).
void check_rope_sections(const KeyReader& r, const HParams& hp) {
  const gguf::Array* a = r.array("rope.dimension_sections");
  if (a == nullptr) r.fail(r.key("rope.dimension_sections"), "required key is missing");
  int64_t s[4] = {0, 0, 0, 0};
  for (size_t i = 0; i < a->items.size() && i < 4; ++i) {
    const std::optional<int64_t> x = a->items[i].as_i64();
    if (!x || *x < 0) r.fail(r.key("rope.dimension_sections"), "entries must be non-negative integers");
    s[i] = *x;
  }
  const int64_t total = s[0] + s[1] + s[2] + s[3];
  if (total <= 0 || total > hp.head_dim) r.fail(r.key("rope.dimension_sections"), "sums to " + std::to_string(total));
  for (int64_t i = 0; i < hp.n_rot / 2; ++i) {
    const int64_t sector = i % total;
    const bool text = (sector % 3 == 0 && sector < 3 * s[0]) || (sector % 3 == 1 && sector < 3 * s[1]) ||
                      (sector % 3 == 2 && sector < 3 * s[2]);
    if (!text)
      r.fail(r.key("rope.dimension_sections"), "rotary pair " + std::to_string(i) +
                                                   " falls to the fourth position part, which moraine does not implement");
  }
}

void read_keys(const KeyReader& r, HParams& hp) {
  hp.norm_topk_prob = true;
  hp.n_ff_shexp = r.count("expert_shared_feed_forward_length", hp.n_ff > 0 ? hp.n_ff : hp.n_ff_exp);
  hp.ssm_conv_kernel = r.count("ssm.conv_kernel");
  hp.ssm_head_k_dim = r.count("ssm.state_size");
  hp.ssm_n_k_heads = r.count("ssm.group_count");
  hp.ssm_n_v_heads = r.count("ssm.time_step_rank");
  const int64_t inner = r.count("ssm.inner_size");
  if (inner % hp.ssm_n_v_heads != 0) r.fail(r.key("ssm.inner_size"), "not a multiple of ssm.time_step_rank");
  hp.ssm_head_v_dim = inner / hp.ssm_n_v_heads;
  if (hp.ssm_n_v_heads % hp.ssm_n_k_heads != 0)
    r.fail(r.key("ssm.time_step_rank"), "value heads " + std::to_string(hp.ssm_n_v_heads) +
                                            " not a multiple of key heads (ssm.group_count) " +
                                            std::to_string(hp.ssm_n_k_heads));
  if (hp.ssm_head_v_dim != hp.ssm_head_k_dim)
    r.fail(r.key("ssm.inner_size"), "value head dim " + std::to_string(hp.ssm_head_v_dim) +
                                        " differs from key head dim (ssm.state_size) " +
                                        std::to_string(hp.ssm_head_k_dim));
  check_rope_sections(r, hp);
  read_recurrent_layers(r, hp);
}

LayerRecipe layer_recipe(const HParams& hp, int64_t il) {
  LayerRecipe L;
  // nextn blocks (il >= n_layer) are full attention.
  L.mixer.kind = hp.is_recurrent(il) ? MixerKind::GatedDeltaNet : MixerKind::Attention;
  L.mixer.delta.v_heads_tiled = true;
  L.mixer.delta.split_ba = true;
  L.mixer.attn.qk_norm = true;
  L.mixer.attn.output_gate = true;
  L.mixer.attn.rope.n_rot = hp.n_rot;
  L.mixer.attn.rope.freq_base = hp.rope_freq_base;
  L.ffn.kind = FfnKind::Moe;
  L.ffn.router.kind = RouterKind::SoftmaxTopK;
  L.ffn.router.renormalize = true;
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
  for (int64_t i = 0; i < hp.n_layer + hp.n_nextn; ++i) rec.push_back(gguf::Value::boolean(hp.is_recurrent(i)));
  m.emplace_back(a + "attention.recurrent_layers", gguf::Value::array(gguf::ValueType::BOOL, std::move(rec)));
  m.emplace_back(a + "full_attention_interval", u32(hp.full_attention_interval));
  // Qwen3.5's sections over the rotary pairs in the ratio 11 : 11 : 10 (all of them text-turned).
  const int64_t pairs = hp.n_rot / 2, t = (pairs * 11 + 31) / 32, hh = (pairs - t + 1) / 2;
  std::vector<gguf::Value> sec = {gguf::Value::i32(static_cast<int32_t>(t)), gguf::Value::i32(static_cast<int32_t>(hh)),
                                  gguf::Value::i32(static_cast<int32_t>(pairs - t - hh)), gguf::Value::i32(0)};
  m.emplace_back(a + "rope.dimension_sections", gguf::Value::array(gguf::ValueType::INT32, std::move(sec)));
}

}  // namespace

const ArchDesc& arch_qwen35moe() {
  static const ArchDesc d{
      "qwen35moe",
      {"Qwen3_5MoeForCausalLM"},
      {
          {"expert_shared_feed_forward_length", "feed_forward_length", "shared expert width"},
          {"ssm.conv_kernel", nullptr, "DeltaNet causal conv1d width"},
          {"ssm.state_size", nullptr, "DeltaNet key (and value) head dim"},
          {"ssm.group_count", nullptr, "DeltaNet key heads"},
          {"ssm.time_step_rank", nullptr, "DeltaNet value heads"},
          {"ssm.inner_size", nullptr, "value heads * value head dim"},
          {"attention.recurrent_layers", "(from full_attention_interval)", "per layer: DeltaNet or attention"},
          {"full_attention_interval", "4", "every n-th layer is full attention"},
          {"rope.dimension_sections", nullptr, "interleaved M-RoPE sections (t, h, w, e); [11, 11, 10, 0]"},
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
          // The converter reorders the value heads of these (grouped to tiled) when n_v > n_k.
          {TensorRole::DnQkv, "attn_qkv.weight", ""},
          {TensorRole::DnGate, "attn_gate.weight", ""},
          {TensorRole::DnBeta, "ssm_beta.weight", ""},
          {TensorRole::DnAlpha, "ssm_alpha.weight", ""},
          {TensorRole::DnConv, "ssm_conv1d.weight", ""},
          {TensorRole::DnDtBias, "ssm_dt.bias", ""},
          {TensorRole::DnA, "ssm_a", ""},
          {TensorRole::DnNorm, "ssm_norm.weight", "linear_attn.norm.weight"},
          {TensorRole::DnOut, "ssm_out.weight", ""},
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
