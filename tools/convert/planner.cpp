// The architecture-independent half of the converter: config.json's common settings, the
// registry of converter parts, and the planner that walks the description's tensor slots.
#include <algorithm>
#include <sstream>

#include "tools/convert/arch_converter.h"

namespace moraine::convert {

using gguf::Value;
using model::TensorRole;
using nlohmann::json;

#define MORAINE_CONVERTER(stem) const ArchConverter& converter_##stem();
#include "converter_list.inc"
#undef MORAINE_CONVERTER

const std::vector<const ArchConverter*>& all_converters() {
  static const std::vector<const ArchConverter*> v = {
#define MORAINE_CONVERTER(stem) &converter_##stem(),
#include "converter_list.inc"
#undef MORAINE_CONVERTER
  };
  return v;
}

const ArchConverter* find_converter(std::string_view arch) {
  for (const ArchConverter* c : all_converters())
    if (arch == c->arch) return c;
  return nullptr;
}

int64_t PlannedTensor::n_rows() const {
  int64_t n = 0;
  if (raw_fill) {
    n = 1;
    for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
    return n;
  }
  for (const RowSpan& r : rows) n += r.n_rows;
  return n;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream o;
  o << '[';
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << ']';
  return o.str();
}

// ---- Planner ----

Planner::Planner(const ArchConverter& conv, const HfModel& m, const Checkpoint& c, ConvertPlan& plan)
    : conv_(conv), m_(m), ckpt_(c), plan_(plan) {}

const StTensor& Planner::take(const std::string& name, const std::vector<int64_t>& shape, bool u8) {
  const StTensor* t = ckpt_.find(name);
  if (!t) throw ConvertError("checkpoint lacks tensor '" + name + "' (expected shape " + shape_str(shape) + ")");
  if (t->is_float() == u8) {
    throw ConvertError("tensor '" + name + "' (in " + t->file + ") is " + (u8 ? "a float tensor" : "U8") + " where " +
                       (u8 ? "U8 blocks" : "floats") + " are expected");
  }
  if (t->shape != shape) {
    throw ConvertError("tensor '" + name + "' has shape " + shape_str(t->shape) + " but config.json implies " +
                       shape_str(shape));
  }
  used_.insert(name);
  return *t;
}

void Planner::ignore(const std::string& name) { used_.insert(name); }

void Planner::add(const std::string& name, std::vector<int64_t> shape, std::vector<RowSpan> rows, ElemOp op,
                  std::vector<int64_t> col_perm) {
  PlannedTensor p;
  p.name = name;
  p.shape = std::move(shape);
  p.rows = std::move(rows);
  p.op = op;
  p.col_perm = std::move(col_perm);
  const bool is_weight = name.ends_with(".weight");
  const auto ends = [&](const char* s) { return name.ends_with(s); };
  // The tensors llama.cpp's converter keeps in F32 whatever the output type.
  p.keep_f32 = p.shape.size() <= 1 || ends("_norm.weight") || ends(".ffn_gate_inp.weight") ||
               ends(".ffn_gate_inp_shexp.weight") || ends(".ssm_conv1d.weight") || !is_weight;
  plan_.tensors.push_back(std::move(p));
}

void Planner::add_raw(const std::string& name, std::vector<int64_t> shape, TensorType type,
                      std::function<void(uint8_t*)> fill) {
  PlannedTensor p;
  p.name = name;
  p.shape = std::move(shape);
  p.raw_type = type;
  p.raw_fill = std::move(fill);
  plan_.tensors.push_back(std::move(p));
}

void Planner::whole(const std::string& gguf_name, std::vector<int64_t> gguf_shape, const std::string& hf_name,
                    std::vector<int64_t> hf_shape, ElemOp op) {
  const StTensor& t = take(hf_name, hf_shape);
  add(gguf_name, std::move(gguf_shape), {{&t, 0, t.n_rows()}}, op);
}

std::string Planner::hf_name(TensorRole r, const std::string& prefix) const {
  const model::TensorName* t = desc().find(r);
  if (t == nullptr || t->hf[0] == '\0') {
    throw std::logic_error(std::string(desc().name) + ": the tensor table has no Hugging Face name for " +
                           model::tensor_role_name(r));
  }
  // "{M}..." names hang off the MTP prefix itself, not off a block's.
  const std::string_view hf = t->hf;
  if (hf.starts_with("{M}")) return m_.mtp_prefix + std::string(hf.substr(3));
  return prefix + t->hf;
}

// The routed experts, stacked into [E, ...] from the table's per-expert ("{E}") names, or split
// from transformers v5's fused layout: gate_up_proj [E, 2F, H] (gate rows first), down_proj [E, H, F].
void Planner::experts(const model::TensorSlot& gate_slot, const std::string& hf) {
  const int64_t E = m_.hp.n_expert, H = m_.hp.n_embd, F = gate_slot.shape.at(1), blk = gate_slot.layer;
  std::vector<RowSpan> gate, up, down;
  const std::string fused = hf + "mlp.experts.gate_up_proj";
  if (has(fused) || has(fused + ".weight")) {
    const std::string sfx = has(fused) ? "" : ".weight";
    const StTensor& gu = take(fused + sfx, {E, 2 * F, H});
    const StTensor& dn = take(hf + "mlp.experts.down_proj" + sfx, {E, H, F});
    for (int64_t e = 0; e < E; ++e) {
      gate.push_back({&gu, e * 2 * F, F});
      up.push_back({&gu, e * 2 * F + F, F});
    }
    down.push_back({&dn, 0, E * H});
  } else {
    const auto per_expert = [&](TensorRole r, int64_t e) {
      std::string n = hf_name(r, hf);
      n.replace(n.find("{E}"), 3, std::to_string(e));
      return n;
    };
    for (int64_t e = 0; e < E; ++e) {
      const StTensor& g = take(per_expert(TensorRole::GateExps, e), {F, H});
      const StTensor& u = take(per_expert(TensorRole::UpExps, e), {F, H});
      const StTensor& d = take(per_expert(TensorRole::DownExps, e), {H, F});
      gate.push_back({&g, 0, F});
      up.push_back({&u, 0, F});
      down.push_back({&d, 0, H});
    }
  }
  add(desc().gguf_name(TensorRole::GateExps, blk), {H, F, E}, std::move(gate), ElemOp::None);
  add(desc().gguf_name(TensorRole::UpExps, blk), {H, F, E}, std::move(up), ElemOp::None);
  add(desc().gguf_name(TensorRole::DownExps, blk), {F, H, E}, std::move(down), ElemOp::None);
}

// One slot of the description: the architecture's hook, else the table's HF name with the shape
// reversed (ggml order), stacked per expert where the name has "{E}".
void Planner::slot(const model::TensorSlot& t, const std::string& hf) {
  if (conv_.map_tensor && conv_.map_tensor(*this, t, hf)) return;
  const model::TensorName* row = desc().find(t.role);
  const bool named = row != nullptr && row->hf[0] != '\0';
  switch (t.role) {
    case TensorRole::GateExps: experts(t, hf); return;
    case TensorRole::UpExps: case TensorRole::DownExps: return;   // written with GateExps
    case TensorRole::SharedRouter:   // llama.cpp's converter writes the 1 x n_embd gate as [n_embd, 1]
      whole(t.name, {t.shape[0], 1}, hf_name(t.role, hf), {1, t.shape[0]});
      return;
    case TensorRole::Output:   // absent: tied to token_embd
      if (has(hf_name(t.role, hf)) || !m_.tied) break;
      return;
    default:
      // An optional slot the table cannot source (nextn's own embedding and head) stays out.
      if (t.optional && (!named || !has(hf_name(t.role, hf)))) return;
      break;
  }
  whole(t.name, t.shape, hf_name(t.role, hf), std::vector<int64_t>(t.shape.rbegin(), t.shape.rend()), op(t.role));
}

void Planner::run() {
  const model::HParams& hp = m_.hp;
  for (const model::TensorSlot& t : model::model_tensors(hp)) {
    std::string prefix;
    if (t.layer >= hp.n_layer) prefix = m_.mtp_prefix + "layers." + std::to_string(t.layer - hp.n_layer + m_.mtp_first) + ".";
    else if (t.layer >= 0) prefix = "model.layers." + std::to_string(t.layer) + ".";
    slot(t, prefix);
  }
  // Precomputed rotary tables are derived data, not weights (llama.cpp drops them too).
  for (const StTensor& t : ckpt_.tensors()) {
    if (t.name.ends_with(".rotary_emb.inv_freq")) ignore(t.name);
    for (const std::string& d : m_.drop_prefixes)
      if (t.name.starts_with(d)) ignore(t.name);
  }
  // The first checkpoint tensor nothing claimed: a checkpoint we do not fully understand is refused.
  for (const StTensor& t : ckpt_.tensors()) {
    if (!used_.count(t.name)) {
      throw ConvertError("cannot map tensor '" + t.name + "' (shape " + shape_str(t.shape) + ", in " + t.file +
                         ") to a GGUF tensor");
    }
  }
}

// ---- config.json ----

namespace {

// The HF architecture name: config.json "architectures", else its model_type.
const ArchConverter* resolve(const HfConfig& cfg, std::string& hf_arch) {
  const json* a = cfg.find("architectures");
  if (a && a->is_array() && !a->empty() && (*a)[0].is_string()) {
    hf_arch = (*a)[0].get<std::string>();
    const model::ArchDesc* d = model::find_arch_by_hf(hf_arch);
    return d ? find_converter(d->name) : nullptr;
  }
  if (std::optional<std::string> mt = cfg.opt_text("model_type")) {
    hf_arch = "model_type " + *mt;
    for (const ArchConverter* c : all_converters()) {
      if (std::find(c->model_types.begin(), c->model_types.end(), *mt) != c->model_types.end()) {
        hf_arch = model::find_arch(c->arch)->hf_architectures.at(0);
        return c;
      }
    }
  }
  return nullptr;
}

// The settings every architecture states the same way.
void read_common(const HfConfig& cfg, HfModel& m) {
  model::HParams& hp = m.hp;
  hp.n_vocab = cfg.integer("vocab_size");
  hp.n_embd = cfg.integer("hidden_size");
  hp.n_layer = cfg.integer("num_hidden_layers");
  hp.n_head = cfg.integer("num_attention_heads");
  hp.n_head_kv = cfg.opt_integer({"num_key_value_heads"}).value_or(hp.n_head);
  if (hp.n_head == 0 || hp.n_head_kv == 0 || hp.n_head % hp.n_head_kv != 0) {
    throw ConvertError("config.json: num_attention_heads " + std::to_string(hp.n_head) +
                       " is not a multiple of num_key_value_heads " + std::to_string(hp.n_head_kv));
  }
  m.head_dim_cfg = cfg.opt_integer({"head_dim"});
  hp.head_dim = m.head_dim_cfg.value_or(hp.n_embd / hp.n_head);
  hp.n_rot = hp.head_dim;
  m.n_ff = cfg.opt_integer({"intermediate_size"});
  hp.n_ff = m.n_ff.value_or(0);
  m.ctx = cfg.opt_integer({"max_position_embeddings"});
  hp.rms_eps = cfg.number("rms_norm_eps");
  m.tied = cfg.flag("tie_word_embeddings", false);
  hp.rope_freq_base = cfg.rope_theta();

  auto ne = cfg.opt_integer({"num_local_experts", "num_experts", "n_routed_experts"});
  if (!ne || *ne == 0) throw ConvertError("config.json: missing 'num_experts' (this is a mixture-of-experts family)");
  hp.n_expert = *ne;
  hp.n_expert_used = cfg.integer("num_experts_per_tok");
  if (hp.n_expert_used == 0 || hp.n_expert_used > hp.n_expert) {
    throw ConvertError("config.json: num_experts_per_tok " + std::to_string(hp.n_expert_used) + " must be in [1, " +
                       std::to_string(hp.n_expert) + "]");
  }
  hp.recurrent.assign(static_cast<size_t>(hp.n_layer), false);
}

model::KeyList::value_type key_u32(const std::string& k, int64_t v) {
  return {k, Value::u32(static_cast<uint32_t>(v))};
}

// The common keys, in the order llama.cpp's converter writes them.
void write_common(const HfModel& m, const std::string& a, model::KeyList& out) {
  const model::HParams& hp = m.hp;
  const auto key_f32 = [](const std::string& k, double v) { return model::KeyList::value_type{k, Value::f32(static_cast<float>(v))}; };
  out.push_back(key_u32(a + "block_count", hp.n_layer + hp.n_nextn));
  if (m.ctx) out.push_back(key_u32(a + "context_length", *m.ctx));
  out.push_back(key_u32(a + "embedding_length", hp.n_embd));
  if (m.n_ff) out.push_back(key_u32(a + "feed_forward_length", *m.n_ff));
  out.push_back(key_u32(a + "attention.head_count", hp.n_head));
  out.push_back(key_u32(a + "attention.head_count_kv", hp.n_head_kv));
  out.push_back(key_f32(a + "rope.freq_base", hp.rope_freq_base));
  out.push_back(key_f32(a + "attention.layer_norm_rms_epsilon", hp.rms_eps));
  out.push_back(key_u32(a + "expert_count", hp.n_expert));
  out.push_back(key_u32(a + "expert_used_count", hp.n_expert_used));
  if (m.head_dim_cfg) {
    out.push_back(key_u32(a + "attention.key_length", *m.head_dim_cfg));
    out.push_back(key_u32(a + "attention.value_length", *m.head_dim_cfg));
  }
  out.push_back(key_u32(a + "expert_feed_forward_length", hp.n_ff_exp));
}

}  // namespace

ConvertPlan plan_checkpoint(const json& config, const Checkpoint& ckpt) {
  const HfConfig cfg(config);
  std::string hf_arch;
  const ArchConverter* conv = resolve(cfg, hf_arch);
  if (conv == nullptr) {
    std::string list;
    for (const ArchConverter* c : all_converters()) {
      for (const std::string& h : model::find_arch(c->arch)->hf_architectures) list += (list.empty() ? "" : ", ") + h;
    }
    throw ConvertError("config.json: architecture '" + (hf_arch.empty() ? std::string("(none given)") : hf_arch) +
                       "' is not supported (moraine-convert knows " + list + ")");
  }
  HfModel m;
  m.hp.desc = model::find_arch(conv->arch);
  if (m.hp.desc == nullptr) throw std::logic_error(std::string("moraine-convert: no architecture description for ") + conv->arch);
  m.hp.arch = hf_arch == "Qwen3MoeForCausalLM" ? model::Arch::Qwen3Moe
              : hf_arch == "Qwen3NextForCausalLM" ? model::Arch::Qwen3Next : model::Arch::Other;
  read_common(cfg, m);
  conv->read_config(cfg, ckpt, m);
  for (int64_t il = 0; il < m.hp.n_layer + m.hp.n_nextn; ++il) m.hp.recipes.push_back(m.hp.desc->layer_recipe(m.hp, il));

  ConvertPlan plan;
  plan.arch = conv->arch;
  Planner(*conv, m, ckpt, plan).run();
  const std::string a = plan.arch + ".";
  write_common(m, a, plan.metadata);
  for (auto& kv : m.keys) plan.metadata.push_back(std::move(kv));
  plan.notes = m.notes;
  return plan;
}

}  // namespace moraine::convert
