// Glm4MoeForCausalLM -> glm4moe, with the keys llama.cpp's converter writes: experts from
// n_routed_experts, expert_shared_count (n_shared_experts), leading_dense_block_count
// (first_k_dense_replace), sigmoid gating, expert_weights_scale (routed_scaling_factor),
// expert_weights_norm (norm_topk_prob), expert groups (n_group, topk_group), partial RoPE
// (default 0.5) and nextn_predict_layers. Every tensor maps by the description's table (no
// transform: GLM's RMSNorms scale by w, its q/k are NEOX-ordered already). The multi-token-
// prediction blocks are model.layers.{n_layer + i} (the layer's tensors plus eh_proj, enorm,
// hnorm, shared_head.*, embed_tokens) and become nextn blocks after the trunk; a checkpoint
// saved without them (transformers does not build them) is written as llama.cpp's --no-mtp.
#include <regex>

#include "tools/convert/arch_converter.h"

namespace moraine::convert {


namespace {

// MTP layers the checkpoint holds: model.layers.N.* with N >= num_hidden_layers.
int64_t checkpoint_mtp_layers(const Checkpoint& ckpt, int64_t n_layer) {
  static const std::regex re("^model\\.layers\\.([0-9]+)\\.");
  int64_t n = 0;
  for (const StTensor& t : ckpt.tensors()) {
    std::smatch mt;
    if (std::regex_search(t.name, mt, re)) n = std::max<int64_t>(n, std::stoll(mt[1].str()) + 1 - n_layer);
  }
  return n;
}

void read_nextn(const HfConfig& cfg, const Checkpoint& ckpt, HfModel& m) {
  model::HParams& hp = m.hp;
  const int64_t want = cfg.opt_integer({"num_nextn_predict_layers"}).value_or(0);
  const int64_t have = checkpoint_mtp_layers(ckpt, hp.n_layer);
  if (have == 0 && want > 0) {
    m.notes.push_back("config.json: num_nextn_predict_layers = " + std::to_string(want) + " but the checkpoint has no model.layers." +
                      std::to_string(hp.n_layer) + ".*: written without nextn blocks (llama.cpp's --no-mtp)");
    return;
  }
  if (have != want) {
    cfg.fail("num_nextn_predict_layers", "= " + std::to_string(want) + " but the checkpoint has " + std::to_string(have) +
                                             " layers after num_hidden_layers");
  }
  hp.n_nextn = have;
  m.mtp_prefix = "model.";
  m.mtp_first = hp.n_layer;
}

void read_routing(const HfConfig& cfg, HfModel& m) {
  model::HParams& hp = m.hp;
  hp.n_ff_exp = cfg.integer("moe_intermediate_size");
  hp.n_ff_shexp = cfg.integer("n_shared_experts") * hp.n_ff_exp;
  hp.norm_topk_prob = cfg.flag("norm_topk_prob", true);
  hp.expert_weights_scale = cfg.opt_number("routed_scaling_factor").value_or(1.0);
  for (const char* k : {"scoring_func", "topk_method"}) {
    const std::optional<std::string> v = cfg.opt_text(k);
    if (v && *v != (std::string(k) == "scoring_func" ? "sigmoid" : "noaux_tc"))
      cfg.fail(k, "= '" + *v + "' is not supported: glm4moe's router is sigmoid with a score-correction bias");
  }
  const std::optional<int64_t> groups = cfg.opt_integer({"n_group"}), used = cfg.opt_integer({"topk_group"});
  hp.n_expert_groups = groups.value_or(1) == 0 ? 1 : groups.value_or(1);
  hp.n_group_used = used.value_or(1);
  if (hp.n_expert % hp.n_expert_groups != 0) cfg.fail("n_group", "does not divide n_routed_experts " + std::to_string(hp.n_expert));
  if (hp.n_expert_groups > 1 && (hp.n_group_used < 1 || hp.n_group_used > hp.n_expert_groups ||
                                 hp.n_group_used * (hp.n_expert / hp.n_expert_groups) < hp.n_expert_used)) {
    cfg.fail("topk_group", "= " + std::to_string(hp.n_group_used) + " groups cannot hold num_experts_per_tok experts");
  }
  m.put_u32("expert_shared_count", hp.n_ff_shexp / hp.n_ff_exp);
  m.put_u32("leading_dense_block_count", hp.n_dense_lead);
  m.put_u32("expert_gating_func", 2);   // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
  m.put_f32("expert_weights_scale", hp.expert_weights_scale);
  m.put("expert_weights_norm", gguf::Value::boolean(hp.norm_topk_prob));
  if (groups) m.put_u32("expert_group_count", *groups);
  if (used) m.put_u32("expert_group_used_count", *used);
}

void read_config(const HfConfig& cfg, const Checkpoint& ckpt, HfModel& m) {
  model::HParams& hp = m.hp;
  const HfConfig rope = cfg.rope();
  const char* type_key = rope.has("rope_type") ? "rope_type" : "type";
  if (const std::optional<std::string> t = rope.opt_text(type_key); t && *t != "default") {
    rope.fail(type_key, "= '" + *t + "' is not supported: glm4moe has no RoPE scaling");
  }
  if (rope.has("mrope_section")) rope.fail("mrope_section", "M-RoPE (GLM-4.5V's) is not supported by glm4moe");
  if (const std::optional<std::string> act = cfg.opt_text("hidden_act"); act && *act != "silu") {
    cfg.fail("hidden_act", "= '" + *act + "' is not supported: glm4moe's FFNs are SwiGLU");
  }
  if (!cfg.flag("attention_bias", true)) cfg.fail("attention_bias", "= false is not supported: glm4moe has q/k/v biases");
  hp.attn_qk_norm = cfg.flag("use_qk_norm", false);
  double partial = 0.5;  // transformers' and llama.cpp's default for GLM-4.5
  if (rope.has("partial_rotary_factor")) partial = rope.number("partial_rotary_factor");
  else if (cfg.has("partial_rotary_factor")) partial = cfg.number("partial_rotary_factor");
  hp.n_rot = static_cast<int64_t>(static_cast<double>(hp.head_dim) * partial);
  hp.n_dense_lead = cfg.opt_integer({"first_k_dense_replace"}).value_or(0);
  if (hp.n_dense_lead > hp.n_layer) cfg.fail("first_k_dense_replace", "exceeds num_hidden_layers");
  if (hp.n_dense_lead > 0 && hp.n_ff == 0) cfg.fail("intermediate_size", "is required with dense layers (first_k_dense_replace)");
  m.put_u32("rope.dimension_count", hp.n_rot);
  read_routing(cfg, m);
  read_nextn(cfg, ckpt, m);
  if (hp.n_nextn > 0) m.put_u32("nextn_predict_layers", hp.n_nextn);
}

}  // namespace

const ArchConverter& converter_glm4moe() {
  static const ArchConverter c{"glm4moe", {"glm4_moe"}, read_config, nullptr, nullptr};
  return c;
}

}  // namespace moraine::convert
