// DeepseekV2ForCausalLM / DeepseekV3ForCausalLM -> deepseek2, with the keys and tensors llama.cpp's
// converter writes today: MLA as MQA over the latent (head_count_kv 1, key_length kv_lora_rank +
// qk_rope_head_dim, value_length kv_lora_rank, key_length_mla / value_length_mla the decompressed
// head dims), q_lora_rank (0: q projected directly), leading_dense_block_count
// (first_k_dense_replace), expert_shared_count, expert_weights_scale (routed_scaling_factor),
// expert_weights_norm (norm_topk_prob, only when true), expert groups (n_group / topk_group),
// the router (V2 softmax, V3 sigmoid with e_score_correction_bias -> exp_probs_b), DeepSeek's
// YaRN (factor, original_max_position_embeddings, yarn_log_multiplier = 0.1 * mscale_all_dim).
// Tensors: kv_b_proj [n_head * (nope + v), rank] is split per head into attn_k_b {nope, rank,
// n_head} (the k rows, transposed) and attn_v_b {rank, v, n_head}; the rest maps by the table
// (RoPE is NORM-paired in both transformers and llama.cpp: no q/k permutation). Multi-token-
// prediction layers (model.layers.{n_layer + i}) are dropped, as llama.cpp's converter does.
#include <cmath>

#include "tools/convert/arch_converter.h"

namespace moraine::convert {

using model::TensorRole;
using nlohmann::json;

namespace {

bool is_v3(const HfConfig& cfg) {
  const json* a = cfg.find("architectures");
  if (a && a->is_array() && !a->empty() && (*a)[0].is_string()) return (*a)[0].get<std::string>() == "DeepseekV3ForCausalLM";
  return cfg.opt_text("model_type").value_or("") == "deepseek_v3";
}

// DeepSeek's YaRN, where transformers and llama.cpp agree: cos / sin unscaled (mscale ==
// mscale_all_dim), the scores times mscale^2, factor = max_position_embeddings / original.
void read_rope(const HfConfig& cfg, HfModel& m) {
  model::HParams& hp = m.hp;
  const HfConfig rope = cfg.rope();
  const char* type_key = rope.has("rope_type") ? "rope_type" : "type";
  const std::string type = rope.opt_text(type_key).value_or("default");
  const std::optional<double> all_dim = rope.opt_number("mscale_all_dim");
  if (type == "yarn") {
    hp.rope_scaling = model::RopeScaling::Yarn;
    hp.rope_scaling_factor = rope.number("factor");
    if (hp.rope_scaling_factor < 1.0) rope.fail("factor", "must be at least 1");
    const std::optional<int64_t> orig = rope.has("original_max_position_embeddings")
                                            ? rope.opt_integer({"original_max_position_embeddings"})
                                            : cfg.opt_integer({"original_max_position_embeddings"});
    if (!orig) rope.fail("original_max_position_embeddings", "is required with yarn");
    hp.rope_orig_ctx = *orig;
    // transformers takes the factor from the context ratio when both are given; llama.cpp from factor.
    if (m.ctx && static_cast<double>(*m.ctx) / static_cast<double>(*orig) != hp.rope_scaling_factor)
      rope.fail("factor", "differs from max_position_embeddings / original_max_position_embeddings (transformers' factor)");
    for (const auto& [k, want] : {std::pair<const char*, double>{"beta_fast", 32.0}, {"beta_slow", 1.0}}) {
      if (std::optional<double> v = rope.opt_number(k); v && *v != want)
        rope.fail(k, "= " + std::to_string(*v) + " is not supported (deepseek2 uses " + std::to_string(want) + ")");
    }
    for (const char* k : {"attention_factor", "attn_factor", "extrapolation_factor"}) {
      if (rope.has(k)) rope.fail(k, "is not supported: deepseek2's YaRN scaling comes from factor and mscale_all_dim");
    }
    // Otherwise transformers scales cos / sin by mscale / mscale_all_dim, which llama.cpp never does.
    if (!all_dim || *all_dim <= 0.0) rope.fail("mscale_all_dim", "is required (positive) with yarn");
    if (rope.opt_number("mscale") != all_dim) rope.fail("mscale", "must equal mscale_all_dim (llama.cpp reads mscale_all_dim only)");
    m.put("rope.scaling.type", gguf::Value::string("yarn"));
    m.put_f32("rope.scaling.factor", hp.rope_scaling_factor);
    m.put_u32("rope.scaling.original_context_length", hp.rope_orig_ctx);
    if (rope.has("beta_fast")) m.put_f32("rope.scaling.yarn_beta_fast", rope.number("beta_fast"));
    if (rope.has("beta_slow")) m.put_f32("rope.scaling.yarn_beta_slow", rope.number("beta_slow"));
  } else if (type != "default") {
    rope.fail(type_key, "= '" + type + "' is not a RoPE scaling deepseek2 uses (yarn or default)");
  }
  m.put_u32("rope.dimension_count", hp.n_rot);
  if (all_dim) {   // llama.cpp's legacy 0.1 factor, undone by its loader (and ours)
    const float key = static_cast<float>(0.1 * *all_dim);
    hp.rope_yarn_log_mul = static_cast<double>(key) / 0.1;
    m.put_f32("rope.scaling.yarn_log_multiplier", key);
  }
}

void read_attention(const HfConfig& cfg, HfModel& m) {
  model::HParams& hp = m.hp;
  if (cfg.flag("attention_bias", false)) cfg.fail("attention_bias", "= true is not supported: deepseek2 has no attention biases");
  if (hp.n_head_kv != hp.n_head) cfg.fail("num_key_value_heads", "must equal num_attention_heads (kv_b_proj is split per head)");
  hp.q_lora_rank = cfg.opt_integer({"q_lora_rank"}).value_or(0);
  hp.kv_lora_rank = cfg.integer("kv_lora_rank");
  const int64_t nope = cfg.integer("qk_nope_head_dim"), rope = cfg.integer("qk_rope_head_dim");
  if (hp.kv_lora_rank == 0) cfg.fail("kv_lora_rank", "must be positive");
  if (nope == 0 || rope == 0) cfg.fail(nope == 0 ? "qk_nope_head_dim" : "qk_rope_head_dim", "must be positive");
  if (rope % 2 != 0) cfg.fail("qk_rope_head_dim", "must be even");
  hp.n_rot = rope;
  hp.mla_head_k = nope + rope;
  hp.mla_head_v = cfg.integer("v_head_dim");
  hp.mla_split_kv_b = true;
  // MQA over the cached latent, as llama.cpp writes it (config.json's head_dim is not written).
  hp.n_head_kv = 1;
  hp.head_dim = hp.kv_lora_rank + rope;
  hp.head_dim_v = hp.kv_lora_rank;
  m.head_dim_cfg.reset();
  // llama.cpp's converter omits it for direct q, but its loader then needs it unless the layer count is V2-Lite's.
  m.put_u32("attention.q_lora_rank", hp.q_lora_rank);
  m.put_u32("attention.kv_lora_rank", hp.kv_lora_rank);
  m.put_u32("attention.key_length", hp.head_dim);
  m.put_u32("attention.value_length", hp.head_dim_v);
  m.put_u32("attention.key_length_mla", hp.mla_head_k);
  m.put_u32("attention.value_length_mla", hp.mla_head_v);
}

// The router: V2 softmax over all experts (DeepseekV2's greedy top-k), V3 sigmoid with the
// score-correction bias and group-limited top-k; renormalised when norm_topk_prob, then scaled.
void read_routing(const HfConfig& cfg, const Checkpoint& ckpt, HfModel& m) {
  model::HParams& hp = m.hp;
  const bool v3 = is_v3(cfg);
  hp.n_ff_exp = cfg.integer("moe_intermediate_size");
  hp.n_ff_shexp = cfg.opt_integer({"n_shared_experts"}).value_or(0) * hp.n_ff_exp;
  hp.norm_topk_prob = cfg.flag("norm_topk_prob", false);
  const std::optional<double> scale = cfg.opt_number("routed_scaling_factor");
  hp.expert_weights_scale = scale.value_or(1.0);
  const std::optional<std::string> scoring = cfg.opt_text("scoring_func");
  if (scoring && *scoring != (v3 ? "sigmoid" : "softmax"))
    cfg.fail("scoring_func", "= '" + *scoring + "' is not supported: " + (v3 ? "DeepSeek-V3's router is sigmoid" : "DeepSeek-V2's router is softmax"));
  const std::optional<std::string> method = cfg.opt_text("topk_method");
  if (method && *method != (v3 ? "noaux_tc" : "greedy"))
    cfg.fail("topk_method", "= '" + *method + "' is not supported (" + (v3 ? "noaux_tc" : "greedy") + " only)");
  const std::optional<int64_t> groups = cfg.opt_integer({"n_group"}), used = cfg.opt_integer({"topk_group"});
  hp.n_expert_groups = groups.value_or(1) == 0 ? 1 : groups.value_or(1);
  hp.n_group_used = used.value_or(1);
  // DeepseekV2's greedy top-k ignores the groups, llama.cpp's softmax router would not.
  if (!v3 && hp.n_expert_groups > 1) cfg.fail("n_group", "> 1 is not supported with the softmax router (DeepSeek-V2 236B)");
  if (hp.n_expert % hp.n_expert_groups != 0) cfg.fail("n_group", "does not divide n_routed_experts " + std::to_string(hp.n_expert));
  if (hp.n_expert_groups > 1 && (hp.n_group_used < 1 || hp.n_group_used >= hp.n_expert_groups ||
                                 hp.n_group_used * (hp.n_expert / hp.n_expert_groups) < hp.n_expert_used)) {
    cfg.fail("topk_group", "= " + std::to_string(hp.n_group_used) + " must be in [1, n_group) and hold num_experts_per_tok experts");
  }
  hp.sigmoid_gating = v3;
  hp.expert_score_bias = v3 && hp.n_dense_lead < hp.n_layer &&
                         ckpt.find("model.layers." + std::to_string(hp.n_dense_lead) + ".mlp.gate.e_score_correction_bias");
  m.put_u32("expert_shared_count", hp.n_ff_shexp / hp.n_ff_exp);
  if (scale) m.put_f32("expert_weights_scale", *scale);
  if (hp.norm_topk_prob) m.put("expert_weights_norm", gguf::Value::boolean(true));
  // llama.cpp writes the gating func only from scoring_func, and takes softmax without it:
  // transformers' DeepseekV3 config has none, so V3 always states its sigmoid.
  if (v3) m.put_u32("expert_gating_func", 2);
  else if (scoring) m.put_u32("expert_gating_func", 1);
  if (groups) m.put_u32("expert_group_count", *groups);
  if (used) m.put_u32("expert_group_used_count", *used);
}

void read_config(const HfConfig& cfg, const Checkpoint& ckpt, HfModel& m) {
  model::HParams& hp = m.hp;
  if (const std::optional<std::string> act = cfg.opt_text("hidden_act"); act && *act != "silu")
    cfg.fail("hidden_act", "= '" + *act + "' is not supported: deepseek2's FFNs are SwiGLU");
  hp.n_dense_lead = cfg.opt_integer({"first_k_dense_replace"}).value_or(0);
  if (hp.n_dense_lead > hp.n_layer) cfg.fail("first_k_dense_replace", "exceeds num_hidden_layers");
  if (hp.n_dense_lead > 0 && hp.n_ff == 0) cfg.fail("intermediate_size", "is required with dense layers (first_k_dense_replace)");
  m.put_u32("leading_dense_block_count", hp.n_dense_lead);
  m.put_u32("vocab_size", hp.n_vocab);
  read_attention(cfg, m);
  read_routing(cfg, ckpt, m);
  read_rope(cfg, m);
  if (const int64_t n_mtp = cfg.opt_integer({"num_nextn_predict_layers"}).value_or(0); n_mtp > 0) {
    for (int64_t i = 0; i < n_mtp; ++i) m.drop_prefixes.push_back("model.layers." + std::to_string(hp.n_layer + i) + ".");
    m.notes.push_back("config.json: num_nextn_predict_layers: the multi-token-prediction layers are not written "
                      "(llama.cpp's converter skips them for deepseek2)");
  }
}

// kv_b_proj's rows are, per head, nope k rows then v rows, each of kv_lora_rank latents.
bool map_tensor(Planner& p, const model::TensorSlot& t, const std::string& hf) {
  if (t.role != TensorRole::MlaKB && t.role != TensorRole::MlaVB) return false;
  const model::HParams& hp = p.model().hp;
  const int64_t H = hp.n_head, R = hp.kv_lora_rank, nope = hp.mla_head_k - hp.n_rot, v = hp.mla_head_v;
  const StTensor& kv = p.take(hf + "self_attn.kv_b_proj.weight", {H * (nope + v), R});
  std::vector<RowSpan> rows;
  for (int64_t h = 0; h < H; ++h) {
    // k_b: GGUF row (h, r) is latent column r of head h's nope rows (transposed); v_b: the v rows as they are.
    if (t.role == TensorRole::MlaKB) rows.push_back({&kv, h * (nope + v) * R, R, /*elem_stride=*/R, /*row_stride=*/1});
    else rows.push_back({&kv, h * (nope + v) + nope, v});
  }
  p.add(t.name, t.shape, std::move(rows), ElemOp::None);
  return true;
}

}  // namespace

const ArchConverter& converter_deepseek2() {
  static const ArchConverter c{"deepseek2", {"deepseek_v2", "deepseek_v3"}, read_config, map_tensor, nullptr};
  return c;
}

}  // namespace moraine::convert
