#include "tools/synth/shapes.h"

#include <stdexcept>

#include "common/model/layer_tensors.h"

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

    // gpt-oss-20b (GptOssForCausalLM config.json); gpt-oss-120b differs in layers and experts.
    ShapeSpec oss;
    oss.name = "gpt-oss-20b";
    oss.arch = "gpt-oss";
    oss.n_layer = 24;
    oss.hidden = 2880;
    oss.vocab = 201088;
    oss.context_length = 131072;
    oss.n_head = 64;
    oss.n_head_kv = 8;
    oss.head_dim = 64;
    oss.n_rot = 64;
    oss.dense_ff = 2880;
    oss.n_expert = 32;
    oss.n_expert_used = 4;
    oss.ff_exp = 2880;
    oss.rope_theta = 150000;
    oss.rms_eps = 1e-5;
    oss.sliding_window = 128;
    oss.swa_period = 2;
    oss.yarn_factor = 32;
    oss.yarn_orig_ctx = 4096;
    v.push_back(oss);
    ShapeSpec oss120 = oss;
    oss120.name = "gpt-oss-120b";
    oss120.n_layer = 36;
    oss120.n_expert = 128;
    v.push_back(oss120);
    ShapeSpec tiny_oss = oss;
    tiny_oss.name = "gpt-oss-tiny";
    tiny_oss.n_layer = 4;
    tiny_oss.hidden = 256;
    tiny_oss.context_length = 4096 * 32;
    tiny_oss.n_head = 8;
    tiny_oss.n_head_kv = 2;
    tiny_oss.head_dim = 32;
    tiny_oss.n_rot = 32;
    tiny_oss.dense_ff = 256;
    tiny_oss.n_expert = 8;
    tiny_oss.n_expert_used = 2;
    tiny_oss.ff_exp = 256;
    tiny_oss.sliding_window = 8;
    v.push_back(tiny_oss);

    // GLM-4.5-Air (Glm4MoeForCausalLM config.json; its one nextn block is not written).
    ShapeSpec air;
    air.name = "glm4.5-air";
    air.arch = "glm4moe";
    air.n_layer = 46;
    air.hidden = 4096;
    air.vocab = 151552;
    air.context_length = 131072;
    air.n_head = 96;
    air.n_head_kv = 8;
    air.head_dim = 128;
    air.n_rot = 64;  // partial_rotary_factor 0.5
    air.dense_ff = 10944;
    air.n_expert = 128;
    air.n_expert_used = 8;
    air.ff_exp = 1408;
    air.n_shared = 1;
    air.rope_theta = 1e6;
    air.rms_eps = 1e-5;
    air.n_dense_lead = 1;
    air.norm_topk = true;
    v.push_back(air);
    ShapeSpec tiny_air = air;
    tiny_air.name = "glm4moe-tiny";
    tiny_air.n_layer = 4;
    tiny_air.hidden = 256;
    tiny_air.context_length = 4096;
    tiny_air.n_head = 8;
    tiny_air.n_head_kv = 2;
    tiny_air.head_dim = 32;
    tiny_air.n_rot = 16;
    tiny_air.dense_ff = 512;
    tiny_air.n_expert = 8;
    tiny_air.n_expert_used = 2;
    tiny_air.ff_exp = 256;
    v.push_back(tiny_air);

    // Qwen3.5-35B-A3B (Qwen3_5MoeForCausalLM text config).
    ShapeSpec q35 = next;
    q35.name = "qwen35moe-35b-a3b";
    q35.arch = "qwen35moe";
    q35.n_layer = 40;
    q35.vocab = 248320;
    q35.n_expert = 256;
    q35.n_expert_used = 8;
    q35.ff_exp = 512;
    q35.ff_shexp = 512;
    q35.dense_ff = 0;
    v.push_back(q35);
    ShapeSpec tiny_q35 = tiny_next;
    tiny_q35.name = "qwen35moe-tiny";
    tiny_q35.arch = "qwen35moe";
    tiny_q35.dense_ff = 0;
    v.push_back(tiny_q35);

    // DeepSeek-V2-Lite (DeepseekV2ForCausalLM config.json): q directly, softmax router.
    ShapeSpec lite;
    lite.name = "deepseek-v2-lite";
    lite.arch = "deepseek2";
    lite.n_layer = 27;
    lite.hidden = 2048;
    lite.vocab = 102400;
    lite.context_length = 163840;
    lite.n_head = 16;
    lite.n_head_kv = 1;
    lite.kv_lora_rank = 512;
    lite.n_rot = 64;
    lite.head_dim = lite.kv_lora_rank + lite.n_rot;
    lite.qk_nope = 128;
    lite.v_head = 128;
    lite.dense_ff = 10944;
    lite.n_expert = 64;
    lite.n_expert_used = 6;
    lite.ff_exp = 1408;
    lite.n_dense_lead = 1;
    lite.n_shared = 2;
    lite.rope_theta = 10000;
    lite.yarn_factor = 40;
    lite.yarn_orig_ctx = 4096;
    lite.mscale_all_dim = 0.707;
    v.push_back(lite);
    // DeepSeek-V3 (DeepseekV3ForCausalLM config.json; R1 has the same shape): q LoRA, sigmoid
    // router with the choice bias over 8 groups of which 4 are used, routed scale 2.5.
    ShapeSpec v3 = lite;
    v3.name = "deepseek-v3";
    v3.n_layer = 61;
    v3.hidden = 7168;
    v3.vocab = 129280;
    v3.n_head = 128;
    v3.q_lora_rank = 1536;
    v3.dense_ff = 18432;
    v3.n_expert = 256;
    v3.n_expert_used = 8;
    v3.ff_exp = 2048;
    v3.n_dense_lead = 3;
    v3.n_shared = 1;
    v3.n_group = 8;
    v3.topk_group = 4;
    v3.sigmoid_router = true;
    v3.norm_topk = true;
    v3.routed_scale = 2.5;
    v3.mscale_all_dim = 1.0;
    v.push_back(v3);
    ShapeSpec tiny_v3 = v3;
    tiny_v3.name = "deepseek-v3-tiny";
    tiny_v3.n_layer = 4;
    tiny_v3.hidden = 256;
    tiny_v3.n_head = 4;
    tiny_v3.q_lora_rank = 96;
    tiny_v3.kv_lora_rank = 64;
    tiny_v3.n_rot = 16;
    tiny_v3.head_dim = tiny_v3.kv_lora_rank + tiny_v3.n_rot;
    tiny_v3.qk_nope = 32;
    tiny_v3.v_head = 32;
    tiny_v3.dense_ff = 512;
    tiny_v3.n_expert = 8;
    tiny_v3.n_expert_used = 2;
    tiny_v3.ff_exp = 128;
    tiny_v3.n_dense_lead = 1;
    tiny_v3.n_group = 4;
    tiny_v3.topk_group = 2;
    v.push_back(tiny_v3);
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

model::HParams to_hparams(const ShapeSpec& s) {
  model::HParams hp;
  hp.desc = model::find_arch(s.arch);
  if (hp.desc == nullptr) throw std::invalid_argument("shape " + s.name + ": unknown architecture " + s.arch);
  hp.arch = s.arch == "qwen3moe" ? model::Arch::Qwen3Moe : s.arch == "qwen3next" ? model::Arch::Qwen3Next : model::Arch::Other;
  hp.n_layer = s.n_layer;
  hp.n_embd = s.hidden;
  hp.n_vocab = s.vocab;
  hp.n_ff = s.dense_ff;
  hp.n_head = s.n_head;
  hp.n_head_kv = s.n_head_kv;
  hp.head_dim = s.head_dim;
  hp.n_rot = s.n_rot;
  hp.rope_freq_base = s.rope_theta;
  hp.rms_eps = s.rms_eps;
  hp.n_expert = s.n_expert;
  hp.n_expert_used = s.n_expert_used;
  hp.n_ff_exp = s.ff_exp;
  hp.n_ff_shexp = s.ff_shexp;
  hp.ssm_conv_kernel = s.conv_kernel;
  hp.ssm_head_k_dim = hp.ssm_head_v_dim = s.ssm_head_dim;
  hp.ssm_n_k_heads = s.ssm_k_heads;
  hp.ssm_n_v_heads = s.ssm_v_heads;
  hp.full_attention_interval = s.full_attn_interval;
  for (int64_t il = 0; il < s.n_layer; ++il) hp.recurrent.push_back(s.recurrent(il));
  hp.sliding_window = s.sliding_window;
  for (int64_t il = 0; il < s.n_layer && s.swa_period > 0; ++il) hp.swa_layers.push_back(il % s.swa_period < s.swa_period - 1);
  if (s.yarn_orig_ctx > 0) {
    hp.rope_scaling = model::RopeScaling::Yarn;
    hp.rope_scaling_factor = s.yarn_factor;
    hp.rope_orig_ctx = s.yarn_orig_ctx;
  }
  if (s.arch == "glm4moe") {
    hp.n_dense_lead = s.n_dense_lead;
    hp.n_ff_shexp = s.n_shared * s.ff_exp;
    hp.norm_topk_prob = s.norm_topk;
    hp.expert_weights_scale = s.routed_scale;
    hp.attn_qk_norm = s.qk_norm;
  }
  if (s.mla()) {
    hp.head_dim_v = s.kv_lora_rank;
    hp.q_lora_rank = s.q_lora_rank;
    hp.kv_lora_rank = s.kv_lora_rank;
    hp.mla_head_k = s.qk_nope + s.n_rot;
    hp.mla_head_v = s.v_head;
    hp.mla_split_kv_b = true;   // what llama.cpp's converter writes
    hp.rope_yarn_log_mul = s.mscale_all_dim;
    hp.n_dense_lead = s.n_dense_lead;
    hp.n_ff_shexp = s.n_shared * s.ff_exp;
    hp.sigmoid_gating = hp.expert_score_bias = s.sigmoid_router;
    hp.norm_topk_prob = s.norm_topk;
    hp.expert_weights_scale = s.routed_scale;
    hp.n_expert_groups = s.n_group;
    hp.n_group_used = s.topk_group;
  }
  for (int64_t il = 0; il < s.n_layer; ++il) hp.recipes.push_back(hp.desc->layer_recipe(hp, il));
  return hp;
}

namespace {

// How synth draws a tensor's values, by what the description says it is for.
Role role_of(model::TensorRole r) {
  using T = model::TensorRole;
  switch (r) {
    case T::TokEmbd: return Role::Embedding;
    case T::Output: return Role::Output;
    case T::OutputNorm: case T::AttnNorm: case T::FfnNorm: case T::NextnEnorm: case T::NextnHnorm:
    case T::NextnSharedHeadNorm: return Role::Norm;
    case T::AttnQNorm: case T::AttnKNorm: case T::DnNorm: return Role::HeadNorm;
    case T::AttnO: case T::DnOut: case T::DownExps: case T::DownShexp: case T::FfnDown: return Role::OutProj;
    case T::Router: return Role::Router;
    case T::SharedRouter: return Role::SharedGate;
    case T::DnConv: return Role::Conv;
    case T::DnDtBias: return Role::DtBias;
    case T::DnA: return Role::Decay;
    case T::MlaQANorm: case T::MlaKvANorm: return Role::HeadNorm;
    // MLA: q (or its LoRA), kv_a, and the per-head decompressions read a normalised input.
    case T::MlaQA: case T::MlaQB: case T::MlaKvAMqa: case T::MlaKvB: case T::MlaKB: case T::MlaVB:
      return Role::InProj;
    case T::AttnQ: case T::AttnK: case T::AttnV: case T::DnQkv: case T::DnGate: case T::DnBa: case T::DnBeta:
    case T::DnAlpha: case T::GateExps:
    case T::UpExps: case T::GateShexp: case T::UpShexp: case T::FfnGate: case T::FfnUp: case T::NextnEhProj:
      return Role::InProj;
    case T::AttnQBias: case T::AttnKBias: case T::AttnVBias: case T::AttnOBias: case T::RouterBias:
    case T::GateExpsBias: case T::UpExpsBias: case T::DownExpsBias: case T::ScoreBias:
      return Role::Bias;
    case T::AttnSinks: return Role::Sink;
    default: break;
  }
  throw std::invalid_argument(std::string("moraine-synth cannot draw a ") + model::tensor_role_name(r) +
                              " tensor yet");
}

}  // namespace

std::vector<TensorSpec> tensor_list(const ShapeSpec& s) {
  const model::HParams hp = to_hparams(s);
  std::vector<TensorSpec> t;
  // The description's list (the one the loader binds); of its optional tensors synth writes
  // the untied LM head only.
  for (const model::TensorSlot& slot : model::model_tensors(hp)) {
    if (slot.optional && slot.role != model::TensorRole::Output) continue;
    t.push_back({slot.name, slot.shape, role_of(slot.role), slot.layer});
  }
  return t;
}

std::vector<std::pair<std::string, Value>> arch_metadata(const ShapeSpec& s) {
  const model::HParams hp = to_hparams(s);
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
  hp.desc->write_keys(hp, a, m);   // the architecture's own keys
  m.emplace_back(a + "rope.dimension_count", u32(s.n_rot));
  return m;
}

}  // namespace moraine::synth
