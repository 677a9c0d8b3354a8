#include "tools/convert/qwen_config.h"

#include <regex>

namespace moraine::convert {

using nlohmann::json;

void require_default_rope(const HfConfig& cfg) {
  const HfConfig rope = cfg.rope();
  if (const json* t = rope.find("rope_type"); t && *t != "default") {
    throw ConvertError("config.json: rope type " + t->dump() + " is not supported (only default RoPE is)");
  }
  if (const json* t = rope.find("type"); t && *t != "default") {
    throw ConvertError("config.json: rope_scaling type " + t->dump() + " is not supported (only default RoPE is)");
  }
}

void read_qwen_moe(const HfConfig& cfg, HfModel& m) {
  m.hp.n_ff_exp = cfg.integer("moe_intermediate_size");
  if (cfg.opt_integer({"decoder_sparse_step"}).value_or(1) != 1) {
    throw ConvertError("config.json: decoder_sparse_step != 1 (dense layers between MoE layers) is not supported");
  }
  if (const json* mo = cfg.find("mlp_only_layers"); mo && !(mo->is_array() && mo->empty())) {
    throw ConvertError("config.json: mlp_only_layers " + mo->dump() + " (dense layers) is not supported");
  }
  if (cfg.flag("use_sliding_window", false)) {
    throw ConvertError("config.json: use_sliding_window = true is not supported");
  }
}

void require_norm_topk_prob(const HfConfig& cfg, bool dflt, bool required) {
  if (cfg.flag("norm_topk_prob", dflt) == required) return;
  if (required) {
    throw ConvertError("config.json: norm_topk_prob = false is not supported: the GGUF architecture always "
                       "renormalises the chosen experts' weights");
  }
  throw ConvertError("config.json: norm_topk_prob = true is not supported: the GGUF architecture never "
                     "renormalises the chosen experts' weights");
}

namespace {

// Qwen3-Next checkpoints carry a multi-token-prediction block under "mtp." (or "model.mtp.").
std::string mtp_prefix(const Checkpoint& ckpt) {
  for (const StTensor& t : ckpt.tensors()) {
    if (t.name.rfind("model.mtp.", 0) == 0) return "model.mtp.";
    if (t.name.rfind("mtp.", 0) == 0) return "mtp.";
  }
  return "";
}

int64_t count_mtp_layers(const Checkpoint& ckpt, const std::string& prefix) {
  if (prefix.empty()) return 0;
  const std::regex re("^" + std::regex_replace(prefix, std::regex("\\."), "\\.") + "layers\\.([0-9]+)\\.");
  int64_t n = 0;
  for (const StTensor& t : ckpt.tensors()) {
    std::smatch mt;
    if (std::regex_search(t.name, mt, re)) n = std::max<int64_t>(n, std::stoll(mt[1].str()) + 1);
  }
  return n;
}

void read_layer_types(const HfConfig& cfg, model::HParams& hp) {
  std::optional<int64_t> interval = cfg.opt_integer({"full_attention_interval"});
  if (interval && *interval == 0) throw ConvertError("config.json: full_attention_interval must be > 0");
  hp.recurrent.clear();
  if (const json* lt = cfg.find("layer_types")) {
    if (!lt->is_array() || static_cast<int64_t>(lt->size()) != hp.n_layer) {
      throw ConvertError("config.json: layer_types must list num_hidden_layers (" + std::to_string(hp.n_layer) +
                         ") entries");
    }
    for (size_t i = 0; i < lt->size(); ++i) {
      const json& t = (*lt)[i];
      if (t == "linear_attention") hp.recurrent.push_back(true);
      else if (t == "full_attention") hp.recurrent.push_back(false);
      else throw ConvertError("config.json: layer_types[" + std::to_string(i) + "] = " + t.dump() + " is unknown");
    }
  } else {
    const int64_t k = interval.value_or(4);
    for (int64_t i = 0; i < hp.n_layer; ++i) hp.recurrent.push_back((i + 1) % k != 0);
  }
  hp.full_attention_interval = 4;
  if (interval) {
    hp.full_attention_interval = *interval;
    return;
  }
  // transformers v5 drops full_attention_interval once it has expanded layer_types; recover the
  // period when the layout is the regular one, else keep llama.cpp's default of 4 (unused then,
  // since attention.recurrent_layers is written).
  for (int64_t k = 1; k <= hp.n_layer; ++k) {
    bool ok = true;
    for (int64_t i = 0; i < hp.n_layer && ok; ++i) ok = hp.recurrent[i] == ((i + 1) % k != 0);
    if (ok) {
      hp.full_attention_interval = k;
      return;
    }
  }
}

}  // namespace

void read_qwen_hybrid(const HfConfig& cfg, const Checkpoint& ckpt, HfModel& m) {
  model::HParams& hp = m.hp;
  read_qwen_moe(cfg, m);
  require_norm_topk_prob(cfg, true, true);
  if (cfg.flag("attention_bias", false)) {
    throw ConvertError("config.json: attention_bias = true is not supported by the GGUF architecture");
  }
  hp.norm_topk_prob = true;
  hp.n_ff_shexp = cfg.integer("shared_expert_intermediate_size");
  hp.ssm_conv_kernel = cfg.integer("linear_conv_kernel_dim");
  hp.ssm_head_k_dim = cfg.integer("linear_key_head_dim");
  hp.ssm_head_v_dim = cfg.integer("linear_value_head_dim");
  hp.ssm_n_k_heads = cfg.integer("linear_num_key_heads");
  hp.ssm_n_v_heads = cfg.integer("linear_num_value_heads");
  if (hp.ssm_head_k_dim != hp.ssm_head_v_dim) {
    throw ConvertError("config.json: linear_key_head_dim " + std::to_string(hp.ssm_head_k_dim) +
                       " != linear_value_head_dim " + std::to_string(hp.ssm_head_v_dim) +
                       ": the GGUF architecture has one ssm.state_size for both");
  }
  if (hp.ssm_n_k_heads == 0 || hp.ssm_n_v_heads % hp.ssm_n_k_heads != 0) {
    throw ConvertError("config.json: linear_num_value_heads " + std::to_string(hp.ssm_n_v_heads) +
                       " is not a multiple of linear_num_key_heads " + std::to_string(hp.ssm_n_k_heads));
  }
  const HfConfig rope = cfg.rope();
  double partial = 0.25;  // transformers' (and llama.cpp's) default for Qwen3-Next and Qwen3.5
  if (rope.has("partial_rotary_factor")) partial = rope.number("partial_rotary_factor");
  else if (cfg.has("partial_rotary_factor")) partial = cfg.number("partial_rotary_factor");
  hp.n_rot = static_cast<int64_t>(static_cast<double>(hp.head_dim) * partial);
  read_layer_types(cfg, hp);

  m.mtp_prefix = mtp_prefix(ckpt);
  hp.n_nextn = count_mtp_layers(ckpt, m.mtp_prefix);
  if (auto cfg_mtp = cfg.opt_integer({"mtp_num_hidden_layers"}); cfg_mtp && hp.n_nextn > 0 && *cfg_mtp != hp.n_nextn) {
    throw ConvertError("config.json: mtp_num_hidden_layers = " + std::to_string(*cfg_mtp) + " but the checkpoint has " +
                       std::to_string(hp.n_nextn) + " mtp layers");
  }
  if (auto cfg_mtp = cfg.opt_integer({"mtp_num_hidden_layers"}); cfg_mtp && *cfg_mtp > 0 && hp.n_nextn == 0) {
    m.notes.push_back("config.json: mtp_num_hidden_layers = " + std::to_string(*cfg_mtp) +
                      " but the checkpoint has no mtp.* tensors: written without nextn blocks (llama.cpp's --no-mtp)");
  }

  m.put_u32("expert_shared_feed_forward_length", hp.n_ff_shexp);
  if (hp.n_nextn > 0) m.put_u32("nextn_predict_layers", hp.n_nextn);
  m.put_u32("ssm.conv_kernel", hp.ssm_conv_kernel);
  m.put_u32("ssm.state_size", hp.ssm_head_k_dim);
  m.put_u32("ssm.group_count", hp.ssm_n_k_heads);
  m.put_u32("ssm.time_step_rank", hp.ssm_n_v_heads);
  m.put_u32("ssm.inner_size", hp.ssm_head_v_dim * hp.ssm_n_v_heads);
  std::vector<gguf::Value> rec;
  for (int64_t i = 0; i < hp.n_layer + hp.n_nextn; ++i) rec.push_back(gguf::Value::boolean(hp.is_recurrent(i)));
  m.put("attention.recurrent_layers", gguf::Value::array(gguf::ValueType::BOOL, std::move(rec)));
  m.put_u32("full_attention_interval", hp.full_attention_interval);
  m.put_u32("rope.dimension_count", hp.n_rot);
}

bool qwen_mtp_once(const Planner& p, const model::TensorSlot& t) {
  switch (t.role) {
    case model::TensorRole::NextnEhProj: case model::TensorRole::NextnEnorm: case model::TensorRole::NextnHnorm:
    case model::TensorRole::NextnEmbedTokens: case model::TensorRole::NextnSharedHeadHead:
    case model::TensorRole::NextnSharedHeadNorm:
      return t.layer > p.model().hp.n_layer;
    default: return false;
  }
}

ElemOp qwen_hybrid_elem_op(model::TensorRole r) {
  using model::TensorRole;
  switch (r) {
    case TensorRole::DnA: return ElemOp::NegExp;
    case TensorRole::AttnNorm: case TensorRole::FfnNorm: case TensorRole::AttnQNorm: case TensorRole::AttnKNorm:
    case TensorRole::OutputNorm: case TensorRole::NextnEnorm: case TensorRole::NextnHnorm:
    case TensorRole::NextnSharedHeadNorm:
      return ElemOp::PlusOne;
    default: return ElemOp::None;
  }
}

}  // namespace moraine::convert
