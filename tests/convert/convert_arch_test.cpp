// moraine-convert on tiny gpt-oss, qwen2moe and glm4moe checkpoints this test writes itself (the
// names, shapes and dtypes transformers saves; no torch in CI): gpt-oss in bf16 and in the released
// checkpoints' MXFP4, qwen2moe per expert and in transformers v5's fused layout, glm4moe and
// qwen35moe with their multi-token-prediction layers (which transformers does not save, so no
// golden fixture has one). Checks:
//  - the metadata says what config.json says;
//  - moraine's loader binds each file, and every tensor's values are where the architecture
//    description says (gpt-oss gate/up de-interleaved and transposed, the bias split, MXFP4
//    blocks repacked to ggml's layout; qwen2moe's biases and shared expert);
//  - llama.cpp loads each file and its logits match moraine's reference on it (16 positions,
//    past the sliding window), and the o200k vocabulary tokenizes with llama.cpp's gpt-4o
//    pre-tokenizer;
//  - bad configs are refused naming the key.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "common/formats/quant.h"
#include "common/gguf/gguf.h"
#include "common/model/model.h"
#include "common/reference/executor.h"
#include "tests/convert/tiny_hf.h"
#include "tools/convert/convert.h"
#include "tools/convert/safetensors.h"

namespace moraine::convert::test {
namespace {

using gguf::GgufFile;
using nlohmann::json;

constexpr int64_t kVocab = 300;
constexpr int kTokens = 16;
const std::string kTemplate =
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}";

// ---- the checkpoints ----

struct GptOss {
  // H != 2F, so a fused tensor in the other orientation is a shape error, not a silent transpose.
  static constexpr int64_t H = 96, L = 4, nh = 4, nkv = 2, hd = 16, E = 4, k = 2, F = 32, window = 4;
};
struct Qwen2Moe {
  static constexpr int64_t H = 64, L = 2, nh = 4, nkv = 2, E = 4, k = 2, F = 40, Fs = 48, Fd = 96;
};
// Layer 0 DeltaNet, layer 1 gated attention, layer 2 the MTP (nextn) layer; value heads 2 per key head.
struct Q35 {
  static constexpr int64_t H = 64, L = 2, nh = 4, nkv = 2, hd = 32, nk = 2, nv = 4, dk = 16, K = 4, E = 4, F = 32;
  static constexpr int64_t C = 2 * nk * dk + nv * dk;
};
// Layer 0 dense, layer 1 MoE, layer 2 the MTP (nextn) layer.
struct Glm {
  static constexpr int64_t H = 64, L = 2, nh = 4, nkv = 2, hd = 16, E = 4, k = 2, F = 32, Fd = 96, n_rot = 8;
};

json gpt_oss_config(bool mxfp4) {
  json c = {{"architectures", {"GptOssForCausalLM"}}, {"model_type", "gpt_oss"}, {"vocab_size", kVocab},
            {"hidden_size", GptOss::H}, {"intermediate_size", GptOss::F}, {"num_hidden_layers", GptOss::L},
            {"num_attention_heads", GptOss::nh}, {"num_key_value_heads", GptOss::nkv}, {"head_dim", GptOss::hd},
            {"num_local_experts", GptOss::E}, {"num_experts_per_tok", GptOss::k}, {"sliding_window", GptOss::window},
            {"layer_types", {"sliding_attention", "full_attention", "sliding_attention", "full_attention"}},
            {"attention_bias", true}, {"rms_norm_eps", 1e-5}, {"max_position_embeddings", 256},
            {"tie_word_embeddings", false}, {"swiglu_limit", 7.0}, {"hidden_act", "silu"},
            {"rope_parameters", {{"rope_type", "yarn"}, {"rope_theta", 150000.0}, {"factor", 4.0}, {"beta_fast", 32.0},
                                 {"beta_slow", 1.0}, {"original_max_position_embeddings", 64}, {"truncate", false}}}};
  if (mxfp4) c["quantization_config"] = {{"quant_method", "mxfp4"}, {"modules_to_not_convert", {"model.layers.*.self_attn"}}};
  return c;
}

json qwen2moe_config() {
  return {{"architectures", {"Qwen2MoeForCausalLM"}}, {"model_type", "qwen2_moe"}, {"vocab_size", kVocab},
          {"hidden_size", Qwen2Moe::H}, {"intermediate_size", Qwen2Moe::Fd}, {"num_hidden_layers", Qwen2Moe::L},
          {"num_attention_heads", Qwen2Moe::nh}, {"num_key_value_heads", Qwen2Moe::nkv}, {"num_experts", Qwen2Moe::E},
          {"num_experts_per_tok", Qwen2Moe::k}, {"moe_intermediate_size", Qwen2Moe::F},
          {"shared_expert_intermediate_size", Qwen2Moe::Fs}, {"norm_topk_prob", false}, {"decoder_sparse_step", 1},
          {"mlp_only_layers", json::array()}, {"use_sliding_window", false}, {"rms_norm_eps", 1e-6},
          {"max_position_embeddings", 512}, {"tie_word_embeddings", false},
          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1000000.0}}}};
}

std::string layer(int64_t il) { return "model.layers." + std::to_string(il) + "."; }

void common_tensors(TinyCheckpoint& c, int64_t H) {
  c.normal("model.embed_tokens.weight", {kVocab, H}, 1.0f);
  c.normal("model.norm.weight", {H}, 0.2f, 1.0f);
  c.normal("lm_head.weight", {kVocab, H}, 2.0f / std::sqrt(float(H)));
}

// gpt-oss as transformers saves it (bf16), or with the experts in MXFP4 as the released files.
TinyCheckpoint gpt_oss_checkpoint(bool mxfp4) {
  using S = GptOss;
  TinyCheckpoint c(mxfp4 ? 3002 : 3001);
  common_tensors(c, S::H);
  const float sh = 1.0f / std::sqrt(float(S::H));
  for (int64_t il = 0; il < S::L; ++il) {
    const std::string p = layer(il);
    c.normal(p + "input_layernorm.weight", {S::H}, 0.2f, 1.0f);
    c.normal(p + "post_attention_layernorm.weight", {S::H}, 0.2f, 1.0f);
    for (const auto& [n, rows] : std::vector<std::pair<std::string, int64_t>>{
             {"q_proj", S::nh * S::hd}, {"k_proj", S::nkv * S::hd}, {"v_proj", S::nkv * S::hd}}) {
      c.normal(p + "self_attn." + n + ".weight", {rows, S::H}, sh);
      c.normal(p + "self_attn." + n + ".bias", {rows}, 0.1f);
    }
    c.normal(p + "self_attn.o_proj.weight", {S::H, S::nh * S::hd}, 1.0f / std::sqrt(float(S::nh * S::hd)));
    c.normal(p + "self_attn.o_proj.bias", {S::H}, 0.1f);
    c.normal(p + "self_attn.sinks", {S::nh}, 1.0f);
    c.normal(p + "mlp.router.weight", {S::E, S::H}, 3.0f * sh);
    c.normal(p + "mlp.router.bias", {S::E}, 0.1f);
    const std::string x = p + "mlp.experts.";
    if (mxfp4) {
      // E8M0 scales 2^-6..2^-4 times E2M1 values up to 6: weights of about the bf16 spread.
      c.bytes(x + "gate_up_proj_blocks", {S::E, 2 * S::F, S::H / 32, 16}, 0, 255);
      c.bytes(x + "gate_up_proj_scales", {S::E, 2 * S::F, S::H / 32}, 121, 123);
      c.bytes(x + "down_proj_blocks", {S::E, S::H, S::F / 32, 16}, 0, 255);
      c.bytes(x + "down_proj_scales", {S::E, S::H, S::F / 32}, 121, 123);
    } else {
      c.normal(x + "gate_up_proj", {S::E, S::H, 2 * S::F}, sh);
      c.normal(x + "down_proj", {S::E, S::F, S::H}, 1.0f / std::sqrt(float(S::F)));
    }
    c.normal(x + "gate_up_proj_bias", {S::E, 2 * S::F}, 0.1f);
    c.normal(x + "down_proj_bias", {S::E, S::H}, 0.1f);
  }
  return c;
}

// qwen2moe per expert (the hub's layout) or fused (transformers v5: gate_up_proj [E, 2F, H]).
TinyCheckpoint qwen2moe_checkpoint(bool fused) {
  using S = Qwen2Moe;
  TinyCheckpoint c(fused ? 4002 : 4001);
  common_tensors(c, S::H);
  const float sh = 1.0f / std::sqrt(float(S::H));
  const int64_t hd = S::H / S::nh;
  for (int64_t il = 0; il < S::L; ++il) {
    const std::string p = layer(il);
    c.normal(p + "input_layernorm.weight", {S::H}, 0.2f, 1.0f);
    c.normal(p + "post_attention_layernorm.weight", {S::H}, 0.2f, 1.0f);
    for (const auto& [n, rows] : std::vector<std::pair<std::string, int64_t>>{
             {"q_proj", S::nh * hd}, {"k_proj", S::nkv * hd}, {"v_proj", S::nkv * hd}}) {
      c.normal(p + "self_attn." + n + ".weight", {rows, S::H}, sh);
      c.normal(p + "self_attn." + n + ".bias", {rows}, 0.1f);
    }
    c.normal(p + "self_attn.o_proj.weight", {S::H, S::nh * hd}, sh);
    c.normal(p + "mlp.gate.weight", {S::E, S::H}, 3.0f * sh);
    if (fused) {
      c.normal(p + "mlp.experts.gate_up_proj", {S::E, 2 * S::F, S::H}, sh);
      c.normal(p + "mlp.experts.down_proj", {S::E, S::H, S::F}, 1.0f / std::sqrt(float(S::F)));
    } else {
      for (int64_t e = 0; e < S::E; ++e) {
        const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
        c.normal(x + "gate_proj.weight", {S::F, S::H}, sh);
        c.normal(x + "up_proj.weight", {S::F, S::H}, sh);
        c.normal(x + "down_proj.weight", {S::H, S::F}, 1.0f / std::sqrt(float(S::F)));
      }
    }
    c.normal(p + "mlp.shared_expert.gate_proj.weight", {S::Fs, S::H}, sh);
    c.normal(p + "mlp.shared_expert.up_proj.weight", {S::Fs, S::H}, sh);
    c.normal(p + "mlp.shared_expert.down_proj.weight", {S::H, S::Fs}, 1.0f / std::sqrt(float(S::Fs)));
    c.normal(p + "mlp.shared_expert_gate.weight", {1, S::H}, sh);
  }
  return c;
}

json glm4moe_config() {
  return {{"architectures", {"Glm4MoeForCausalLM"}}, {"model_type", "glm4_moe"}, {"vocab_size", kVocab},
          {"hidden_size", Glm::H}, {"intermediate_size", Glm::Fd}, {"num_hidden_layers", Glm::L},
          {"num_attention_heads", Glm::nh}, {"num_key_value_heads", Glm::nkv}, {"head_dim", Glm::hd},
          {"n_routed_experts", Glm::E}, {"num_experts_per_tok", Glm::k}, {"moe_intermediate_size", Glm::F},
          {"n_shared_experts", 1}, {"first_k_dense_replace", 1}, {"routed_scaling_factor", 2.5}, {"n_group", 1},
          {"topk_group", 1}, {"norm_topk_prob", true}, {"use_qk_norm", true}, {"attention_bias", true},
          {"hidden_act", "silu"}, {"num_nextn_predict_layers", 1}, {"rms_norm_eps", 1e-5},
          {"max_position_embeddings", 512}, {"tie_word_embeddings", false},
          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1000000.0}, {"partial_rotary_factor", 0.5}}}};
}

// glm4moe as the hub's GLM-4.5 files hold it: per-expert tensors, and the MTP layer as
// model.layers.{L} (a MoE layer plus eh_proj, enorm, hnorm, shared_head.*, embed_tokens).
TinyCheckpoint glm4moe_checkpoint() {
  using S = Glm;
  TinyCheckpoint c(5001);
  common_tensors(c, S::H);
  const float sh = 1.0f / std::sqrt(float(S::H));
  for (int64_t il = 0; il <= S::L; ++il) {
    const std::string p = layer(il);
    c.normal(p + "input_layernorm.weight", {S::H}, 0.2f, 1.0f);
    c.normal(p + "post_attention_layernorm.weight", {S::H}, 0.2f, 1.0f);
    for (const auto& [n, rows] : std::vector<std::pair<std::string, int64_t>>{
             {"q_proj", S::nh * S::hd}, {"k_proj", S::nkv * S::hd}, {"v_proj", S::nkv * S::hd}}) {
      c.normal(p + "self_attn." + n + ".weight", {rows, S::H}, sh);
      c.normal(p + "self_attn." + n + ".bias", {rows}, 0.1f);
    }
    c.normal(p + "self_attn.q_norm.weight", {S::hd}, 0.2f, 1.0f);
    c.normal(p + "self_attn.k_norm.weight", {S::hd}, 0.2f, 1.0f);
    c.normal(p + "self_attn.o_proj.weight", {S::H, S::nh * S::hd}, sh);
    if (il == 0) {
      c.normal(p + "mlp.gate_proj.weight", {S::Fd, S::H}, sh);
      c.normal(p + "mlp.up_proj.weight", {S::Fd, S::H}, sh);
      c.normal(p + "mlp.down_proj.weight", {S::H, S::Fd}, 1.0f / std::sqrt(float(S::Fd)));
      continue;
    }
    c.normal(p + "mlp.gate.weight", {S::E, S::H}, 3.0f * sh);
    c.normal(p + "mlp.gate.e_score_correction_bias", {S::E}, 0.3f);
    for (int64_t e = 0; e < S::E; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      c.normal(x + "gate_proj.weight", {S::F, S::H}, sh);
      c.normal(x + "up_proj.weight", {S::F, S::H}, sh);
      c.normal(x + "down_proj.weight", {S::H, S::F}, 1.0f / std::sqrt(float(S::F)));
    }
    c.normal(p + "mlp.shared_experts.gate_proj.weight", {S::F, S::H}, sh);
    c.normal(p + "mlp.shared_experts.up_proj.weight", {S::F, S::H}, sh);
    c.normal(p + "mlp.shared_experts.down_proj.weight", {S::H, S::F}, 1.0f / std::sqrt(float(S::F)));
  }
  const std::string m = layer(S::L);
  c.normal(m + "eh_proj.weight", {S::H, 2 * S::H}, 1.0f / std::sqrt(float(2 * S::H)));
  c.normal(m + "enorm.weight", {S::H}, 0.2f, 1.0f);
  c.normal(m + "hnorm.weight", {S::H}, 0.2f, 1.0f);
  c.normal(m + "shared_head.norm.weight", {S::H}, 0.2f, 1.0f);
  c.normal(m + "shared_head.head.weight", {kVocab, S::H}, sh);
  c.normal(m + "embed_tokens.weight", {kVocab, S::H}, 1.0f);
  return c;
}

json qwen35moe_config() {
  return {{"architectures", {"Qwen3_5MoeForCausalLM"}}, {"model_type", "qwen3_5_moe_text"}, {"vocab_size", kVocab},
          {"hidden_size", Q35::H}, {"num_hidden_layers", Q35::L}, {"num_attention_heads", Q35::nh},
          {"num_key_value_heads", Q35::nkv}, {"head_dim", Q35::hd}, {"layer_types", {"linear_attention", "full_attention"}},
          {"linear_conv_kernel_dim", Q35::K}, {"linear_key_head_dim", Q35::dk}, {"linear_value_head_dim", Q35::dk},
          {"linear_num_key_heads", Q35::nk}, {"linear_num_value_heads", Q35::nv}, {"num_experts", Q35::E},
          {"num_experts_per_tok", 2}, {"moe_intermediate_size", Q35::F}, {"shared_expert_intermediate_size", Q35::F},
          {"norm_topk_prob", true}, {"rms_norm_eps", 1e-6}, {"max_position_embeddings", 512}, {"mtp_num_hidden_layers", 1},
          {"tie_word_embeddings", false},
          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1e7}, {"partial_rotary_factor", 0.25},
                               {"mrope_section", {2, 1, 1}}, {"mrope_interleaved", true}}}};
}

// Qwen3.5-MoE with its MTP block (mtp.layers.0 plus mtp.fc / pre_fc_norm_* / norm). Its RMSNorm
// weights are offsets from one (mean 0 here).
TinyCheckpoint qwen35moe_checkpoint() {
  using S = Q35;
  TinyCheckpoint c(6001);
  common_tensors(c, S::H);
  const float sh = 1.0f / std::sqrt(float(S::H));
  for (int64_t il = 0; il <= S::L; ++il) {
    const std::string p = il < S::L ? layer(il) : "mtp.layers.0.";
    c.normal(p + "input_layernorm.weight", {S::H}, 0.2f);
    c.normal(p + "post_attention_layernorm.weight", {S::H}, 0.2f);
    if (il == 0) {
      const std::string a = p + "linear_attn.";
      c.normal(a + "in_proj_qkv.weight", {S::C, S::H}, sh);
      c.normal(a + "in_proj_z.weight", {S::nv * S::dk, S::H}, sh);
      c.normal(a + "in_proj_b.weight", {S::nv, S::H}, sh);
      c.normal(a + "in_proj_a.weight", {S::nv, S::H}, sh);
      c.normal(a + "conv1d.weight", {S::C, 1, S::K}, 0.5f);
      c.normal(a + "dt_bias", {S::nv}, 0.5f);
      c.normal(a + "A_log", {S::nv}, 0.5f);
      c.normal(a + "norm.weight", {S::dk}, 0.2f, 1.0f);
      c.normal(a + "out_proj.weight", {S::H, S::nv * S::dk}, 1.0f / std::sqrt(float(S::nv * S::dk)));
    } else {
      c.normal(p + "self_attn.q_proj.weight", {2 * S::nh * S::hd, S::H}, sh);
      c.normal(p + "self_attn.k_proj.weight", {S::nkv * S::hd, S::H}, sh);
      c.normal(p + "self_attn.v_proj.weight", {S::nkv * S::hd, S::H}, sh);
      c.normal(p + "self_attn.o_proj.weight", {S::H, S::nh * S::hd}, 1.0f / std::sqrt(float(S::nh * S::hd)));
      c.normal(p + "self_attn.q_norm.weight", {S::hd}, 0.2f);
      c.normal(p + "self_attn.k_norm.weight", {S::hd}, 0.2f);
    }
    c.normal(p + "mlp.gate.weight", {S::E, S::H}, 3.0f * sh);
    for (int64_t e = 0; e < S::E; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      c.normal(x + "gate_proj.weight", {S::F, S::H}, sh);
      c.normal(x + "up_proj.weight", {S::F, S::H}, sh);
      c.normal(x + "down_proj.weight", {S::H, S::F}, 1.0f / std::sqrt(float(S::F)));
    }
    c.normal(p + "mlp.shared_expert.gate_proj.weight", {S::F, S::H}, sh);
    c.normal(p + "mlp.shared_expert.up_proj.weight", {S::F, S::H}, sh);
    c.normal(p + "mlp.shared_expert.down_proj.weight", {S::H, S::F}, 1.0f / std::sqrt(float(S::F)));
    c.normal(p + "mlp.shared_expert_gate.weight", {1, S::H}, sh);
  }
  c.normal("mtp.fc.weight", {S::H, 2 * S::H}, 1.0f / std::sqrt(float(2 * S::H)));
  c.normal("mtp.pre_fc_norm_embedding.weight", {S::H}, 0.2f);
  c.normal("mtp.pre_fc_norm_hidden.weight", {S::H}, 0.2f);
  c.normal("mtp.norm.weight", {S::H}, 0.2f);
  return c;
}

// A checkpoint folder: config.json, model.safetensors, the tiny tokenizer.
void write_dir(const std::string& dir, const json& cfg, const TinyCheckpoint& c, bool o200k) {
  fs::create_directories(dir);
  std::ofstream(dir + "/config.json") << cfg.dump(1);
  c.write(dir + "/model.safetensors");
  if (o200k) {
    write_tiny_tokenizer(dir, kVocab, o200k_regex(), {"<|start|>", "<|message|>", "<|end|>", "<|return|>"}, "<|return|>",
                         kTemplate);
  } else if (cfg.value("model_type", "") == "glm4_moe") {   // GLM-4.5's own special tokens
    write_tiny_tokenizer(dir, kVocab, qwen2_regex(), {"<|endoftext|>", "[gMASK]", "<|user|>", "<|observation|>"},
                         "<|endoftext|>", kTemplate);
  } else {
    write_tiny_tokenizer(dir, kVocab, qwen2_regex(), {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}, "<|im_end|>", kTemplate);
  }
}

struct Case {
  std::string name;
  json config;
  TinyCheckpoint ckpt;
  bool o200k;
};

std::vector<Case> make_cases() {
  std::vector<Case> v;
  v.push_back({"gpt_oss_bf16", gpt_oss_config(false), gpt_oss_checkpoint(false), true});
  v.push_back({"gpt_oss_mxfp4", gpt_oss_config(true), gpt_oss_checkpoint(true), true});
  v.push_back({"qwen2moe_split", qwen2moe_config(), qwen2moe_checkpoint(false), false});
  v.push_back({"qwen2moe_fused", qwen2moe_config(), qwen2moe_checkpoint(true), false});
  v.push_back({"glm4moe_mtp", glm4moe_config(), glm4moe_checkpoint(), false});
  v.push_back({"qwen35moe_mtp", qwen35moe_config(), qwen35moe_checkpoint(), false});
  return v;
}

std::vector<int32_t> prompt() {
  std::vector<int32_t> t(kTokens);
  for (int i = 0; i < kTokens; ++i) t[i] = (i * 37 + 11) % 290;
  return t;
}

// ---- one conversion of each case, and one llama.cpp run over all of them ----

class ConvertArch : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    scratch_ = new Scratch("convert-arch");
    cases_ = new std::vector<Case>(make_cases());
    json jobs = json::array();
    for (const Case& c : *cases_) {
      write_dir(scratch_->file(c.name), c.config, c.ckpt, c.o200k);
      ConvertOptions opt;
      opt.hf_dir = scratch_->file(c.name);
      opt.out_path = gguf_path(c.name);
      opt.outtype = TensorType::F32;
      convert_hf_to_gguf(opt);
      jobs.push_back({{"gguf", gguf_path(c.name)}, {"tokens", prompt()}, {"n_greedy", 1},
                      {"logits_out", gguf_path(c.name) + ".llama.f32"},
                      {"texts", {"12345", "hello world", "<|start|>hello"}}});
    }
    std::ofstream(scratch_->file("job.json")) << jobs.dump();
  }
  static void TearDownTestSuite() {
    delete cases_;
    delete scratch_;
  }
  static std::string gguf_path(const std::string& name) { return scratch_->file(name + ".f32.gguf"); }
  static const Case& find_case(const std::string& name) {
    for (const Case& c : *cases_)
      if (c.name == name) return c;
    throw std::runtime_error("no case " + name);
  }
  // llama.cpp over every case (once; the first test that asks runs it).
  static const json& llama_report() {
    static const json report = [] {
      const std::string oracle = std::string(MORAINE_SOURCE_DIR) + "/.cache/oracle";
      if (!fs::exists(oracle + "/node_modules/node-llama-cpp/package.json")) {
        throw std::runtime_error("llama.cpp oracle missing at " + oracle + ": run tests/oracle/setup");
      }
      const std::string script = std::string(MORAINE_SOURCE_DIR) + "/tests/convert/llama_golden.mjs";
      const std::string cmd = "node " + shell_quote(script) + " " + shell_quote(oracle) + " " +
                              shell_quote(scratch_->file("job.json")) + " >" + shell_quote(scratch_->file("report.json")) +
                              " 2>" + shell_quote(scratch_->file("node.stderr"));
      if (std::system(cmd.c_str()) != 0) throw std::runtime_error("node failed:\n" + read_text(scratch_->file("node.stderr")));
      return read_json(scratch_->file("report.json"));
    }();
    return report;
  }
  static Scratch* scratch_;
  static std::vector<Case>* cases_;
};
Scratch* ConvertArch::scratch_ = nullptr;
std::vector<Case>* ConvertArch::cases_ = nullptr;

// Row r of a bound matrix, dequantized.
std::vector<float> row_of(const model::Matrix& m, int64_t r) {
  std::vector<float> out(static_cast<size_t>(m.n_cols));
  dequantize_row(m.type, m.row(r), out.data(), m.n_cols);
  return out;
}

// The checkpoint's MXFP4 value: E2M1 code (element 2i in byte i's low nibble, 2i+1 in its high
// one) times 2^(scale - 127); decoded here from the OCP definition, not from ggml's tables.
float mxfp4_value(const std::vector<uint8_t>& blocks, const std::vector<uint8_t>& scales, int64_t row, int64_t nb,
                  int64_t col) {
  static const float e2m1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  const int64_t b = col / 32, j = col % 32;
  const uint8_t byte = blocks[static_cast<size_t>((row * nb + b) * 16 + j / 2)];
  return e2m1[j % 2 == 0 ? byte & 15 : byte >> 4] * std::ldexp(1.0f, int(scales[static_cast<size_t>(row * nb + b)]) - 127);
}

TEST_F(ConvertArch, GptOssMetadataSaysWhatConfigSays) {
  for (const char* name : {"gpt_oss_bf16", "gpt_oss_mxfp4"}) {
    SCOPED_TRACE(name);
    const GgufFile f = GgufFile::open(gguf_path(name));
    EXPECT_EQ(f.get_string("general.architecture"), "gpt-oss");
    EXPECT_EQ(f.get_u64("gpt-oss.block_count"), 4u);
    EXPECT_EQ(f.get_u64("gpt-oss.context_length"), 256u);
    EXPECT_EQ(f.get_u64("gpt-oss.embedding_length"), 96u);
    EXPECT_EQ(f.get_u64("gpt-oss.feed_forward_length"), 32u);
    EXPECT_EQ(f.get_u64("gpt-oss.expert_feed_forward_length"), 32u);
    EXPECT_EQ(f.get_u64("gpt-oss.attention.head_count"), 4u);
    EXPECT_EQ(f.get_u64("gpt-oss.attention.head_count_kv"), 2u);
    EXPECT_EQ(f.get_u64("gpt-oss.attention.key_length"), 16u);
    EXPECT_EQ(f.get_u64("gpt-oss.expert_count"), 4u);
    EXPECT_EQ(f.get_u64("gpt-oss.expert_used_count"), 2u);
    EXPECT_EQ(f.get_u64("gpt-oss.attention.sliding_window"), 4u);
    EXPECT_EQ(f.get_string("gpt-oss.rope.scaling.type"), "yarn");
    EXPECT_FLOAT_EQ(static_cast<float>(*f.get_f64("gpt-oss.rope.scaling.factor")), 4.0f);
    EXPECT_EQ(f.get_u64("gpt-oss.rope.scaling.original_context_length"), 64u);
    EXPECT_FLOAT_EQ(static_cast<float>(*f.get_f64("gpt-oss.rope.scaling.yarn_beta_fast")), 32.0f);
    EXPECT_FLOAT_EQ(static_cast<float>(*f.get_f64("gpt-oss.rope.freq_base")), 150000.0f);
    EXPECT_FLOAT_EQ(static_cast<float>(*f.get_f64("gpt-oss.attention.layer_norm_rms_epsilon")), 1e-5f);
    EXPECT_EQ(f.get_string("tokenizer.ggml.pre"), "gpt-4o");
    EXPECT_EQ(f.get_string("tokenizer.chat_template"), kTemplate);
    EXPECT_EQ(f.get_u64("tokenizer.ggml.eos_token_id"), static_cast<uint64_t>(kVocab - 1));   // <|return|>

    // The loader reads the same settings back.
    const model::Model m = model::Model::load(gguf_path(name));
    EXPECT_EQ(m.hp.sliding_window, 4);
    ASSERT_EQ(m.hp.swa_layers.size(), 4u);
    for (int64_t il = 0; il < 4; ++il) EXPECT_EQ(m.hp.swa_layers[il], il % 2 == 0) << "layer " << il;
    EXPECT_EQ(m.hp.rope_scaling, model::RopeScaling::Yarn);
    EXPECT_EQ(m.hp.rope_orig_ctx, 64);
    EXPECT_EQ(m.hp.n_ff_exp, 32);
    EXPECT_EQ(m.layers[0].recipe.ffn.router.kind, model::RouterKind::TopKSoftmax);
  }
}

TEST_F(ConvertArch, GptOssTensorsLandWhereTheDescriptionSays) {
  using S = GptOss;
  const Case& c = find_case("gpt_oss_bf16");
  const model::Model m = model::Model::load(gguf_path(c.name));
  for (int64_t il = 0; il < S::L; ++il) {
    SCOPED_TRACE("layer " + std::to_string(il));
    const std::string p = layer(il);
    const model::LayerWeights& L = m.layers[static_cast<size_t>(il)];
    EXPECT_EQ(L.attn.sinks, c.ckpt.f(p + "self_attn.sinks"));
    EXPECT_EQ(L.attn.q_bias, c.ckpt.f(p + "self_attn.q_proj.bias"));
    EXPECT_EQ(L.attn.k_bias, c.ckpt.f(p + "self_attn.k_proj.bias"));
    EXPECT_EQ(L.attn.v_bias, c.ckpt.f(p + "self_attn.v_proj.bias"));
    EXPECT_EQ(L.attn.o_bias, c.ckpt.f(p + "self_attn.o_proj.bias"));
    EXPECT_EQ(L.moe.router_bias, c.ckpt.f(p + "mlp.router.bias"));
    EXPECT_EQ(L.attn_norm, c.ckpt.f(p + "input_layernorm.weight"));
    EXPECT_EQ(L.ffn_norm, c.ckpt.f(p + "post_attention_layernorm.weight"));
    const std::vector<float>& q = c.ckpt.f(p + "self_attn.q_proj.weight");
    EXPECT_EQ(row_of(L.attn.q, 5), std::vector<float>(q.begin() + 5 * S::H, q.begin() + 6 * S::H));
    // gate_up_proj [E, H, 2F]: gate = even columns, up = odd ones, each expert transposed.
    const std::vector<float>& gu = c.ckpt.f(p + "mlp.experts.gate_up_proj");
    const std::vector<float>& dn = c.ckpt.f(p + "mlp.experts.down_proj");
    const std::vector<float>& gub = c.ckpt.f(p + "mlp.experts.gate_up_proj_bias");
    ASSERT_EQ(L.moe.gate_bias.size(), static_cast<size_t>(S::E * S::F));
    for (int64_t e = 0; e < S::E; ++e) {
      for (int64_t f = 0; f < S::F; ++f) {
        const std::vector<float> g = row_of(L.moe.gate.expert(e), f), u = row_of(L.moe.up.expert(e), f);
        for (int64_t h = 0; h < S::H; ++h) {
          ASSERT_EQ(g[h], gu[(e * S::H + h) * 2 * S::F + 2 * f]) << "gate e" << e << " f" << f << " h" << h;
          ASSERT_EQ(u[h], gu[(e * S::H + h) * 2 * S::F + 2 * f + 1]) << "up e" << e << " f" << f << " h" << h;
        }
        ASSERT_EQ(L.moe.gate_bias[e * S::F + f], gub[e * 2 * S::F + 2 * f]) << "gate bias e" << e << " f" << f;
        ASSERT_EQ(L.moe.up_bias[e * S::F + f], gub[e * 2 * S::F + 2 * f + 1]) << "up bias e" << e << " f" << f;
      }
      for (int64_t h = 0; h < S::H; ++h) {
        const std::vector<float> d = row_of(L.moe.down.expert(e), h);
        for (int64_t f = 0; f < S::F; ++f) ASSERT_EQ(d[f], dn[(e * S::F + f) * S::H + h]) << "down e" << e << " h" << h;
      }
    }
    EXPECT_EQ(L.moe.down_bias, c.ckpt.f(p + "mlp.experts.down_proj_bias"));
  }
}

TEST_F(ConvertArch, GptOssMxfp4BlocksAreRepackedLosslessly) {
  using S = GptOss;
  const Case& c = find_case("gpt_oss_mxfp4");
  const model::Model m = model::Model::load(gguf_path(c.name));
  for (int64_t il = 0; il < S::L; ++il) {
    SCOPED_TRACE("layer " + std::to_string(il));
    const std::string x = layer(il) + "mlp.experts.";
    const model::LayerWeights& L = m.layers[static_cast<size_t>(il)];
    ASSERT_EQ(L.moe.gate.all.type, TensorType::MXFP4);
    ASSERT_EQ(L.moe.up.all.type, TensorType::MXFP4);
    ASSERT_EQ(L.moe.down.all.type, TensorType::MXFP4);
    EXPECT_EQ(L.attn.q.type, TensorType::F32);
    const auto& gb = c.ckpt.u8(x + "gate_up_proj_blocks");
    const auto& gs = c.ckpt.u8(x + "gate_up_proj_scales");
    const auto& db = c.ckpt.u8(x + "down_proj_blocks");
    const auto& ds = c.ckpt.u8(x + "down_proj_scales");
    for (int64_t e = 0; e < S::E; ++e) {
      for (int64_t f = 0; f < S::F; ++f) {
        // HF rows interleave gate (even) and up (odd), as in the bf16 layout.
        const std::vector<float> g = row_of(L.moe.gate.expert(e), f), u = row_of(L.moe.up.expert(e), f);
        for (int64_t h = 0; h < S::H; ++h) {
          ASSERT_EQ(g[h], mxfp4_value(gb, gs, e * 2 * S::F + 2 * f, S::H / 32, h)) << "gate e" << e << " f" << f << " h" << h;
          ASSERT_EQ(u[h], mxfp4_value(gb, gs, e * 2 * S::F + 2 * f + 1, S::H / 32, h)) << "up e" << e << " f" << f;
        }
      }
      for (int64_t h = 0; h < S::H; ++h) {
        const std::vector<float> d = row_of(L.moe.down.expert(e), h);
        for (int64_t f = 0; f < S::F; ++f) ASSERT_EQ(d[f], mxfp4_value(db, ds, e * S::H + h, S::F / 32, f)) << "down e" << e;
      }
    }
    const std::vector<float>& gub = c.ckpt.f(x + "gate_up_proj_bias");
    for (int64_t i = 0; i < S::E * S::F; ++i) ASSERT_EQ(L.moe.up_bias[i], gub[(i / S::F) * 2 * S::F + 2 * (i % S::F) + 1]);
  }
  // MXFP4 stays MXFP4 whatever the output type; the other matrices take it.
  ConvertOptions opt;
  opt.hf_dir = scratch_->file(c.name);
  opt.out_path = scratch_->file("mxfp4.q8_0.gguf");
  opt.outtype = TensorType::Q8_0;
  convert_hf_to_gguf(opt);
  const GgufFile f = GgufFile::open(opt.out_path);
  EXPECT_EQ(f.find_tensor("blk.0.ffn_gate_exps.weight")->type, TensorType::MXFP4);
  EXPECT_EQ(f.find_tensor("blk.0.attn_q.weight")->type, TensorType::Q8_0);
  EXPECT_EQ(f.find_tensor("blk.0.ffn_gate_exps.bias")->type, TensorType::F32);
}

TEST_F(ConvertArch, Qwen2MoeTensorsLandWhereTheDescriptionSays) {
  using S = Qwen2Moe;
  for (const char* name : {"qwen2moe_split", "qwen2moe_fused"}) {
    SCOPED_TRACE(name);
    const Case& c = find_case(name);
    const GgufFile f = GgufFile::open(gguf_path(name));
    EXPECT_EQ(f.get_string("general.architecture"), "qwen2moe");
    EXPECT_EQ(f.get_u64("qwen2moe.expert_shared_feed_forward_length"), 48u);
    EXPECT_EQ(f.get_u64("qwen2moe.expert_feed_forward_length"), 40u);
    EXPECT_EQ(f.get_u64("qwen2moe.feed_forward_length"), 96u);
    EXPECT_EQ(f.find("qwen2moe.attention.key_length"), nullptr);   // config.json has no head_dim
    EXPECT_EQ(f.get_string("tokenizer.ggml.pre"), "qwen2");
    EXPECT_EQ(f.find_tensor("blk.0.ffn_gate_inp_shexp.weight")->shape, (std::vector<int64_t>{S::H, 1}));
    const model::Model m = model::Model::load(gguf_path(name));
    EXPECT_FALSE(m.hp.norm_topk_prob);
    EXPECT_FALSE(m.layers[0].recipe.ffn.router.renormalize);
    for (int64_t il = 0; il < S::L; ++il) {
      const std::string p = layer(il);
      const model::LayerWeights& L = m.layers[static_cast<size_t>(il)];
      EXPECT_EQ(L.attn.q_bias, c.ckpt.f(p + "self_attn.q_proj.bias"));
      EXPECT_EQ(L.attn.k_bias, c.ckpt.f(p + "self_attn.k_proj.bias"));
      EXPECT_EQ(L.attn.v_bias, c.ckpt.f(p + "self_attn.v_proj.bias"));
      EXPECT_TRUE(L.attn.o_bias.empty());
      EXPECT_EQ(L.moe.shared_router, c.ckpt.f(p + "mlp.shared_expert_gate.weight"));
      const std::vector<float>& sd = c.ckpt.f(p + "mlp.shared_expert.down_proj.weight");
      EXPECT_EQ(row_of(L.moe.shared_down, 3), std::vector<float>(sd.begin() + 3 * S::Fs, sd.begin() + 4 * S::Fs));
      for (int64_t e = 0; e < S::E; ++e) {
        for (int64_t f = 0; f < S::F; ++f) {
          std::vector<float> want_g, want_u;
          if (c.name == "qwen2moe_fused") {   // [E, 2F, H]: gate rows first
            const std::vector<float>& gu = c.ckpt.f(p + "mlp.experts.gate_up_proj");
            want_g.assign(gu.begin() + (e * 2 * S::F + f) * S::H, gu.begin() + (e * 2 * S::F + f + 1) * S::H);
            want_u.assign(gu.begin() + (e * 2 * S::F + S::F + f) * S::H, gu.begin() + (e * 2 * S::F + S::F + f + 1) * S::H);
          } else {
            const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
            const std::vector<float>& g = c.ckpt.f(x + "gate_proj.weight");
            const std::vector<float>& u = c.ckpt.f(x + "up_proj.weight");
            want_g.assign(g.begin() + f * S::H, g.begin() + (f + 1) * S::H);
            want_u.assign(u.begin() + f * S::H, u.begin() + (f + 1) * S::H);
          }
          ASSERT_EQ(row_of(L.moe.gate.expert(e), f), want_g) << "layer " << il << " expert " << e << " row " << f;
          ASSERT_EQ(row_of(L.moe.up.expert(e), f), want_u) << "layer " << il << " expert " << e << " row " << f;
        }
      }
    }
  }
}

TEST_F(ConvertArch, Glm4MoeKeysAndItsMtpLayerAreLlamaCpps) {
  using S = Glm;
  const Case& c = find_case("glm4moe_mtp");
  const GgufFile f = GgufFile::open(gguf_path(c.name));
  const std::string a = "glm4moe.";
  EXPECT_EQ(f.get_string("general.architecture"), "glm4moe");
  EXPECT_EQ(f.get_u64(a + "block_count"), uint64_t(S::L + 1));   // the trunk and the nextn layer
  EXPECT_EQ(f.get_u64(a + "nextn_predict_layers"), 1u);
  EXPECT_EQ(f.get_u64(a + "expert_count"), uint64_t(S::E));
  EXPECT_EQ(f.get_u64(a + "expert_feed_forward_length"), uint64_t(S::F));
  EXPECT_EQ(f.get_u64(a + "feed_forward_length"), uint64_t(S::Fd));
  EXPECT_EQ(f.get_u64(a + "expert_shared_count"), 1u);
  EXPECT_EQ(f.get_u64(a + "leading_dense_block_count"), 1u);
  EXPECT_EQ(f.get_u64(a + "expert_gating_func"), 2u);
  EXPECT_FLOAT_EQ(static_cast<float>(*f.get_f64(a + "expert_weights_scale")), 2.5f);
  EXPECT_EQ(f.get_bool(a + "expert_weights_norm"), true);
  EXPECT_EQ(f.get_u64(a + "expert_group_count"), 1u);
  EXPECT_EQ(f.get_u64(a + "expert_group_used_count"), 1u);
  EXPECT_EQ(f.get_u64(a + "rope.dimension_count"), uint64_t(S::n_rot));
  EXPECT_EQ(f.get_u64(a + "attention.key_length"), uint64_t(S::hd));
  // The special tokens llama.cpp's GLM vocabulary sets besides the files' eos (the top four ids).
  EXPECT_EQ(f.get_u64("tokenizer.ggml.eos_token_id"), uint64_t(kVocab - 4));
  EXPECT_EQ(f.get_u64("tokenizer.ggml.unknown_token_id"), uint64_t(kVocab - 4));
  EXPECT_EQ(f.get_u64("tokenizer.ggml.bos_token_id"), uint64_t(kVocab - 3));
  EXPECT_EQ(f.get_u64("tokenizer.ggml.eot_token_id"), uint64_t(kVocab - 2));
  EXPECT_EQ(f.get_u64("tokenizer.ggml.eom_token_id"), uint64_t(kVocab - 1));
  const model::Model m = model::Model::load(gguf_path(c.name));
  ASSERT_EQ(m.hp.n_layer, S::L);
  ASSERT_EQ(m.nextn.size(), 1u);
  EXPECT_TRUE(m.hp.attn_qk_norm);
  EXPECT_EQ(m.layers[0].recipe.ffn.kind, model::FfnKind::Dense);
  EXPECT_EQ(row_of(m.layers[0].dense.down, 5), std::vector<float>(c.ckpt.f(layer(0) + "mlp.down_proj.weight").begin() + 5 * S::Fd,
                                                                   c.ckpt.f(layer(0) + "mlp.down_proj.weight").begin() + 6 * S::Fd));
  EXPECT_EQ(m.layers[1].moe.score_bias, c.ckpt.f(layer(1) + "mlp.gate.e_score_correction_bias"));
  EXPECT_EQ(m.layers[1].attn.q_norm, c.ckpt.f(layer(1) + "self_attn.q_norm.weight"));
  // The nextn layer: its own block, the projections, its embedding and head (no transform).
  const std::string p = layer(S::L);
  const model::NextnWeights& n = m.nextn[0];
  EXPECT_EQ(n.enorm, c.ckpt.f(p + "enorm.weight"));
  EXPECT_EQ(n.hnorm, c.ckpt.f(p + "hnorm.weight"));
  EXPECT_EQ(n.shared_head_norm, c.ckpt.f(p + "shared_head.norm.weight"));
  const auto rows = [](const std::vector<float>& v, int64_t r, int64_t w) {
    return std::vector<float>(v.begin() + r * w, v.begin() + (r + 1) * w);
  };
  EXPECT_EQ(row_of(n.eh_proj, 7), rows(c.ckpt.f(p + "eh_proj.weight"), 7, 2 * S::H));
  EXPECT_EQ(row_of(n.embed_tokens, 123), rows(c.ckpt.f(p + "embed_tokens.weight"), 123, S::H));
  EXPECT_EQ(row_of(n.shared_head_head, 9), rows(c.ckpt.f(p + "shared_head.head.weight"), 9, S::H));
  EXPECT_EQ(n.block.moe.score_bias, c.ckpt.f(p + "mlp.gate.e_score_correction_bias"));
  EXPECT_EQ(n.block.attn.k_bias, c.ckpt.f(p + "self_attn.k_proj.bias"));
  for (int64_t e = 0; e < S::E; ++e) {
    EXPECT_EQ(row_of(n.block.moe.up.expert(e), 3), rows(c.ckpt.f(p + "mlp.experts." + std::to_string(e) + ".up_proj.weight"), 3, S::H))
        << "expert " << e;
  }
  EXPECT_EQ(row_of(n.block.moe.shared_down, 2), rows(c.ckpt.f(p + "mlp.shared_experts.down_proj.weight"), 2, S::F));
}

TEST_F(ConvertArch, Qwen35MoeMtpBlockIsLlamaCpps) {
  const Case& c = find_case("qwen35moe_mtp");
  const GgufFile f = GgufFile::open(gguf_path(c.name));
  EXPECT_EQ(f.get_u64("qwen35moe.block_count"), uint64_t(Q35::L + 1));
  EXPECT_EQ(f.get_u64("qwen35moe.nextn_predict_layers"), 1u);
  const model::Model m = model::Model::load(gguf_path(c.name));
  ASSERT_EQ(m.nextn.size(), 1u);
  EXPECT_TRUE(m.layers[0].recurrent);
  std::vector<float> want = c.ckpt.f("mtp.pre_fc_norm_embedding.weight");
  for (float& x : want) x += 1.0f;
  EXPECT_EQ(m.nextn[0].enorm, want);
  const std::vector<float>& fc = c.ckpt.f("mtp.fc.weight");
  EXPECT_EQ(row_of(m.nextn[0].eh_proj, 5), std::vector<float>(fc.begin() + 5 * 2 * Q35::H, fc.begin() + 6 * 2 * Q35::H));
  EXPECT_EQ(m.nextn[0].block.attn.q_norm.size(), size_t(Q35::hd));
}

// max over positions of max |ours - llama| / max |llama|.
double worst_gap(const std::vector<float>& ours, const std::vector<float>& llama, int64_t n_vocab) {
  double worst = 0;
  for (int t = 0; t < kTokens; ++t) {
    double mx = 0, gap = 0;
    for (int64_t v = 0; v < n_vocab; ++v) {
      const size_t i = static_cast<size_t>(t * n_vocab + v);
      EXPECT_TRUE(std::isfinite(ours[i])) << "position " << t;
      mx = std::max(mx, std::fabs(double(llama[i])));
      gap = std::max(gap, std::fabs(double(ours[i]) - llama[i]));
    }
    EXPECT_GT(mx, 0.5) << "position " << t << ": flat logits test little";
    worst = std::max(worst, gap / mx);
  }
  return worst;
}

TEST_F(ConvertArch, LlamaCppAndTheReferenceAgreeOnEveryConvertedFile) {
  const json& report = llama_report();
  for (const Case& c : *cases_) {
    SCOPED_TRACE(c.name);
    const json& r = report.at(gguf_path(c.name));
    ASSERT_TRUE(r["loaded"].get<bool>()) << r.value("error", "");
    ASSERT_EQ(r["n_vocab"].get<int64_t>(), kVocab);
    const std::vector<float> ll = read_f32(gguf_path(c.name) + ".llama.f32");
    ASSERT_EQ(ll.size(), static_cast<size_t>(kTokens * kVocab));
    model::Model m = model::Model::load(gguf_path(c.name));
    model::check_supported(m, model::reference_support());
    round_yarn_as_llama_cpp(m);
    reference::ReferenceExecutor ex(m, {2});
    const std::vector<int32_t> tokens = prompt();
    const std::vector<float> ours = ex.forward(tokens, true);
    ASSERT_EQ(ours.size(), ll.size());
    const double worst = worst_gap(ours, ll, kVocab);
    std::printf("[ %s ] reference vs llama.cpp: worst max|diff|/max|logit| %.3g\n", c.name.c_str(), worst);
    // F32 (and MXFP4 experts on both sides): float order only, the arch tests' bound.
    EXPECT_LE(worst, 1e-4);
  }
}

TEST_F(ConvertArch, LlamaCppTokenizesWithThePreTokenizerWeNamed) {
  const json& report = llama_report();
  // o200k groups digits by three (\p{N}{1,3}); Qwen2's splits every digit.
  const int kO = 'o', kR = 'r', kL = 'l', kD = 'd';
  const json o200k = {{TinyVocab::k123, TinyVocab::k45},
                      {TinyVocab::kHello, TinyVocab::kSpW, kO, kR, kL, kD},
                      {kVocab - 4, TinyVocab::kHello}};   // <|start|> is a special token
  const auto bytes = [](const std::string& s) {
    json j = json::array();
    for (char ch : s) j.push_back(static_cast<int>(static_cast<unsigned char>(ch)));
    return j;
  };
  json qwen2 = {bytes("12345"), {TinyVocab::kHello, TinyVocab::kSpW, kO, kR, kL, kD}, bytes("<|start|>")};
  qwen2[2].push_back(TinyVocab::kHello);
  for (const Case& c : *cases_) {
    SCOPED_TRACE(c.name);
    const json& r = report.at(gguf_path(c.name));
    ASSERT_TRUE(r["loaded"].get<bool>()) << r.value("error", "");
    EXPECT_EQ(r["tokenized"], c.o200k ? o200k : qwen2);
  }
}

// ---- refusals: each a working case with one thing changed ----

std::string refusal(const json& cfg, TinyCheckpoint ckpt, bool o200k,
                    const std::function<void(std::vector<RawTensor>&)>& edit = {}) {
  Scratch s("convert-arch-refusal");
  if (edit) edit(ckpt.raw());
  write_dir(s.file("m"), cfg, ckpt, o200k);
  ConvertOptions opt;
  opt.hf_dir = s.file("m");
  opt.out_path = s.file("out.gguf");
  opt.outtype = TensorType::F32;
  try {
    convert_hf_to_gguf(opt);
  } catch (const ConvertError& e) {
    EXPECT_FALSE(fs::exists(opt.out_path)) << "a refused conversion left a file behind";
    return e.what();
  }
  ADD_FAILURE() << "conversion succeeded but should have been refused";
  return "";
}

std::string gpt_oss_refusal(const std::function<void(json&)>& edit_cfg, bool mxfp4 = false,
                            const std::function<void(std::vector<RawTensor>&)>& edit = {}) {
  json cfg = gpt_oss_config(mxfp4);
  if (edit_cfg) edit_cfg(cfg);
  return refusal(cfg, gpt_oss_checkpoint(mxfp4), true, edit);
}

TEST(ConvertArchRefusal, GptOssSettingsTheGgufCannotHoldAreNamed) {
  const auto expect_names = [](const std::string& e, std::initializer_list<const char*> words) {
    for (const char* w : words) EXPECT_NE(e.find(w), std::string::npos) << "missing '" << w << "' in: " << e;
  };
  expect_names(gpt_oss_refusal([](json& c) { c.erase("sliding_window"); }), {"sliding_window", "missing"});
  expect_names(gpt_oss_refusal([](json& c) { c.erase("intermediate_size"); }), {"intermediate_size"});
  expect_names(gpt_oss_refusal([](json& c) { c["rope_parameters"]["rope_type"] = "longrope"; }),
               {"rope_parameters.rope_type", "longrope"});
  expect_names(gpt_oss_refusal([](json& c) { c["rope_parameters"].erase("factor"); }), {"rope_parameters.factor"});
  expect_names(gpt_oss_refusal([](json& c) { c["rope_parameters"]["beta_fast"] = 16.0; }), {"beta_fast"});
  expect_names(gpt_oss_refusal([](json& c) { c["rope_parameters"]["attention_factor"] = 1.5; }), {"attention_factor"});
  expect_names(gpt_oss_refusal([](json& c) { c["layer_types"][0] = "full_attention"; }), {"layer_types[0]"});
  expect_names(gpt_oss_refusal([](json& c) { c["swiglu_limit"] = 10.0; }), {"swiglu_limit"});
  expect_names(gpt_oss_refusal([](json& c) { c["quantization_config"] = {{"quant_method", "fp8"}}; }),
               {"quantization_config", "fp8"});
}

TEST(ConvertArchRefusal, GptOssTensorsOfTheWrongKindAreNamed) {
  // Blocks stored as bf16, a router as raw bytes, a fused tensor in the other orientation.
  const std::string blocks = "model.layers.1.mlp.experts.down_proj_blocks";
  std::string e = gpt_oss_refusal({}, true, [&](std::vector<RawTensor>& t) {
    for (RawTensor& r : t) {
      if (r.name == blocks) r.dtype = "BF16", r.shape.back() = 8;
    }
  });
  EXPECT_NE(e.find(blocks), std::string::npos) << e;
  EXPECT_NE(e.find("U8"), std::string::npos) << e;
  const std::string router = "model.layers.2.mlp.router.weight";
  e = gpt_oss_refusal({}, false, [&](std::vector<RawTensor>& t) {
    for (RawTensor& r : t) {
      if (r.name == router) r.dtype = "U8", r.bytes.resize(r.bytes.size() / 2);
    }
  });
  EXPECT_NE(e.find(router), std::string::npos) << e;
  const std::string gu = "model.layers.0.mlp.experts.gate_up_proj";
  e = gpt_oss_refusal({}, false, [&](std::vector<RawTensor>& t) {
    for (RawTensor& r : t) {
      if (r.name == gu) r.shape = {r.shape[0], r.shape[2], r.shape[1]};
    }
  });
  EXPECT_NE(e.find(gu), std::string::npos) << e;
  EXPECT_NE(e.find("[4, 96, 64]"), std::string::npos) << "the shape config.json implies: " << e;
}

TEST(ConvertArchRefusal, Qwen2MoeSettingsTheGgufCannotHoldAreNamed) {
  const auto q = [](const std::function<void(json&)>& edit) {
    json cfg = qwen2moe_config();
    edit(cfg);
    return refusal(cfg, qwen2moe_checkpoint(false), false);
  };
  std::string e = q([](json& c) { c["norm_topk_prob"] = true; });
  EXPECT_NE(e.find("norm_topk_prob"), std::string::npos) << e;
  e = q([](json& c) { c.erase("shared_expert_intermediate_size"); });
  EXPECT_NE(e.find("shared_expert_intermediate_size"), std::string::npos) << e;
  e = q([](json& c) { c["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"rope_theta", 1e6}}; });
  EXPECT_NE(e.find("yarn"), std::string::npos) << e;
  e = q([](json& c) { c["qkv_bias"] = false; });
  EXPECT_NE(e.find("qkv_bias"), std::string::npos) << e;
  e = q([](json& c) { c.erase("rope_parameters"); });
  EXPECT_NE(e.find("rope_theta"), std::string::npos) << e;
}

TEST(ConvertArchRefusal, Glm4MoeAndQwen35MoeSettingsTheGgufCannotHoldAreNamed) {
  const auto g = [](const std::function<void(json&)>& edit) {
    json cfg = glm4moe_config();
    edit(cfg);
    return refusal(cfg, glm4moe_checkpoint(), false);
  };
  const auto has = [](const std::string& e, const char* w) { EXPECT_NE(e.find(w), std::string::npos) << "missing '" << w << "' in: " << e; };
  has(g([](json& c) { c["rope_parameters"]["rope_type"] = "yarn"; }), "rope_parameters.rope_type");
  has(g([](json& c) { c["attention_bias"] = false; }), "attention_bias");
  has(g([](json& c) { c["hidden_act"] = "gelu"; }), "hidden_act");
  has(g([](json& c) { c.erase("n_shared_experts"); }), "n_shared_experts");
  has(g([](json& c) { c["num_nextn_predict_layers"] = 2; }), "num_nextn_predict_layers");
  has(g([](json& c) { c["first_k_dense_replace"] = 3; }), "first_k_dense_replace");
  has(g([](json& c) { c["n_group"] = 3; }), "n_group");
  has(g([](json& c) { c["scoring_func"] = "softmax"; }), "scoring_func");
  // qwen35moe's settings, each refused before any tensor is read.
  const auto q = [](const std::function<void(json&)>& edit) {
    json cfg = qwen35moe_config();
    edit(cfg);
    return refusal(cfg, qwen35moe_checkpoint(), false);
  };
  has(q([](json& c) { c["rope_parameters"]["mrope_interleaved"] = false; }), "rope_parameters.mrope_interleaved");
  has(q([](json& c) { c["rope_parameters"]["mrope_section"] = {1, 1, 1, 1, 1}; }), "rope_parameters.mrope_section");
  has(q([](json& c) { c["norm_topk_prob"] = false; }), "norm_topk_prob");
  has(q([](json& c) { c["linear_num_value_heads"] = 3; }), "linear_num_value_heads");
}

TEST(ConvertArchConfig, GptOssTransformersV4ConfigGivesTheSameKeys) {
  // The released config.json: rope_theta at the top, YaRN under rope_scaling.
  json v4 = gpt_oss_config(false);
  json rope = v4["rope_parameters"];
  v4.erase("rope_parameters");
  v4["rope_theta"] = rope["rope_theta"];
  rope.erase("rope_theta");
  v4["rope_scaling"] = rope;
  std::map<std::string, std::string> keys[2];
  int i = 0;
  for (const json& cfg : {gpt_oss_config(false), v4}) {
    Scratch s("convert-arch-v4");
    write_dir(s.file("m"), cfg, gpt_oss_checkpoint(false), true);
    ConvertOptions opt;
    opt.hf_dir = s.file("m");
    opt.out_path = s.file("out.gguf");
    opt.outtype = TensorType::F32;
    const ConvertResult r = convert_hf_to_gguf(opt);
    ASSERT_EQ(r.notes.size(), 1u);   // truncate = false
    EXPECT_NE(r.notes[0].find("truncate"), std::string::npos) << r.notes[0];
    const GgufFile f = GgufFile::open(opt.out_path);
    for (const char* k : {"rope.freq_base", "rope.scaling.type", "rope.scaling.factor",
                          "rope.scaling.original_context_length", "rope.scaling.yarn_beta_slow"}) {
      const gguf::Value* v = f.find(std::string("gpt-oss.") + k);
      ASSERT_NE(v, nullptr) << k;
      keys[i][k] = v->as_string() ? *v->as_string() : std::to_string(*v->as_f64());
    }
    ++i;
  }
  EXPECT_EQ(keys[0], keys[1]);
}

TEST(ConvertArchConfig, ModelTypeStandsInForArchitecturesAndUnknownOnesAreListed) {
  // No "architectures": model_type picks the converter part.
  Scratch s("convert-arch-model-type");
  json cfg = qwen2moe_config();
  cfg.erase("architectures");
  write_dir(s.file("m"), cfg, qwen2moe_checkpoint(false), false);
  ConvertOptions opt;
  opt.hf_dir = s.file("m");
  opt.out_path = s.file("out.gguf");
  opt.outtype = TensorType::F32;
  EXPECT_EQ(convert_hf_to_gguf(opt).arch, "qwen2moe");
  // An architecture without a converter part is refused with the list of those that have one.
  cfg["architectures"] = {"MixtralForCausalLM"};
  const std::string e = refusal(cfg, qwen2moe_checkpoint(false), false);
  for (const char* w : {"MixtralForCausalLM", "GptOssForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                        "Qwen3NextForCausalLM", "Glm4MoeForCausalLM", "Qwen3_5MoeForCausalLM"}) {
    EXPECT_NE(e.find(w), std::string::npos) << "missing '" << w << "' in: " << e;
  }
}

}  // namespace
}  // namespace moraine::convert::test
