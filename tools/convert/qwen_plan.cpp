#include "tools/convert/qwen_plan.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>

#include "common/model/layer_tensors.h"

namespace moraine::convert {

using gguf::Value;
using gguf::ValueType;
using nlohmann::json;

int64_t PlannedTensor::n_rows() const {
  int64_t n = 0;
  for (const RowSpan& r : rows) n += r.n_rows;
  return n;
}

const std::vector<std::string>& supported_architectures() {
  static const std::vector<std::string> names = {"Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"};
  return names;
}

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream o;
  o << '[';
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << ']';
  return o.str();
}

// ---- config.json access: every miss or bad value names the key ----
const json* find_key(const json& cfg, const std::string& key) {
  auto it = cfg.find(key);
  return it == cfg.end() || it->is_null() ? nullptr : &*it;
}

int64_t get_int(const json& cfg, const std::string& key) {
  const json* v = find_key(cfg, key);
  if (!v) throw ConvertError("config.json: missing '" + key + "'");
  if (!v->is_number_integer() || v->get<int64_t>() < 0) {
    throw ConvertError("config.json: '" + key + "' must be a non-negative integer, not " + v->dump());
  }
  return v->get<int64_t>();
}

std::optional<int64_t> opt_int(const json& cfg, std::initializer_list<const char*> keys) {
  for (const char* k : keys) {
    if (find_key(cfg, k)) return get_int(cfg, k);
  }
  return std::nullopt;
}

double get_num(const json& cfg, const std::string& key) {
  const json* v = find_key(cfg, key);
  if (!v) throw ConvertError("config.json: missing '" + key + "'");
  if (!v->is_number()) throw ConvertError("config.json: '" + key + "' must be a number, not " + v->dump());
  return v->get<double>();
}

bool get_bool(const json& cfg, const std::string& key, bool dflt) {
  const json* v = find_key(cfg, key);
  if (!v) return dflt;
  if (!v->is_boolean()) throw ConvertError("config.json: '" + key + "' must be true or false, not " + v->dump());
  return v->get<bool>();
}

// rope settings live in "rope_parameters" (transformers v5), "rope_scaling" or at top level.
const json& rope_params(const json& cfg) {
  static const json empty = json::object();
  if (const json* r = find_key(cfg, "rope_parameters"); r && r->is_object()) return *r;
  if (const json* r = find_key(cfg, "rope_scaling"); r && r->is_object()) return *r;
  return empty;
}

struct QwenHParams {
  bool next = false;
  int64_t vocab = 0, hidden = 0, n_layer = 0, n_head = 0, n_kv = 0, head_dim = 0;
  std::optional<int64_t> n_ff, ctx, head_dim_cfg;
  double eps = 1e-6, rope_theta = 10000.0;
  int64_t n_expert = 0, n_used = 0, ff_exp = 0, ff_shexp = 0;
  bool tied = false;
  // qwen3next
  int64_t conv_k = 0, dk = 0, dv = 0, nk = 0, nv = 0, n_rot = 0, full_attn_interval = 4;
  std::vector<bool> recurrent;
};

QwenHParams read_hparams(const json& cfg, bool next) {
  QwenHParams h;
  h.next = next;
  h.vocab = get_int(cfg, "vocab_size");
  h.hidden = get_int(cfg, "hidden_size");
  h.n_layer = get_int(cfg, "num_hidden_layers");
  h.n_head = get_int(cfg, "num_attention_heads");
  h.n_kv = opt_int(cfg, {"num_key_value_heads"}).value_or(h.n_head);
  if (h.n_head == 0 || h.n_kv == 0 || h.n_head % h.n_kv != 0) {
    throw ConvertError("config.json: num_attention_heads " + std::to_string(h.n_head) +
                       " is not a multiple of num_key_value_heads " + std::to_string(h.n_kv));
  }
  h.head_dim_cfg = opt_int(cfg, {"head_dim"});
  h.head_dim = h.head_dim_cfg.value_or(h.hidden / h.n_head);
  h.n_ff = opt_int(cfg, {"intermediate_size"});
  h.ctx = opt_int(cfg, {"max_position_embeddings"});
  h.eps = get_num(cfg, "rms_norm_eps");
  h.tied = get_bool(cfg, "tie_word_embeddings", false);

  const json& rope = rope_params(cfg);
  if (const json* t = find_key(rope, "rope_type"); t && *t != "default") {
    throw ConvertError("config.json: rope type " + t->dump() + " is not supported (only default RoPE is)");
  }
  if (const json* t = find_key(rope, "type"); t && *t != "default") {
    throw ConvertError("config.json: rope_scaling type " + t->dump() + " is not supported (only default RoPE is)");
  }
  if (find_key(rope, "rope_theta")) h.rope_theta = get_num(rope, "rope_theta");
  else if (find_key(cfg, "rope_theta")) h.rope_theta = get_num(cfg, "rope_theta");
  else throw ConvertError("config.json: missing 'rope_theta' (at top level or in rope_parameters)");

  auto ne = opt_int(cfg, {"num_local_experts", "num_experts"});
  if (!ne || *ne == 0) throw ConvertError("config.json: missing 'num_experts' (this is a mixture-of-experts family)");
  h.n_expert = *ne;
  h.n_used = get_int(cfg, "num_experts_per_tok");
  if (h.n_used == 0 || h.n_used > h.n_expert) {
    throw ConvertError("config.json: num_experts_per_tok " + std::to_string(h.n_used) + " must be in [1, " +
                       std::to_string(h.n_expert) + "]");
  }
  h.ff_exp = get_int(cfg, "moe_intermediate_size");
  // llama.cpp's qwen3moe / qwen3next graphs always renormalise the top-k router weights.
  if (!get_bool(cfg, "norm_topk_prob", next)) {
    throw ConvertError("config.json: norm_topk_prob = false is not supported: the GGUF architecture always "
                       "renormalises the chosen experts' weights");
  }
  if (opt_int(cfg, {"decoder_sparse_step"}).value_or(1) != 1) {
    throw ConvertError("config.json: decoder_sparse_step != 1 (dense layers between MoE layers) is not supported");
  }
  if (const json* m = find_key(cfg, "mlp_only_layers"); m && !(m->is_array() && m->empty())) {
    throw ConvertError("config.json: mlp_only_layers " + m->dump() + " (dense layers) is not supported");
  }
  if (get_bool(cfg, "use_sliding_window", false)) {
    throw ConvertError("config.json: use_sliding_window = true is not supported");
  }
  if (get_bool(cfg, "attention_bias", false)) {
    throw ConvertError("config.json: attention_bias = true is not supported by the GGUF architecture");
  }
  if (!next) return h;

  h.ff_shexp = get_int(cfg, "shared_expert_intermediate_size");
  h.conv_k = get_int(cfg, "linear_conv_kernel_dim");
  h.dk = get_int(cfg, "linear_key_head_dim");
  h.dv = get_int(cfg, "linear_value_head_dim");
  h.nk = get_int(cfg, "linear_num_key_heads");
  h.nv = get_int(cfg, "linear_num_value_heads");
  if (h.dk != h.dv) {
    throw ConvertError("config.json: linear_key_head_dim " + std::to_string(h.dk) + " != linear_value_head_dim " +
                       std::to_string(h.dv) + ": the GGUF architecture has one ssm.state_size for both");
  }
  if (h.nk == 0 || h.nv % h.nk != 0) {
    throw ConvertError("config.json: linear_num_value_heads " + std::to_string(h.nv) +
                       " is not a multiple of linear_num_key_heads " + std::to_string(h.nk));
  }
  double partial = 0.25;  // transformers' default for Qwen3-Next
  if (find_key(rope, "partial_rotary_factor")) partial = get_num(rope, "partial_rotary_factor");
  else if (find_key(cfg, "partial_rotary_factor")) partial = get_num(cfg, "partial_rotary_factor");
  h.n_rot = static_cast<int64_t>(static_cast<double>(h.head_dim) * partial);

  std::optional<int64_t> interval = opt_int(cfg, {"full_attention_interval"});
  if (interval && *interval == 0) throw ConvertError("config.json: full_attention_interval must be > 0");
  if (const json* lt = find_key(cfg, "layer_types")) {
    if (!lt->is_array() || static_cast<int64_t>(lt->size()) != h.n_layer) {
      throw ConvertError("config.json: layer_types must list num_hidden_layers (" + std::to_string(h.n_layer) +
                         ") entries");
    }
    for (size_t i = 0; i < lt->size(); ++i) {
      const json& t = (*lt)[i];
      if (t == "linear_attention") h.recurrent.push_back(true);
      else if (t == "full_attention") h.recurrent.push_back(false);
      else throw ConvertError("config.json: layer_types[" + std::to_string(i) + "] = " + t.dump() + " is unknown");
    }
  } else {
    const int64_t k = interval.value_or(4);
    for (int64_t i = 0; i < h.n_layer; ++i) h.recurrent.push_back((i + 1) % k != 0);
  }
  if (interval) {
    h.full_attn_interval = *interval;
  } else {
    // transformers v5 drops full_attention_interval once it has expanded layer_types; recover the
    // period when the layout is the regular one, else keep llama.cpp's default of 4 (unused then,
    // since attention.recurrent_layers is written).
    for (int64_t k = 1; k <= h.n_layer; ++k) {
      bool ok = true;
      for (int64_t i = 0; i < h.n_layer && ok; ++i) ok = h.recurrent[i] == ((i + 1) % k != 0);
      if (ok) {
        h.full_attn_interval = k;
        break;
      }
    }
  }
  return h;
}

// Hands out checkpoint tensors by exact name, checking shapes, and remembers which were used.
class TensorSource {
 public:
  explicit TensorSource(const Checkpoint& c) : ckpt_(c) {}

  const StTensor& take(const std::string& name, const std::vector<int64_t>& shape) {
    const StTensor* t = ckpt_.find(name);
    if (!t) throw ConvertError("checkpoint lacks tensor '" + name + "' (expected shape " + shape_str(shape) + ")");
    if (t->shape != shape) {
      throw ConvertError("tensor '" + name + "' has shape " + shape_str(t->shape) + " but config.json implies " +
                         shape_str(shape));
    }
    used_.insert(name);
    return *t;
  }
  bool has(const std::string& name) const { return ckpt_.find(name) != nullptr; }
  void ignore(const std::string& name) { used_.insert(name); }

  // The first checkpoint tensor nothing claimed: a checkpoint we do not fully understand is refused.
  void require_all_used() const {
    for (const StTensor& t : ckpt_.tensors()) {
      if (!used_.count(t.name)) {
        throw ConvertError("cannot map tensor '" + t.name + "' (shape " + shape_str(t.shape) + ", in " + t.file +
                           ") to a GGUF tensor");
      }
    }
  }

 private:
  const Checkpoint& ckpt_;
  std::set<std::string> used_;
};

class QwenPlanner {
 public:
  QwenPlanner(const QwenHParams& h, const model::ArchDesc& desc, const Checkpoint& c, ConvertPlan& plan)
      : h_(h), desc_(desc), ckpt_(c), src_(c), plan_(plan) {
    if (h_.next) {
      mtp_ = mtp_prefix();
      n_mtp_ = count_mtp_layers(mtp_);
    }
    hp_ = model_hparams();
  }

  int64_t mtp_layers() const { return n_mtp_; }
  void run();

 private:
  // One output tensor made of whole source tensors, in order.
  void whole(const std::string& gguf_name, std::vector<int64_t> gguf_shape, const std::string& hf_name,
             std::vector<int64_t> hf_shape, ElemOp op = ElemOp::None) {
    const StTensor& t = src_.take(hf_name, hf_shape);
    add(gguf_name, std::move(gguf_shape), {{&t, 0, t.n_rows()}}, op);
  }
  void add(const std::string& name, std::vector<int64_t> shape, std::vector<RowSpan> rows, ElemOp op) {
    PlannedTensor p;
    p.name = name;
    p.shape = std::move(shape);
    p.rows = std::move(rows);
    p.op = op;
    const bool is_weight = name.ends_with(".weight");
    const auto ends = [&](const char* s) { return name.ends_with(s); };
    // The tensors llama.cpp's converter keeps in F32 whatever the output type.
    p.keep_f32 = p.shape.size() <= 1 || ends("_norm.weight") || ends(".ffn_gate_inp.weight") ||
                 ends(".ffn_gate_inp_shexp.weight") || ends(".ssm_conv1d.weight") || !is_weight;
    plan_.tensors.push_back(std::move(p));
  }
  ElemOp norm_op() const { return h_.next ? ElemOp::PlusOne : ElemOp::None; }
  // The description's names: GGUF for layer blk (blk < 0: global), HF after prefix.
  std::string gguf(model::TensorRole r, int64_t blk) const { return desc_.gguf_name(r, blk); }
  std::string hf_name(model::TensorRole r, const std::string& prefix) const;
  model::HParams model_hparams() const;

  void layer(const std::string& hf, int64_t blk);
  void experts(const std::string& hf, int64_t blk);
  void linear_attention(const std::string& hf, int64_t blk);
  std::string mtp_prefix() const;
  int64_t count_mtp_layers(const std::string& prefix) const;

  const QwenHParams& h_;
  const model::ArchDesc& desc_;
  model::HParams hp_;   // what the written file's metadata will say: the recipes come from it
  const Checkpoint& ckpt_;
  TensorSource src_;
  ConvertPlan& plan_;
  std::string mtp_;
  int64_t n_mtp_ = 0;
};

void QwenPlanner::experts(const std::string& hf, int64_t blk) {
  using model::TensorRole;
  const int64_t E = h_.n_expert, H = h_.hidden, F = h_.ff_exp;
  std::vector<RowSpan> gate, up, down;
  const std::string fused = hf + "mlp.experts.gate_up_proj";
  if (src_.has(fused) || src_.has(fused + ".weight")) {
    // transformers v5 layout: gate_up_proj [E, 2F, H] (gate rows first), down_proj [E, H, F].
    const std::string sfx = src_.has(fused) ? "" : ".weight";
    const StTensor& gu = src_.take(fused + sfx, {E, 2 * F, H});
    const StTensor& dn = src_.take(hf + "mlp.experts.down_proj" + sfx, {E, H, F});
    for (int64_t e = 0; e < E; ++e) {
      gate.push_back({&gu, e * 2 * F, F});
      up.push_back({&gu, e * 2 * F + F, F});
    }
    down.push_back({&dn, 0, E * H});
  } else {
    // Hub layout: one module per expert (the table's "{E}" names), stacked here into [E, ...].
    const auto per_expert = [&](TensorRole r, int64_t e) {
      std::string n = hf_name(r, hf);
      n.replace(n.find("{E}"), 3, std::to_string(e));
      return n;
    };
    for (int64_t e = 0; e < E; ++e) {
      const StTensor& g = src_.take(per_expert(TensorRole::GateExps, e), {F, H});
      const StTensor& u = src_.take(per_expert(TensorRole::UpExps, e), {F, H});
      const StTensor& d = src_.take(per_expert(TensorRole::DownExps, e), {H, F});
      gate.push_back({&g, 0, F});
      up.push_back({&u, 0, F});
      down.push_back({&d, 0, H});
    }
  }
  add(gguf(TensorRole::GateExps, blk), {H, F, E}, std::move(gate), ElemOp::None);
  add(gguf(TensorRole::UpExps, blk), {H, F, E}, std::move(up), ElemOp::None);
  add(gguf(TensorRole::DownExps, blk), {F, H, E}, std::move(down), ElemOp::None);
}

void QwenPlanner::linear_attention(const std::string& hf, int64_t blk) {
  using model::TensorRole;
  const int64_t H = h_.hidden, nk = h_.nk, nv = h_.nv, dk = h_.dk, dv = h_.dv, r = nv / nk;
  const int64_t key_dim = nk * dk, value_dim = nv * dv, conv_dim = 2 * key_dim + value_dim;
  // in_proj_qkvz rows are grouped per key head g: [q_g (dk), k_g (dk), v_g (r*dv), z_g (r*dv)].
  // GGUF wants all q heads, then all k, then all v (the conv1d channel order) in attn_qkv, and
  // the z rows in attn_gate.
  const int64_t group = 2 * dk + 2 * r * dv;
  const StTensor& qkvz = src_.take(hf_name(TensorRole::DnQkvzLegacy, hf), {nk * group, H});
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
  add(gguf(TensorRole::DnQkv, blk), {H, conv_dim}, std::move(qkv), ElemOp::None);
  add(gguf(TensorRole::DnGate, blk), {H, value_dim}, std::move(z), ElemOp::None);
}

std::string QwenPlanner::hf_name(model::TensorRole r, const std::string& prefix) const {
  const model::TensorName* t = desc_.find(r);
  if (t == nullptr || t->hf[0] == '\0') {
    throw std::logic_error(std::string(desc_.name) + ": the tensor table has no Hugging Face name for " +
                           model::tensor_role_name(r));
  }
  return prefix + t->hf;
}

// The hyper-parameters the written metadata states, so the layers' recipes (which tensors each
// layer has) come from the same description the loader reads.
model::HParams QwenPlanner::model_hparams() const {
  model::HParams hp;
  hp.desc = &desc_;
  hp.n_layer = h_.n_layer;
  hp.n_nextn = n_mtp_;
  hp.n_embd = h_.hidden;
  hp.n_vocab = h_.vocab;
  hp.n_head = h_.n_head;
  hp.n_head_kv = h_.n_kv;
  hp.head_dim = h_.head_dim;
  hp.n_rot = h_.next ? h_.n_rot : h_.head_dim;
  hp.rope_freq_base = h_.rope_theta;
  hp.rms_eps = h_.eps;
  hp.n_expert = h_.n_expert;
  hp.n_expert_used = h_.n_used;
  hp.n_ff_exp = h_.ff_exp;
  hp.n_ff_shexp = h_.ff_shexp;
  hp.ssm_conv_kernel = h_.conv_k;
  hp.ssm_head_k_dim = h_.dk;
  hp.ssm_head_v_dim = h_.dv;
  hp.ssm_n_k_heads = h_.nk;
  hp.ssm_n_v_heads = h_.nv;
  hp.full_attention_interval = h_.full_attn_interval;
  hp.recurrent = h_.next ? h_.recurrent : std::vector<bool>(static_cast<size_t>(h_.n_layer), false);
  for (int64_t il = 0; il < hp.n_layer + hp.n_nextn; ++il) hp.recipes.push_back(desc_.layer_recipe(hp, il));
  return hp;
}

// One block: the description's tensor list for it, each from its HF tensor (the fused and
// per-expert ones through experts() / linear_attention()). The nextn projections are run()'s.
void QwenPlanner::layer(const std::string& hf, int64_t blk) {
  using model::TensorRole;
  const auto reversed = [](std::vector<int64_t> v) { return std::vector<int64_t>(v.rbegin(), v.rend()); };
  for (const model::TensorSlot& t : model::layer_tensors(hp_, blk)) {
    switch (t.role) {
      case TensorRole::NextnEhProj: case TensorRole::NextnEnorm: case TensorRole::NextnHnorm:
      case TensorRole::NextnEmbedTokens: case TensorRole::NextnSharedHeadHead: case TensorRole::NextnSharedHeadNorm:
        break;
      case TensorRole::DnQkv: linear_attention(hf, blk); break;
      case TensorRole::DnGate: break;   // written with DnQkv
      case TensorRole::GateExps: experts(hf, blk); break;
      case TensorRole::UpExps: case TensorRole::DownExps: break;   // written with GateExps
      case TensorRole::DnConv:   // conv1d [C, 1, K] -> one row of K taps per channel
        whole(t.name, t.shape, hf_name(t.role, hf), {t.shape[1], 1, t.shape[0]});
        break;
      case TensorRole::SharedRouter:   // llama.cpp's converter writes the 1 x n_embd gate as [n_embd, 1]
        whole(t.name, {t.shape[0], 1}, hf_name(t.role, hf), {1, t.shape[0]});
        break;
      case TensorRole::DnA: whole(t.name, t.shape, hf_name(t.role, hf), t.shape, ElemOp::NegExp); break;
      // The gated norm multiplies by its weight directly (no 1 + w), so no offset there.
      case TensorRole::AttnNorm: case TensorRole::FfnNorm: case TensorRole::AttnQNorm: case TensorRole::AttnKNorm:
        whole(t.name, t.shape, hf_name(t.role, hf), t.shape, norm_op());
        break;
      default: whole(t.name, t.shape, hf_name(t.role, hf), reversed(t.shape)); break;
    }
  }
}

// Qwen3-Next checkpoints carry a multi-token-prediction block under "mtp." (or "model.mtp.");
// it becomes extra blocks after the trunk, as llama.cpp's nextn layers.
std::string QwenPlanner::mtp_prefix() const {
  for (const StTensor& t : ckpt_.tensors()) {
    if (t.name.rfind("model.mtp.", 0) == 0) return "model.mtp.";
    if (t.name.rfind("mtp.", 0) == 0) return "mtp.";
  }
  return "";
}

int64_t QwenPlanner::count_mtp_layers(const std::string& prefix) const {
  if (prefix.empty()) return 0;
  const std::regex re("^" + std::regex_replace(prefix, std::regex("\\."), "\\.") + "layers\\.([0-9]+)\\.");
  int64_t n = 0;
  for (const StTensor& t : ckpt_.tensors()) {
    std::smatch m;
    if (std::regex_search(t.name, m, re)) n = std::max<int64_t>(n, std::stoll(m[1].str()) + 1);
  }
  return n;
}

void QwenPlanner::run() {
  const int64_t H = h_.hidden, V = h_.vocab;
  using model::TensorRole;
  whole(gguf(TensorRole::TokEmbd, -1), {H, V}, hf_name(TensorRole::TokEmbd, ""), {V, H});
  for (int64_t il = 0; il < h_.n_layer; ++il) layer("model.layers." + std::to_string(il) + ".", il);
  if (h_.next && n_mtp_ > 0) {
    for (int64_t i = 0; i < n_mtp_; ++i) layer(mtp_ + "layers." + std::to_string(i) + ".", h_.n_layer + i);
    // The MTP projections, once, on the first nextn block; HF names are under the MTP prefix.
    const auto mtp = [&](TensorRole r) {
      std::string n = hf_name(r, "");
      return n.replace(n.find("{M}"), 3, mtp_);
    };
    const int64_t b = h_.n_layer;
    whole(gguf(TensorRole::NextnEhProj, b), {2 * H, H}, mtp(TensorRole::NextnEhProj), {H, 2 * H});
    whole(gguf(TensorRole::NextnEnorm, b), {H}, mtp(TensorRole::NextnEnorm), {H}, ElemOp::PlusOne);
    whole(gguf(TensorRole::NextnHnorm, b), {H}, mtp(TensorRole::NextnHnorm), {H}, ElemOp::PlusOne);
    whole(gguf(TensorRole::NextnSharedHeadNorm, b), {H}, mtp(TensorRole::NextnSharedHeadNorm), {H}, ElemOp::PlusOne);
  }
  whole(gguf(TensorRole::OutputNorm, -1), {H}, hf_name(TensorRole::OutputNorm, ""), {H}, norm_op());
  if (src_.has(hf_name(TensorRole::Output, "")) || !h_.tied) {
    whole(gguf(TensorRole::Output, -1), {H, V}, hf_name(TensorRole::Output, ""), {V, H});
  }
  // Precomputed rotary tables are derived data, not weights (llama.cpp drops them too).
  for (const StTensor& t : ckpt_.tensors()) {
    if (t.name.ends_with(".rotary_emb.inv_freq")) src_.ignore(t.name);
  }
  src_.require_all_used();
}

void put(ConvertPlan& plan, const std::string& key, Value v) { plan.metadata.emplace_back(key, std::move(v)); }

}  // namespace

ConvertPlan plan_qwen(const json& config, const Checkpoint& ckpt) {
  std::string hf_arch;
  if (const json* a = find_key(config, "architectures"); a && a->is_array() && !a->empty() && (*a)[0].is_string()) {
    hf_arch = (*a)[0].get<std::string>();
  } else if (const json* mt = find_key(config, "model_type"); mt && mt->is_string()) {
    if (*mt == "qwen3_moe") hf_arch = "Qwen3MoeForCausalLM";
    else if (*mt == "qwen3_next") hf_arch = "Qwen3NextForCausalLM";
    else hf_arch = "model_type " + mt->get<std::string>();
  }
  const auto& known = supported_architectures();
  if (std::find(known.begin(), known.end(), hf_arch) == known.end()) {
    std::string list;
    for (const std::string& k : known) list += (list.empty() ? "" : ", ") + k;
    throw ConvertError("config.json: architecture '" + (hf_arch.empty() ? std::string("(none given)") : hf_arch) +
                       "' is not supported (moraine-convert knows " + list + ")");
  }
  const bool next = hf_arch == "Qwen3NextForCausalLM";
  const QwenHParams h = read_hparams(config, next);

  const model::ArchDesc* desc = model::find_arch_by_hf(hf_arch);
  if (desc == nullptr) throw std::logic_error("moraine-convert: no architecture description for " + hf_arch);
  ConvertPlan plan;
  plan.arch = desc->name;
  QwenPlanner planner(h, *desc, ckpt, plan);
  const int64_t n_mtp = planner.mtp_layers();
  if (next) {
    if (auto cfg_mtp = opt_int(config, {"mtp_num_hidden_layers"}); cfg_mtp && n_mtp > 0 && *cfg_mtp != n_mtp) {
      throw ConvertError("config.json: mtp_num_hidden_layers = " + std::to_string(*cfg_mtp) + " but the checkpoint has " +
                         std::to_string(n_mtp) + " mtp layers");
    }
  }
  planner.run();

  // Architecture keys, in the order llama.cpp's converter writes them.
  const std::string a = plan.arch + ".";
  const auto u32 = [](int64_t x) { return Value::u32(static_cast<uint32_t>(x)); };
  put(plan, a + "block_count", u32(h.n_layer + n_mtp));
  if (h.ctx) put(plan, a + "context_length", u32(*h.ctx));
  put(plan, a + "embedding_length", u32(h.hidden));
  if (h.n_ff) put(plan, a + "feed_forward_length", u32(*h.n_ff));
  put(plan, a + "attention.head_count", u32(h.n_head));
  put(plan, a + "attention.head_count_kv", u32(h.n_kv));
  put(plan, a + "rope.freq_base", Value::f32(static_cast<float>(h.rope_theta)));
  put(plan, a + "attention.layer_norm_rms_epsilon", Value::f32(static_cast<float>(h.eps)));
  put(plan, a + "expert_count", u32(h.n_expert));
  put(plan, a + "expert_used_count", u32(h.n_used));
  if (h.head_dim_cfg) {
    put(plan, a + "attention.key_length", u32(*h.head_dim_cfg));
    put(plan, a + "attention.value_length", u32(*h.head_dim_cfg));
  }
  put(plan, a + "expert_feed_forward_length", u32(h.ff_exp));
  if (next) {
    put(plan, a + "expert_shared_feed_forward_length", u32(h.ff_shexp));
    if (n_mtp > 0) put(plan, a + "nextn_predict_layers", u32(n_mtp));
    put(plan, a + "ssm.conv_kernel", u32(h.conv_k));
    put(plan, a + "ssm.state_size", u32(h.dk));
    put(plan, a + "ssm.group_count", u32(h.nk));
    put(plan, a + "ssm.time_step_rank", u32(h.nv));
    put(plan, a + "ssm.inner_size", u32(h.dv * h.nv));
    std::vector<Value> rec;
    for (int64_t i = 0; i < h.n_layer + n_mtp; ++i) rec.push_back(Value::boolean(i < h.n_layer && h.recurrent[i]));
    put(plan, a + "attention.recurrent_layers", Value::array(ValueType::BOOL, std::move(rec)));
    put(plan, a + "full_attention_interval", u32(h.full_attn_interval));
    put(plan, a + "rope.dimension_count", u32(h.n_rot));
  }
  return plan;
}

}  // namespace moraine::convert
