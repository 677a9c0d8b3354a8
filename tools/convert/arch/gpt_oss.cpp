// GptOssForCausalLM -> gpt-oss, with the keys and tensors llama.cpp's converter writes.
// config.json: sliding_window (even layers slide, odd ones are full: the only pattern
// llama.cpp's gpt-oss runs), YaRN (factor, original_max_position_embeddings, beta_fast/slow),
// experts sized by intermediate_size. Tensors: the fused experts are stored per expert as
// [n_embd, 2F] with gate and up interleaved (gate in the even columns, up in the odd ones):
//   gate_up_proj [E, H, 2F] -> ffn_gate_exps / ffn_up_exps [H, F, E] (transposed, de-interleaved)
//   gate_up_proj_bias [E, 2F] -> ffn_gate_exps.bias / ffn_up_exps.bias [F, E]
//   down_proj [E, F, H] -> ffn_down_exps [F, H, E] (transposed)
// or, as the released checkpoints hold them, in MXFP4: <name>_blocks [E, rows, cols/32, 16]
// (element 2i in the low nibble of byte i, 2i+1 in the high one) with <name>_scales
// [E, rows, cols/32] (E8M0), the rows of gate_up interleaved the same way; those become GGUF
// MXFP4 tensors (ggml's block: the scale byte, then element j | element j+16 << 4 per byte).
#include <cstring>

#include "tools/convert/arch_converter.h"

namespace moraine::convert {

using model::TensorRole;
using nlohmann::json;

namespace {

void read_rope(const HfConfig& cfg, HfModel& m) {
  model::HParams& hp = m.hp;
  const HfConfig rope = cfg.rope();
  const char* type_key = rope.has("rope_type") ? "rope_type" : "type";
  const std::string type = rope.opt_text(type_key).value_or("default");
  if (type == "default") return;
  if (type != "yarn") rope.fail(type_key, "= '" + type + "' is not a RoPE scaling gpt-oss uses (yarn or default)");
  hp.rope_scaling = model::RopeScaling::Yarn;
  hp.rope_scaling_factor = rope.number("factor");
  hp.rope_orig_ctx = rope.integer("original_max_position_embeddings");
  if (hp.rope_scaling_factor < 1.0) rope.fail("factor", "must be at least 1");
  // moraine's description (and llama.cpp's default) have beta_fast 32, beta_slow 1 and YaRN's
  // attention factor from the scaling factor: other values would be dropped, so refuse them.
  for (const auto& [k, want] : {std::pair<const char*, double>{"beta_fast", 32.0}, {"beta_slow", 1.0}}) {
    if (std::optional<double> v = rope.opt_number(k); v && *v != want) {
      rope.fail(k, "= " + std::to_string(*v) + " is not supported (moraine's gpt-oss uses " + std::to_string(want) + ")");
    }
  }
  for (const char* k : {"attention_factor", "mscale", "mscale_all_dim", "extrapolation_factor"}) {
    if (rope.has(k)) rope.fail(k, "is not supported: moraine's gpt-oss derives YaRN's scaling from factor alone");
  }
  // HF's truncate=false (gpt-oss's own config) keeps the correction dims fractional; llama.cpp
  // has no key for it and rounds them. moraine's own key carries it, llama.cpp ignores it.
  if (!rope.flag("truncate", true)) {
    m.put("rope.scaling.yarn_truncate", gguf::Value::boolean(false));
    m.notes.push_back("rope truncate = false: written as rope.scaling.yarn_truncate (llama.cpp ignores it and rounds "
                      "YaRN's correction range to whole dims)");
  }
  m.put("rope.scaling.type", gguf::Value::string("yarn"));
  m.put_f32("rope.scaling.factor", hp.rope_scaling_factor);
  m.put_u32("rope.scaling.original_context_length", hp.rope_orig_ctx);
  if (rope.has("beta_fast")) m.put_f32("rope.scaling.yarn_beta_fast", rope.number("beta_fast"));
  if (rope.has("beta_slow")) m.put_f32("rope.scaling.yarn_beta_slow", rope.number("beta_slow"));
}

void read_config(const HfConfig& cfg, const Checkpoint&, HfModel& m) {
  model::HParams& hp = m.hp;
  hp.n_ff_exp = cfg.integer("intermediate_size");
  hp.norm_topk_prob = false;
  hp.expert_weights_scale = 1.0;
  if (std::optional<double> lim = cfg.opt_number("swiglu_limit"); lim && *lim != 7.0) {
    cfg.fail("swiglu_limit", "= " + std::to_string(*lim) + " is not supported: the GGUF architecture clamps at 7");
  }
  if (!cfg.flag("attention_bias", true)) cfg.fail("attention_bias", "= false is not supported: gpt-oss has attention biases");
  if (const json* q = cfg.find("quantization_config")) {
    const std::string method = q->is_object() ? q->value("quant_method", "") : "";
    if (method != "mxfp4") {
      cfg.fail("quantization_config", "has quant_method '" + method + "'; only mxfp4 (the released checkpoints') is read");
    }
  }
  hp.sliding_window = cfg.integer("sliding_window");
  if (hp.sliding_window == 0) cfg.fail("sliding_window", "must be positive");
  hp.swa_layers.assign(static_cast<size_t>(hp.n_layer), false);
  for (int64_t il = 0; il < hp.n_layer; ++il) hp.swa_layers[il] = il % 2 == 0;
  if (const json* lt = cfg.find("layer_types")) {
    if (!lt->is_array() || static_cast<int64_t>(lt->size()) != hp.n_layer) {
      cfg.fail("layer_types", "must list num_hidden_layers (" + std::to_string(hp.n_layer) + ") entries");
    }
    for (int64_t il = 0; il < hp.n_layer; ++il) {
      const char* want = hp.swa_layers[il] ? "sliding_attention" : "full_attention";
      if ((*lt)[il] != want) {
        cfg.fail("layer_types[" + std::to_string(il) + "]", "= " + (*lt)[il].dump() + ": the GGUF architecture has " +
                                                                "sliding even layers and full odd ones only (" + want + " here)");
      }
    }
  }
  read_rope(cfg, m);
  m.put_u32("attention.sliding_window", hp.sliding_window);
}

// ggml's MXFP4 block from the checkpoint's: E8M0 scale first, then element j | element j+16 << 4.
void repack_block(uint8_t scale, const uint8_t* packed, uint8_t* out) {
  uint8_t v[32];
  for (int i = 0; i < 16; ++i) {
    v[2 * i] = packed[i] & 15;
    v[2 * i + 1] = packed[i] >> 4;
  }
  out[0] = scale;
  for (int j = 0; j < 16; ++j) out[1 + j] = static_cast<uint8_t>(v[j] | (v[j + 16] << 4));
}

// One GGUF MXFP4 expert tensor from <base>_blocks / <base>_scales: HF rows first, first + step, ...
void mxfp4_experts(Planner& p, const std::string& name, const std::string& base, int64_t rows, int64_t cols,
                   int64_t first, int64_t step, int64_t n_out) {
  const int64_t E = p.model().hp.n_expert, nb = cols / 32;
  if (cols % 32 != 0) throw ConvertError(base + "_blocks: rows of " + std::to_string(cols) + " are not whole MXFP4 blocks");
  const StTensor& blocks = p.take(base + "_blocks", {E, rows, nb, 16}, true);
  const StTensor& scales = p.take(base + "_scales", {E, rows, nb}, true);
  p.add_raw(name, {cols, n_out, E}, TensorType::MXFP4, [&blocks, &scales, E, rows, nb, first, step, n_out](uint8_t* dst) {
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t r = 0; r < n_out; ++r) {
        const int64_t hr = e * rows + first + r * step;
        for (int64_t b = 0; b < nb; ++b, dst += 17) repack_block(scales.data[hr * nb + b], blocks.data + (hr * nb + b) * 16, dst);
      }
    }
  });
}

// gate_up_proj [E, H, 2F]: GGUF row (e, f) of gate is column 2f of expert e (up: 2f + 1).
void gate_up(Planner& p, const model::TensorSlot& t, const std::string& hf) {
  const int64_t E = p.model().hp.n_expert, H = p.model().hp.n_embd, F = t.shape.at(1);
  const std::string up_name = p.desc().gguf_name(TensorRole::UpExps, t.layer);
  const std::string base = hf + "mlp.experts.gate_up_proj";
  if (p.has(base + "_blocks")) {
    mxfp4_experts(p, t.name, base, 2 * F, H, 0, 2, F);
    mxfp4_experts(p, up_name, base, 2 * F, H, 1, 2, F);
    return;
  }
  const StTensor& gu = p.take(base, {E, H, 2 * F});
  std::vector<RowSpan> gate, up;
  for (int64_t e = 0; e < E; ++e) {
    gate.push_back({&gu, e * H * 2 * F, F, 2 * F, 2});
    up.push_back({&gu, e * H * 2 * F + 1, F, 2 * F, 2});
  }
  p.add(t.name, {H, F, E}, std::move(gate), ElemOp::None);
  p.add(up_name, {H, F, E}, std::move(up), ElemOp::None);
}

// down_proj [E, F, H]: GGUF row (e, h) is column h of expert e.
void down(Planner& p, const model::TensorSlot& t, const std::string& hf) {
  const int64_t E = p.model().hp.n_expert, H = p.model().hp.n_embd, F = t.shape.at(0);
  const std::string base = hf + "mlp.experts.down_proj";
  if (p.has(base + "_blocks")) {
    mxfp4_experts(p, t.name, base, H, F, 0, 1, H);
    return;
  }
  const StTensor& dn = p.take(base, {E, F, H});
  std::vector<RowSpan> rows;
  for (int64_t e = 0; e < E; ++e) rows.push_back({&dn, e * F * H, H, H, 1});
  p.add(t.name, {F, H, E}, std::move(rows), ElemOp::None);
}

bool map_tensor(Planner& p, const model::TensorSlot& t, const std::string& hf) {
  switch (t.role) {
    case TensorRole::GateExps: gate_up(p, t, hf); return true;
    case TensorRole::UpExps: case TensorRole::UpExpsBias: return true;   // written with the gate's
    case TensorRole::DownExps: down(p, t, hf); return true;
    case TensorRole::GateExpsBias: {   // [E, 2F], interleaved like the weights
      const int64_t E = p.model().hp.n_expert, F = t.shape.at(0);
      const StTensor& b = p.take(hf + "mlp.experts.gate_up_proj_bias", {E, 2 * F});
      p.add(t.name, {F, E}, {{&b, 0, E, 2, 2 * F}}, ElemOp::None);
      p.add(p.desc().gguf_name(TensorRole::UpExpsBias, t.layer), {F, E}, {{&b, 1, E, 2, 2 * F}}, ElemOp::None);
      return true;
    }
    default: return false;
  }
}

}  // namespace

const ArchConverter& converter_gpt_oss() {
  static const ArchConverter c{"gpt-oss", {"gpt_oss"}, read_config, map_tensor, nullptr};
  return c;
}

}  // namespace moraine::convert
