#include "tools/synth/shapes.h"

#include <stdexcept>

namespace moraine::synth {

using gguf::Value;
using gguf::ValueType;

const std::vector<ShapeSpec>& named_shapes() {
  static const std::vector<ShapeSpec> shapes = [] {
    std::vector<ShapeSpec> v;
    // Qwen3-30B-A3B (Qwen3MoeForCausalLM config.json).
    ShapeSpec moe;
    moe.name = "qwen3moe-30b-a3b";
    moe.arch = "qwen3moe";
    moe.n_layer = 48;
    moe.hidden = 2048;
    moe.vocab = 151936;
    moe.context_length = 40960;
    moe.n_head = 32;
    moe.n_head_kv = 4;
    moe.head_dim = 128;
    moe.n_rot = 128;
    moe.dense_ff = 6144;
    moe.n_expert = 128;
    moe.n_expert_used = 8;
    moe.ff_exp = 768;
    moe.rope_theta = 1e6;
    v.push_back(moe);

    // Qwen3-Next-80B-A3B (Qwen3NextForCausalLM config.json).
    ShapeSpec next;
    next.name = "qwen3next-80b-a3b";
    next.arch = "qwen3next";
    next.n_layer = 48;
    next.hidden = 2048;
    next.vocab = 151936;
    next.context_length = 262144;
    next.n_head = 16;
    next.n_head_kv = 2;
    next.head_dim = 256;
    next.n_rot = 64;  // partial_rotary_factor 0.25
    next.dense_ff = 5120;
    next.n_expert = 512;
    next.n_expert_used = 10;
    next.ff_exp = 512;
    next.ff_shexp = 512;
    next.rope_theta = 1e7;
    next.full_attn_interval = 4;
    next.conv_kernel = 4;
    next.ssm_head_dim = 128;
    next.ssm_k_heads = 16;
    next.ssm_v_heads = 32;
    v.push_back(next);

    // Tiny variants for tests and demos: the same structure at a size a laptop runs instantly.
    ShapeSpec tiny = moe;
    tiny.name = "qwen3moe-tiny";
    tiny.n_layer = 4;
    tiny.hidden = 256;
    tiny.context_length = 4096;
    tiny.n_head = 8;
    tiny.n_head_kv = 2;
    tiny.head_dim = 32;
    tiny.n_rot = 32;
    tiny.dense_ff = 768;
    tiny.n_expert = 8;
    tiny.n_expert_used = 2;
    tiny.ff_exp = 256;
    v.push_back(tiny);

    ShapeSpec tiny_next = next;
    tiny_next.name = "qwen3next-tiny";
    tiny_next.n_layer = 4;
    tiny_next.hidden = 256;
    tiny_next.context_length = 4096;
    tiny_next.n_head = 4;
    tiny_next.n_head_kv = 2;
    tiny_next.head_dim = 64;
    tiny_next.n_rot = 16;
    tiny_next.dense_ff = 768;
    tiny_next.n_expert = 16;
    tiny_next.n_expert_used = 4;
    tiny_next.ff_exp = 128;
    tiny_next.ff_shexp = 128;
    tiny_next.ssm_head_dim = 32;
    tiny_next.ssm_k_heads = 4;
    tiny_next.ssm_v_heads = 8;
    v.push_back(tiny_next);
    return v;
  }();
  return shapes;
}

ShapeSpec find_shape(const std::string& name) {
  std::string known;
  for (const ShapeSpec& s : named_shapes()) {
    if (s.name == name) return s;
    known += (known.empty() ? "" : ", ") + s.name;
  }
  throw std::invalid_argument("--shape '" + name + "' is not a known shape (known: " + known + ")");
}

namespace {
std::string blk(int64_t il, const char* what) { return "blk." + std::to_string(il) + "." + what; }
}  // namespace

std::vector<TensorSpec> tensor_list(const ShapeSpec& s) {
  const int64_t H = s.hidden, V = s.vocab, hd = s.head_dim, E = s.n_expert, F = s.ff_exp;
  std::vector<TensorSpec> t;
  t.push_back({"token_embd.weight", {H, V}, Role::Embedding});
  for (int64_t il = 0; il < s.n_layer; ++il) {
    t.push_back({blk(il, "attn_norm.weight"), {H}, Role::Norm, il});
    if (s.recurrent(il)) {
      const int64_t key_dim = s.ssm_k_heads * s.ssm_head_dim, value_dim = s.ssm_v_heads * s.ssm_head_dim;
      const int64_t conv_dim = 2 * key_dim + value_dim;
      t.push_back({blk(il, "attn_qkv.weight"), {H, conv_dim}, Role::InProj, il});
      t.push_back({blk(il, "attn_gate.weight"), {H, value_dim}, Role::InProj, il});
      t.push_back({blk(il, "ssm_ba.weight"), {H, 2 * s.ssm_v_heads}, Role::InProj, il});
      t.push_back({blk(il, "ssm_conv1d.weight"), {s.conv_kernel, conv_dim}, Role::Conv, il});
      t.push_back({blk(il, "ssm_dt.bias"), {s.ssm_v_heads}, Role::DtBias, il});
      t.push_back({blk(il, "ssm_a"), {s.ssm_v_heads}, Role::Decay, il});
      t.push_back({blk(il, "ssm_norm.weight"), {s.ssm_head_dim}, Role::HeadNorm, il});
      t.push_back({blk(il, "ssm_out.weight"), {value_dim, H}, Role::OutProj, il});
    } else {
      // qwen3next's q projection also yields a per-head output gate, hence twice the rows.
      const int64_t q_rows = s.n_head * hd * (s.next() ? 2 : 1);
      t.push_back({blk(il, "attn_q.weight"), {H, q_rows}, Role::InProj, il});
      t.push_back({blk(il, "attn_k.weight"), {H, s.n_head_kv * hd}, Role::InProj, il});
      t.push_back({blk(il, "attn_v.weight"), {H, s.n_head_kv * hd}, Role::InProj, il});
      t.push_back({blk(il, "attn_output.weight"), {s.n_head * hd, H}, Role::OutProj, il});
      t.push_back({blk(il, "attn_q_norm.weight"), {hd}, Role::HeadNorm, il});
      t.push_back({blk(il, "attn_k_norm.weight"), {hd}, Role::HeadNorm, il});
    }
    // Qwen3-MoE calls the pre-FFN norm ffn_norm; Qwen3-Next calls it post_attention_norm.
    t.push_back({blk(il, s.next() ? "post_attention_norm.weight" : "ffn_norm.weight"), {H}, Role::Norm, il});
    t.push_back({blk(il, "ffn_gate_inp.weight"), {H, E}, Role::Router, il});
    t.push_back({blk(il, "ffn_gate_exps.weight"), {H, F, E}, Role::InProj, il});
    t.push_back({blk(il, "ffn_up_exps.weight"), {H, F, E}, Role::InProj, il});
    t.push_back({blk(il, "ffn_down_exps.weight"), {F, H, E}, Role::OutProj, il});
    if (s.next()) {
      t.push_back({blk(il, "ffn_gate_inp_shexp.weight"), {H}, Role::SharedGate, il});
      t.push_back({blk(il, "ffn_gate_shexp.weight"), {H, s.ff_shexp}, Role::InProj, il});
      t.push_back({blk(il, "ffn_up_shexp.weight"), {H, s.ff_shexp}, Role::InProj, il});
      t.push_back({blk(il, "ffn_down_shexp.weight"), {s.ff_shexp, H}, Role::OutProj, il});
    }
  }
  t.push_back({"output_norm.weight", {H}, Role::Norm});
  t.push_back({"output.weight", {H, V}, Role::Output});
  return t;
}

std::vector<std::pair<std::string, Value>> arch_metadata(const ShapeSpec& s) {
  const std::string a = s.arch + ".";
  const auto u32 = [](int64_t x) { return Value::u32(static_cast<uint32_t>(x)); };
  std::vector<std::pair<std::string, Value>> m;
  m.emplace_back(a + "block_count", u32(s.n_layer));
  m.emplace_back(a + "context_length", u32(s.context_length));
  m.emplace_back(a + "embedding_length", u32(s.hidden));
  m.emplace_back(a + "feed_forward_length", u32(s.dense_ff));
  m.emplace_back(a + "attention.head_count", u32(s.n_head));
  m.emplace_back(a + "attention.head_count_kv", u32(s.n_head_kv));
  m.emplace_back(a + "rope.freq_base", Value::f32(static_cast<float>(s.rope_theta)));
  m.emplace_back(a + "attention.layer_norm_rms_epsilon", Value::f32(static_cast<float>(s.rms_eps)));
  m.emplace_back(a + "expert_count", u32(s.n_expert));
  m.emplace_back(a + "expert_used_count", u32(s.n_expert_used));
  m.emplace_back(a + "attention.key_length", u32(s.head_dim));
  m.emplace_back(a + "attention.value_length", u32(s.head_dim));
  m.emplace_back(a + "expert_feed_forward_length", u32(s.ff_exp));
  if (s.next()) {
    m.emplace_back(a + "expert_shared_feed_forward_length", u32(s.ff_shexp));
    m.emplace_back(a + "ssm.conv_kernel", u32(s.conv_kernel));
    m.emplace_back(a + "ssm.state_size", u32(s.ssm_head_dim));
    m.emplace_back(a + "ssm.group_count", u32(s.ssm_k_heads));
    m.emplace_back(a + "ssm.time_step_rank", u32(s.ssm_v_heads));
    m.emplace_back(a + "ssm.inner_size", u32(s.ssm_head_dim * s.ssm_v_heads));
    std::vector<Value> rec;
    for (int64_t i = 0; i < s.n_layer; ++i) rec.push_back(Value::boolean(s.recurrent(i)));
    m.emplace_back(a + "attention.recurrent_layers", Value::array(ValueType::BOOL, std::move(rec)));
    m.emplace_back(a + "full_attention_interval", u32(s.full_attn_interval));
  }
  m.emplace_back(a + "rope.dimension_count", u32(s.n_rot));
  return m;
}

}  // namespace moraine::synth
