// Qwen3NextForCausalLM -> qwen3next: DeltaNet and gated-attention layers (layer_types or
// full_attention_interval), RMSNorm weights stored as 1 + w, A = -exp(A_log), in_proj_qkvz split
// and regrouped, conv1d squeezed, and the multi-token-prediction block (mtp.*) as nextn blocks.
#include <regex>

#include "tools/convert/qwen_config.h"

namespace moraine::convert {

using model::TensorRole;
using nlohmann::json;

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

void read_config(const HfConfig& cfg, const Checkpoint& ckpt, HfModel& m) {
  model::HParams& hp = m.hp;
  require_default_rope(cfg);
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
  double partial = 0.25;  // transformers' default for Qwen3-Next
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

// in_proj_qkvz rows are grouped per key head g: [q_g (dk), k_g (dk), v_g (r*dv), z_g (r*dv)].
// GGUF wants all q heads, then all k, then all v (the conv1d channel order) in attn_qkv, and
// the z rows in attn_gate.
void linear_attention(Planner& p, const model::TensorSlot& t, const std::string& hf) {
  const model::HParams& hp = p.model().hp;
  const int64_t H = hp.n_embd, nk = hp.ssm_n_k_heads, nv = hp.ssm_n_v_heads, dk = hp.ssm_head_k_dim;
  const int64_t dv = hp.ssm_head_v_dim, r = nv / nk, group = 2 * dk + 2 * r * dv;
  const StTensor& qkvz = p.take(p.hf_name(TensorRole::DnQkvzLegacy, hf), {nk * group, H});
  std::vector<RowSpan> q, k, v, z;
  for (int64_t g = 0; g < nk; ++g) {
    const int64_t base = g * group;
    q.push_back({&qkvz, base, dk});
    k.push_back({&qkvz, base + dk, dk});
    v.push_back({&qkvz, base + 2 * dk, r * dv});
    z.push_back({&qkvz, base + 2 * dk + r * dv, r * dv});
  }
  std::vector<RowSpan> qkv = q;
  qkv.insert(qkv.end(), k.begin(), k.end());
  qkv.insert(qkv.end(), v.begin(), v.end());
  p.add(t.name, {H, hp.ssm_conv_dim()}, std::move(qkv), ElemOp::None);
  p.add(p.desc().gguf_name(TensorRole::DnGate, t.layer), {H, nv * dv}, std::move(z), ElemOp::None);
}

bool map_tensor(Planner& p, const model::TensorSlot& t, const std::string& hf) {
  switch (t.role) {
    case TensorRole::DnQkv: linear_attention(p, t, hf); return true;
    case TensorRole::DnGate: return true;   // written with DnQkv
    case TensorRole::DnConv:   // conv1d [C, 1, K] -> one row of K taps per channel
      p.whole(t.name, t.shape, p.hf_name(t.role, hf), {t.shape[1], 1, t.shape[0]});
      return true;
    // The MTP projections are the checkpoint's once (mtp.fc, ...): on the first nextn block.
    case TensorRole::NextnEhProj: case TensorRole::NextnEnorm: case TensorRole::NextnHnorm:
    case TensorRole::NextnEmbedTokens: case TensorRole::NextnSharedHeadHead: case TensorRole::NextnSharedHeadNorm:
      return t.layer > p.model().hp.n_layer;
    default: return false;
  }
}

ElemOp elem_op(TensorRole r) {
  switch (r) {
    case TensorRole::DnA: return ElemOp::NegExp;
    // RMSNorm weights are offsets from one; the gated norm (ssm_norm) multiplies by w itself.
    case TensorRole::AttnNorm: case TensorRole::FfnNorm: case TensorRole::AttnQNorm: case TensorRole::AttnKNorm:
    case TensorRole::OutputNorm: case TensorRole::NextnEnorm: case TensorRole::NextnHnorm:
    case TensorRole::NextnSharedHeadNorm:
      return ElemOp::PlusOne;
    default: return ElemOp::None;
  }
}

}  // namespace

const ArchConverter& converter_qwen3next() {
  static const ArchConverter c{"qwen3next", {"qwen3_next"}, read_config, map_tensor, elem_op};
  return c;
}

}  // namespace moraine::convert
