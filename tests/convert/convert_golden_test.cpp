// moraine-convert on the golden fixtures (tiny random Qwen3-MoE / Qwen3-Next models, and gpt-oss /
// Qwen2-MoE / GLM-4.5 / Qwen3.5-MoE ones once made, saved and run by Hugging Face transformers,
// tests/golden/make_golden.py): the GGUF metadata says what
// config.json says, every tensor llama.cpp expects is there with its shape and the
// transformation llama.cpp's converter applies, and - the proof of the conversion - llama.cpp
// loads each file and reproduces transformers' logits and greedy continuation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "common/formats/quant.h"
#include "common/gguf/gguf.h"
#include "tests/convert/convert_test_util.h"
#include "tools/convert/convert.h"
#include "tools/convert/safetensors.h"
#include "common/reference/executor.h"

namespace moraine::convert::test {
namespace {

using gguf::GgufFile;
using nlohmann::json;

// One F32 conversion of every golden model, shared by the tests (converting is the slow part).
class ConvertGolden : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    scratch_ = new Scratch("convert-golden");
    for (const std::string& m : golden_models()) {
      ConvertOptions opt;
      opt.hf_dir = golden_dir(m);
      opt.out_path = scratch_->file(m + ".f32.gguf");
      opt.outtype = TensorType::F32;
      convert_hf_to_gguf(opt);
    }
    // Narrow output types, for llama.cpp to load: q8_0 of a Qwen3-Next (K-quant-sized rows)
    // and bf16 of a Qwen3-MoE whose expert rows (40) force the F16 fallback under q8_0.
    for (const auto& [m, t] : kNarrow) {
      ConvertOptions opt;
      opt.hf_dir = golden_dir(m);
      opt.out_path = narrow_path(m, t);
      opt.outtype = t;
      convert_hf_to_gguf(opt);
    }
  }
  static void TearDownTestSuite() {
    delete scratch_;
    scratch_ = nullptr;
  }
  static std::string gguf_path(const std::string& m) { return scratch_->file(m + ".f32.gguf"); }
  static std::string narrow_path(const std::string& m, TensorType t) {
    return scratch_->file(m + "." + std::string(type_name(t)) + ".gguf");
  }
  static constexpr std::pair<const char*, TensorType> kNarrow[] = {{"qwen3next_k256", TensorType::Q8_0},
                                                                   {"qwen3moe_odd", TensorType::Q8_0},
                                                                   {"qwen3moe_odd", TensorType::BF16}};
  static Scratch* scratch_;
};
Scratch* ConvertGolden::scratch_ = nullptr;

// Multi-token-prediction layers in a checkpoint: mtp.layers.N.* (read from the raw header).
int64_t mtp_layers(const Checkpoint& c) {
  int64_t n = 0;
  for (const StTensor& t : c.tensors()) {
    if (t.name.rfind("mtp.layers.", 0) == 0) n = std::max<int64_t>(n, std::stoll(t.name.substr(11)) + 1);
  }
  return n;
}

std::vector<float> tensor_f32(const GgufFile& f, const std::string& name) {
  const gguf::TensorInfo* t = f.find_tensor(name);
  if (!t) throw std::runtime_error("GGUF lacks " + name);
  std::vector<float> out(static_cast<size_t>(t->n_elements()));
  const int64_t row = t->shape[0];
  const size_t rb = row_bytes(t->type, row);
  for (int64_t r = 0; r < t->n_rows(); ++r) dequantize_row(t->type, t->data + r * rb, out.data() + r * row, row);
  return out;
}

std::vector<float> source_rows(const StTensor& t, int64_t first, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n * t.row_len()));
  for (int64_t r = 0; r < n; ++r) t.read_row(first + r, out.data() + r * t.row_len());
  return out;
}

std::vector<float> source_all(const StTensor& t) { return source_rows(t, 0, t.n_rows()); }

// deepseek2's own keys: the MLA sizes, the router, DeepSeek's YaRN, no MTP layer (llama.cpp skips it).
void expect_deepseek2_keys(const json& cfg, const GgufFile& f) {
  const std::string a = "deepseek2.";
  const bool v3 = cfg["architectures"][0] == "DeepseekV3ForCausalLM";
  const json& rope = cfg["rope_parameters"];
  EXPECT_EQ(f.get_u64(a + "attention.q_lora_rank"), cfg["q_lora_rank"].is_null() ? 0u : cfg["q_lora_rank"].get<uint64_t>());
  EXPECT_EQ(f.get_u64(a + "attention.kv_lora_rank"), cfg["kv_lora_rank"].get<uint64_t>());
  EXPECT_EQ(f.get_u64(a + "attention.key_length_mla"), cfg["qk_nope_head_dim"].get<uint64_t>() + cfg["qk_rope_head_dim"].get<uint64_t>());
  EXPECT_EQ(f.get_u64(a + "attention.value_length_mla"), cfg["v_head_dim"].get<uint64_t>());
  EXPECT_EQ(f.get_u64(a + "rope.dimension_count"), cfg["qk_rope_head_dim"].get<uint64_t>());
  EXPECT_EQ(f.get_u64(a + "leading_dense_block_count"), cfg["first_k_dense_replace"].get<uint64_t>());
  EXPECT_EQ(f.get_u64(a + "expert_shared_count"), cfg["n_shared_experts"].get<uint64_t>());
  EXPECT_FLOAT_EQ(static_cast<float>(*f.get_f64(a + "expert_weights_scale")), cfg["routed_scaling_factor"].get<float>());
  EXPECT_EQ(f.get_bool(a + "expert_weights_norm").value_or(false), cfg["norm_topk_prob"].get<bool>());
  // V3 states its sigmoid router; V2's softmax is llama.cpp's default (config.json names no scoring_func).
  if (v3) EXPECT_EQ(f.get_u64(a + "expert_gating_func"), 2u);
  else EXPECT_EQ(f.find(a + "expert_gating_func"), nullptr);
  EXPECT_EQ(f.get_u64(a + "expert_group_count"), cfg["n_group"].get<uint64_t>());
  EXPECT_EQ(f.get_u64(a + "expert_group_used_count"), cfg["topk_group"].get<uint64_t>());
  EXPECT_EQ(f.get_string(a + "rope.scaling.type"), "yarn");
  EXPECT_FLOAT_EQ(static_cast<float>(*f.get_f64(a + "rope.scaling.factor")), rope["factor"].get<float>());
  EXPECT_EQ(f.get_u64(a + "rope.scaling.original_context_length"), rope["original_max_position_embeddings"].get<uint64_t>());
  EXPECT_FLOAT_EQ(static_cast<float>(*f.get_f64(a + "rope.scaling.yarn_log_multiplier")),
                  static_cast<float>(0.1 * rope["mscale_all_dim"].get<double>()));
  EXPECT_EQ(f.get_u64(a + "block_count"), cfg["num_hidden_layers"].get<uint64_t>());
  EXPECT_EQ(f.find(a + "nextn_predict_layers"), nullptr);
}

TEST_F(ConvertGolden, MetadataSaysWhatConfigSays) {
  for (const std::string& m : golden_models()) {
    SCOPED_TRACE(m);
    const json cfg = read_json(golden_dir(m) + "/config.json");
    const Checkpoint ckpt = Checkpoint::open(golden_dir(m));
    const GgufFile f = GgufFile::open(gguf_path(m));
    const std::string a = golden_arch(cfg);
    const bool next = a == "qwen3next" || a == "qwen35moe";
    const int64_t n_mtp = mtp_layers(ckpt);
    EXPECT_EQ(f.get_string("general.architecture"), a);
    EXPECT_EQ(f.get_u64("general.file_type"), 0u);  // ALL_F32
    EXPECT_EQ(f.get_u64(a + ".block_count"), cfg["num_hidden_layers"].get<uint64_t>() + n_mtp);
    EXPECT_EQ(f.get_u64(a + ".context_length"), cfg["max_position_embeddings"].get<uint64_t>());
    EXPECT_EQ(f.get_u64(a + ".embedding_length"), cfg["hidden_size"].get<uint64_t>());
    EXPECT_EQ(f.get_u64(a + ".feed_forward_length"), cfg["intermediate_size"].get<uint64_t>());
    EXPECT_EQ(f.get_u64(a + ".attention.head_count"), cfg["num_attention_heads"].get<uint64_t>());
    if (a == "deepseek2") {   // MQA over the cached [latent | rotary key], as llama.cpp writes it
      const uint64_t rank = cfg["kv_lora_rank"], rope = cfg["qk_rope_head_dim"];
      EXPECT_EQ(f.get_u64(a + ".attention.head_count_kv"), 1u);
      EXPECT_EQ(f.get_u64(a + ".attention.key_length"), rank + rope);
      EXPECT_EQ(f.get_u64(a + ".attention.value_length"), rank);
      expect_deepseek2_keys(cfg, f);
    } else {
      EXPECT_EQ(f.get_u64(a + ".attention.head_count_kv"), cfg["num_key_value_heads"].get<uint64_t>());
    }
    if (a != "deepseek2" && cfg.contains("head_dim") && !cfg["head_dim"].is_null()) {
      EXPECT_EQ(f.get_u64(a + ".attention.key_length"), cfg["head_dim"].get<uint64_t>());
      EXPECT_EQ(f.get_u64(a + ".attention.value_length"), cfg["head_dim"].get<uint64_t>());
    } else if (a != "deepseek2") {
      EXPECT_EQ(f.find(a + ".attention.key_length"), nullptr);
    }
    EXPECT_FLOAT_EQ(static_cast<float>(*f.get_f64(a + ".rope.freq_base")),
                    cfg["rope_parameters"]["rope_theta"].get<float>());
    EXPECT_FLOAT_EQ(static_cast<float>(*f.get_f64(a + ".attention.layer_norm_rms_epsilon")),
                    cfg["rms_norm_eps"].get<float>());
    const uint64_t n_expert = cfg.contains("num_experts")       ? cfg["num_experts"].get<uint64_t>()
                              : cfg.contains("n_routed_experts") ? cfg["n_routed_experts"].get<uint64_t>()
                                                                 : cfg["num_local_experts"].get<uint64_t>();
    EXPECT_EQ(f.get_u64(a + ".expert_count"), n_expert);
    EXPECT_EQ(f.get_u64(a + ".expert_used_count"), cfg["num_experts_per_tok"].get<uint64_t>());
    // gpt-oss sizes its experts by intermediate_size.
    const char* ff_exp = a == "gpt-oss" ? "intermediate_size" : "moe_intermediate_size";
    EXPECT_EQ(f.get_u64(a + ".expert_feed_forward_length"), cfg[ff_exp].get<uint64_t>());
    if (a == "gpt-oss") {
      const json& rope = cfg["rope_parameters"];
      EXPECT_EQ(f.get_u64(a + ".attention.sliding_window"), cfg["sliding_window"].get<uint64_t>());
      EXPECT_EQ(f.get_string(a + ".rope.scaling.type"), "yarn");
      EXPECT_FLOAT_EQ(static_cast<float>(*f.get_f64(a + ".rope.scaling.factor")), rope["factor"].get<float>());
      EXPECT_EQ(f.get_u64(a + ".rope.scaling.original_context_length"),
                rope["original_max_position_embeddings"].get<uint64_t>());
    }
    if (a == "qwen2moe") {
      EXPECT_EQ(f.get_u64(a + ".expert_shared_feed_forward_length"),
                cfg["shared_expert_intermediate_size"].get<uint64_t>());
    }
    if (a == "glm4moe") {
      const json& rope = cfg["rope_parameters"];
      EXPECT_EQ(f.get_u64(a + ".rope.dimension_count"),
                static_cast<uint64_t>(cfg["head_dim"].get<double>() * rope["partial_rotary_factor"].get<double>()));
      EXPECT_EQ(f.get_u64(a + ".expert_shared_count"), cfg["n_shared_experts"].get<uint64_t>());
      EXPECT_EQ(f.get_u64(a + ".leading_dense_block_count"), cfg["first_k_dense_replace"].get<uint64_t>());
      EXPECT_EQ(f.get_u64(a + ".expert_gating_func"), 2u);  // sigmoid
      EXPECT_FLOAT_EQ(static_cast<float>(*f.get_f64(a + ".expert_weights_scale")), cfg["routed_scaling_factor"].get<float>());
      EXPECT_EQ(f.get_bool(a + ".expert_weights_norm"), cfg["norm_topk_prob"].get<bool>());
      EXPECT_EQ(f.get_u64(a + ".expert_group_count"), cfg["n_group"].get<uint64_t>());
      EXPECT_EQ(f.get_u64(a + ".expert_group_used_count"), cfg["topk_group"].get<uint64_t>());
      // transformers saves no MTP layer (it builds none): the file is llama.cpp's --no-mtp one.
      ASSERT_EQ(ckpt.find("model.layers." + std::to_string(cfg["num_hidden_layers"].get<int>()) + ".eh_proj.weight"), nullptr);
      EXPECT_EQ(f.get_u64(a + ".block_count"), cfg["num_hidden_layers"].get<uint64_t>());
      EXPECT_EQ(f.find(a + ".nextn_predict_layers"), nullptr);
    }
    if (!next) {
      EXPECT_EQ(f.find(a + ".ssm.conv_kernel"), nullptr);
      continue;
    }
    if (a == "qwen35moe") {
      const gguf::Array* sec = f.get_array(a + ".rope.dimension_sections");
      ASSERT_NE(sec, nullptr);
      const json& want = cfg["rope_parameters"]["mrope_section"];
      ASSERT_EQ(sec->items.size(), 4u);
      for (size_t i = 0; i < 4; ++i) EXPECT_EQ(sec->items[i].as_i64(), i < want.size() ? want[i].get<int64_t>() : 0) << i;
    }
    EXPECT_EQ(f.get_u64(a + ".expert_shared_feed_forward_length"),
              cfg["shared_expert_intermediate_size"].get<uint64_t>());
    EXPECT_EQ(f.get_u64(a + ".ssm.conv_kernel"), cfg["linear_conv_kernel_dim"].get<uint64_t>());
    EXPECT_EQ(f.get_u64(a + ".ssm.state_size"), cfg["linear_key_head_dim"].get<uint64_t>());
    EXPECT_EQ(f.get_u64(a + ".ssm.group_count"), cfg["linear_num_key_heads"].get<uint64_t>());
    EXPECT_EQ(f.get_u64(a + ".ssm.time_step_rank"), cfg["linear_num_value_heads"].get<uint64_t>());
    EXPECT_EQ(f.get_u64(a + ".ssm.inner_size"),
              cfg["linear_value_head_dim"].get<uint64_t>() * cfg["linear_num_value_heads"].get<uint64_t>());
    EXPECT_EQ(f.get_u64(a + ".rope.dimension_count"),
              static_cast<uint64_t>(cfg["head_dim"].get<double>() * cfg["rope_parameters"]["partial_rotary_factor"].get<double>()));
    const gguf::Array* rec = f.get_array(a + ".attention.recurrent_layers");
    ASSERT_NE(rec, nullptr);
    ASSERT_EQ(rec->items.size(), cfg["layer_types"].size() + n_mtp);
    for (size_t i = 0; i < rec->items.size(); ++i) {
      const bool want = i < cfg["layer_types"].size() && cfg["layer_types"][i] == "linear_attention";
      EXPECT_EQ(rec->items[i].as_bool(), want) << "layer " << i;
    }
    if (n_mtp > 0) {
      EXPECT_EQ(f.get_u64(a + ".nextn_predict_layers"), static_cast<uint64_t>(n_mtp));
    } else {
      EXPECT_EQ(f.find(a + ".nextn_predict_layers"), nullptr);
    }
  }
}

TEST_F(ConvertGolden, TokenizerIsTheFixturesBpe) {
  for (const std::string& m : golden_models()) {
    SCOPED_TRACE(m);
    const json cfg = read_json(golden_dir(m) + "/config.json");
    const json tok = read_json(golden_dir(m) + "/tokenizer.json");
    const GgufFile f = GgufFile::open(gguf_path(m));
    EXPECT_EQ(f.get_string("tokenizer.ggml.model"), "gpt2");
    EXPECT_EQ(f.get_string("tokenizer.ggml.pre"), "qwen2");
    const gguf::Array* tokens = f.get_array("tokenizer.ggml.tokens");
    const gguf::Array* types = f.get_array("tokenizer.ggml.token_type");
    ASSERT_NE(tokens, nullptr);
    ASSERT_NE(types, nullptr);
    const size_t V = cfg["vocab_size"].get<size_t>();
    ASSERT_EQ(tokens->items.size(), V);
    ASSERT_EQ(types->items.size(), V);
    for (auto it = tok["model"]["vocab"].begin(); it != tok["model"]["vocab"].end(); ++it) {
      const size_t id = it.value().get<size_t>();
      ASSERT_EQ(*tokens->items[id].as_string(), it.key()) << "id " << id;
      ASSERT_EQ(types->items[id].as_i64(), 1) << "normal token " << id;
    }
    std::map<std::string, int64_t> added;
    for (const json& t : tok["added_tokens"]) {
      const size_t id = t["id"].get<size_t>();
      added[t["content"].get<std::string>()] = static_cast<int64_t>(id);
      EXPECT_EQ(*tokens->items[id].as_string(), t["content"].get<std::string>());
      EXPECT_EQ(types->items[id].as_i64(), t["special"].get<bool>() ? 3 : 4) << t["content"];  // control / user-defined
    }
    const gguf::Array* merges = f.get_array("tokenizer.ggml.merges");
    ASSERT_NE(merges, nullptr);
    ASSERT_EQ(merges->items.size(), tok["model"]["merges"].size());
    for (size_t i = 0; i < merges->items.size(); ++i) {
      const json& mj = tok["model"]["merges"][i];
      const std::string want = mj.is_string() ? mj.get<std::string>()
                                              : mj[0].get<std::string>() + " " + mj[1].get<std::string>();
      ASSERT_EQ(*merges->items[i].as_string(), want) << "merge " << i;
    }
    // tokenizer_config.json names eos and pad; bos comes from config.json.
    EXPECT_EQ(f.get_u64("tokenizer.ggml.eos_token_id"), static_cast<uint64_t>(added.at("<|im_end|>")));
    EXPECT_EQ(f.get_u64("tokenizer.ggml.padding_token_id"), static_cast<uint64_t>(added.at("<|endoftext|>")));
    EXPECT_EQ(f.get_u64("tokenizer.ggml.bos_token_id"), cfg["bos_token_id"].get<uint64_t>());
    EXPECT_EQ(f.get_bool("tokenizer.ggml.add_bos_token"), false);
  }
}

// The tensor list llama.cpp's qwen3moe / qwen3next loaders ask for, with ggml shapes, written
// out here from config.json alone.
// gpt-oss's and qwen2moe's layers, as their llama.cpp loaders ask for them.
void expected_other_layer(const json& cfg, const std::string& a, const std::string& b,
                          std::map<std::string, std::vector<int64_t>>& t) {
  const int64_t H = cfg["hidden_size"], nh = cfg["num_attention_heads"], nkv = cfg["num_key_value_heads"];
  const int64_t hd = cfg.contains("head_dim") && !cfg["head_dim"].is_null() ? cfg["head_dim"].get<int64_t>() : H / nh;
  const int64_t E = cfg.contains("num_experts") ? cfg["num_experts"].get<int64_t>() : cfg["num_local_experts"].get<int64_t>();
  const bool oss = a == "gpt-oss";
  const int64_t F = oss ? cfg["intermediate_size"] : cfg["moe_intermediate_size"];
  t[b + "attn_norm.weight"] = {H};
  t[b + (oss ? "post_attention_norm.weight" : "ffn_norm.weight")] = {H};
  t[b + "attn_q.weight"] = {H, nh * hd};
  t[b + "attn_k.weight"] = {H, nkv * hd};
  t[b + "attn_v.weight"] = {H, nkv * hd};
  t[b + "attn_output.weight"] = {nh * hd, H};
  t[b + "attn_q.bias"] = {nh * hd};
  t[b + "attn_k.bias"] = {nkv * hd};
  t[b + "attn_v.bias"] = {nkv * hd};
  t[b + "ffn_gate_inp.weight"] = {H, E};
  t[b + "ffn_gate_exps.weight"] = {H, F, E};
  t[b + "ffn_up_exps.weight"] = {H, F, E};
  t[b + "ffn_down_exps.weight"] = {F, H, E};
  if (oss) {
    t[b + "attn_output.bias"] = {H};
    t[b + "attn_sinks.weight"] = {nh};
    t[b + "ffn_gate_inp.bias"] = {E};
    t[b + "ffn_gate_exps.bias"] = {F, E};
    t[b + "ffn_up_exps.bias"] = {F, E};
    t[b + "ffn_down_exps.bias"] = {H, E};
  } else {
    const int64_t Fs = cfg["shared_expert_intermediate_size"];
    t[b + "ffn_gate_inp_shexp.weight"] = {H, 1};
    t[b + "ffn_gate_shexp.weight"] = {H, Fs};
    t[b + "ffn_up_shexp.weight"] = {H, Fs};
    t[b + "ffn_down_shexp.weight"] = {Fs, H};
  }
}

// glm4moe's layers as llama.cpp's loader asks for them: q/k/v biases, q/k norms (use_qk_norm),
// dense FFNs in the first first_k_dense_replace layers, else a sigmoid router with its
// exp_probs_b bias, routed experts and an ungated shared expert.
void expected_glm_layer(const json& cfg, int64_t il, const std::string& b, std::map<std::string, std::vector<int64_t>>& t) {
  const int64_t H = cfg["hidden_size"], nh = cfg["num_attention_heads"], nkv = cfg["num_key_value_heads"];
  const int64_t hd = cfg["head_dim"], E = cfg["n_routed_experts"], F = cfg["moe_intermediate_size"];
  t[b + "attn_norm.weight"] = {H};
  t[b + "post_attention_norm.weight"] = {H};
  t[b + "attn_q.weight"] = {H, nh * hd};
  t[b + "attn_k.weight"] = {H, nkv * hd};
  t[b + "attn_v.weight"] = {H, nkv * hd};
  t[b + "attn_output.weight"] = {nh * hd, H};
  t[b + "attn_q.bias"] = {nh * hd};
  t[b + "attn_k.bias"] = {nkv * hd};
  t[b + "attn_v.bias"] = {nkv * hd};
  if (cfg.value("use_qk_norm", false)) {
    t[b + "attn_q_norm.weight"] = {hd};
    t[b + "attn_k_norm.weight"] = {hd};
  }
  if (il < cfg["first_k_dense_replace"].get<int64_t>()) {
    const int64_t Fd = cfg["intermediate_size"];
    t[b + "ffn_gate.weight"] = {H, Fd};
    t[b + "ffn_up.weight"] = {H, Fd};
    t[b + "ffn_down.weight"] = {Fd, H};
    return;
  }
  const int64_t Fs = F * cfg["n_shared_experts"].get<int64_t>();
  t[b + "ffn_gate_inp.weight"] = {H, E};
  t[b + "exp_probs_b.bias"] = {E};
  t[b + "ffn_gate_exps.weight"] = {H, F, E};
  t[b + "ffn_up_exps.weight"] = {H, F, E};
  t[b + "ffn_down_exps.weight"] = {F, H, E};
  t[b + "ffn_gate_shexp.weight"] = {H, Fs};
  t[b + "ffn_up_shexp.weight"] = {H, Fs};
  t[b + "ffn_down_shexp.weight"] = {Fs, H};
}

// deepseek2's layers as llama.cpp's loader asks for them: q directly or through its LoRA, the
// latent's projection and norm, kv_b_proj split into attn_k_b / attn_v_b, dense FFNs first, then
// the router (V3: with exp_probs_b), routed experts and the ungated shared experts.
void expected_deepseek2_layer(const json& cfg, int64_t il, const std::string& b, std::map<std::string, std::vector<int64_t>>& t) {
  const int64_t H = cfg["hidden_size"], nh = cfg["num_attention_heads"], E = cfg["n_routed_experts"];
  const int64_t R = cfg["kv_lora_rank"], nope = cfg["qk_nope_head_dim"], rope = cfg["qk_rope_head_dim"], v = cfg["v_head_dim"];
  const int64_t F = cfg["moe_intermediate_size"];
  t[b + "attn_norm.weight"] = {H};
  t[b + "ffn_norm.weight"] = {H};
  if (cfg["q_lora_rank"].is_null()) {
    t[b + "attn_q.weight"] = {H, nh * (nope + rope)};
  } else {
    const int64_t Q = cfg["q_lora_rank"];
    t[b + "attn_q_a.weight"] = {H, Q};
    t[b + "attn_q_a_norm.weight"] = {Q};
    t[b + "attn_q_b.weight"] = {Q, nh * (nope + rope)};
  }
  t[b + "attn_kv_a_mqa.weight"] = {H, R + rope};
  t[b + "attn_kv_a_norm.weight"] = {R};
  t[b + "attn_k_b.weight"] = {nope, R, nh};
  t[b + "attn_v_b.weight"] = {R, v, nh};
  t[b + "attn_output.weight"] = {nh * v, H};
  if (il < cfg["first_k_dense_replace"].get<int64_t>()) {
    const int64_t Fd = cfg["intermediate_size"];
    t[b + "ffn_gate.weight"] = {H, Fd};
    t[b + "ffn_up.weight"] = {H, Fd};
    t[b + "ffn_down.weight"] = {Fd, H};
    return;
  }
  const int64_t Fs = F * cfg["n_shared_experts"].get<int64_t>();
  t[b + "ffn_gate_inp.weight"] = {H, E};
  if (cfg["architectures"][0] == "DeepseekV3ForCausalLM") t[b + "exp_probs_b.bias"] = {E};
  t[b + "ffn_gate_exps.weight"] = {H, F, E};
  t[b + "ffn_up_exps.weight"] = {H, F, E};
  t[b + "ffn_down_exps.weight"] = {F, H, E};
  t[b + "ffn_gate_shexp.weight"] = {H, Fs};
  t[b + "ffn_up_shexp.weight"] = {H, Fs};
  t[b + "ffn_down_shexp.weight"] = {Fs, H};
}

std::map<std::string, std::vector<int64_t>> expected_tensors(const json& cfg, int64_t n_mtp) {
  const std::string a = golden_arch(cfg);
  const bool next = a == "qwen3next" || a == "qwen35moe";
  const int64_t H = cfg["hidden_size"], V = cfg["vocab_size"], L = cfg["num_hidden_layers"];
  std::map<std::string, std::vector<int64_t>> t = {
      {"token_embd.weight", {H, V}}, {"output_norm.weight", {H}}, {"output.weight", {H, V}}};
  if (a == "gpt-oss" || a == "qwen2moe") {
    for (int64_t il = 0; il < L; ++il) expected_other_layer(cfg, a, "blk." + std::to_string(il) + ".", t);
    return t;
  }
  if (a == "glm4moe") {
    for (int64_t il = 0; il < L; ++il) expected_glm_layer(cfg, il, "blk." + std::to_string(il) + ".", t);
    return t;
  }
  if (a == "deepseek2") {
    for (int64_t il = 0; il < L; ++il) expected_deepseek2_layer(cfg, il, "blk." + std::to_string(il) + ".", t);
    return t;
  }
  const bool split_ba = a == "qwen35moe";
  const int64_t hd = cfg["head_dim"], nh = cfg["num_attention_heads"], nkv = cfg["num_key_value_heads"];
  const int64_t E = cfg.contains("num_experts") ? cfg["num_experts"].get<int64_t>() : cfg["num_local_experts"].get<int64_t>();
  const int64_t F = cfg["moe_intermediate_size"];
  for (int64_t il = 0; il < L + n_mtp; ++il) {
    const std::string b = "blk." + std::to_string(il) + ".";
    const bool recurrent = next && il < L && cfg["layer_types"][il] == "linear_attention";
    t[b + "attn_norm.weight"] = {H};
    t[b + (next ? "post_attention_norm.weight" : "ffn_norm.weight")] = {H};
    if (recurrent) {
      const int64_t nk = cfg["linear_num_key_heads"], nv = cfg["linear_num_value_heads"];
      const int64_t dk = cfg["linear_key_head_dim"], dv = cfg["linear_value_head_dim"];
      const int64_t K = cfg["linear_conv_kernel_dim"];
      t[b + "attn_qkv.weight"] = {H, 2 * nk * dk + nv * dv};
      t[b + "attn_gate.weight"] = {H, nv * dv};
      if (split_ba) {
        t[b + "ssm_beta.weight"] = {H, nv};
        t[b + "ssm_alpha.weight"] = {H, nv};
      } else {
        t[b + "ssm_ba.weight"] = {H, 2 * nv};
      }
      t[b + "ssm_conv1d.weight"] = {K, 2 * nk * dk + nv * dv};
      t[b + "ssm_dt.bias"] = {nv};
      t[b + "ssm_a"] = {nv};
      t[b + "ssm_norm.weight"] = {dv};
      t[b + "ssm_out.weight"] = {nv * dv, H};
    } else {
      t[b + "attn_q.weight"] = {H, nh * hd * (next ? 2 : 1)};
      t[b + "attn_k.weight"] = {H, nkv * hd};
      t[b + "attn_v.weight"] = {H, nkv * hd};
      t[b + "attn_output.weight"] = {nh * hd, H};
      t[b + "attn_q_norm.weight"] = {hd};
      t[b + "attn_k_norm.weight"] = {hd};
    }
    t[b + "ffn_gate_inp.weight"] = {H, E};
    t[b + "ffn_gate_exps.weight"] = {H, F, E};
    t[b + "ffn_up_exps.weight"] = {H, F, E};
    t[b + "ffn_down_exps.weight"] = {F, H, E};
    if (next) {
      const int64_t Fs = cfg["shared_expert_intermediate_size"];
      t[b + "ffn_gate_inp_shexp.weight"] = {H, 1};
      t[b + "ffn_gate_shexp.weight"] = {H, Fs};
      t[b + "ffn_up_shexp.weight"] = {H, Fs};
      t[b + "ffn_down_shexp.weight"] = {Fs, H};
    }
  }
  if (n_mtp > 0) {
    const std::string b = "blk." + std::to_string(L) + ".nextn.";
    t[b + "eh_proj.weight"] = {2 * H, H};
    t[b + "enorm.weight"] = {H};
    t[b + "hnorm.weight"] = {H};
    t[b + "shared_head_norm.weight"] = {H};
  }
  return t;
}

TEST_F(ConvertGolden, TensorsAreExactlyTheOnesLlamaCppExpects) {
  for (const std::string& m : golden_models()) {
    SCOPED_TRACE(m);
    const json cfg = read_json(golden_dir(m) + "/config.json");
    const GgufFile f = GgufFile::open(gguf_path(m));
    const auto want = expected_tensors(cfg, mtp_layers(Checkpoint::open(golden_dir(m))));
    std::map<std::string, std::vector<int64_t>> got;
    for (const gguf::TensorInfo& t : f.tensors()) {
      got[t.name] = t.shape;
      EXPECT_EQ(t.type, TensorType::F32) << t.name;
    }
    EXPECT_EQ(got, want);
  }
}

// llama.cpp's split of kv_b_proj [n_head * (nope + v), rank]: per head, attn_k_b {nope, rank} is
// the nope rows transposed, attn_v_b {rank, v} the v rows as they are.
TEST_F(ConvertGolden, Deepseek2KvBIsSplitPerHeadWithKbTransposed) {
  for (const std::string& m : {std::string("deepseek_v2"), std::string("deepseek_v3")}) {
    SCOPED_TRACE(m);
    const json cfg = read_json(golden_dir(m) + "/config.json");
    const Checkpoint c = Checkpoint::open(golden_dir(m));
    const GgufFile f = GgufFile::open(gguf_path(m));
    const int64_t nh = cfg["num_attention_heads"], R = cfg["kv_lora_rank"], nope = cfg["qk_nope_head_dim"], v = cfg["v_head_dim"];
    for (int64_t il = 0; il < cfg["num_hidden_layers"].get<int64_t>(); ++il) {
      const StTensor* kv = c.find("model.layers." + std::to_string(il) + ".self_attn.kv_b_proj.weight");
      ASSERT_NE(kv, nullptr);
      const std::vector<float> src = source_all(*kv);
      const std::vector<float> kb = tensor_f32(f, "blk." + std::to_string(il) + ".attn_k_b.weight");
      const std::vector<float> vb = tensor_f32(f, "blk." + std::to_string(il) + ".attn_v_b.weight");
      ASSERT_EQ(kb.size(), static_cast<size_t>(nh * R * nope));
      ASSERT_EQ(vb.size(), static_cast<size_t>(nh * R * v));
      for (int64_t h = 0; h < nh; ++h) {
        for (int64_t r = 0; r < R; ++r) {
          for (int64_t j = 0; j < nope; ++j) ASSERT_EQ(kb[(h * R + r) * nope + j], src[(h * (nope + v) + j) * R + r]) << h << " " << r << " " << j;
          for (int64_t i = 0; i < v; ++i) ASSERT_EQ(vb[(h * v + i) * R + r], src[(h * (nope + v) + nope + i) * R + r]) << h << " " << i << " " << r;
        }
      }
    }
  }
}

// Values: each GGUF tensor is its source rows under llama.cpp's transformation.
TEST_F(ConvertGolden, Qwen3NextTransformsMatchTheirDefinitions) {
  const std::string m = "qwen3next_odd";
  const json cfg = read_json(golden_dir(m) + "/config.json");
  const Checkpoint c = Checkpoint::open(golden_dir(m));
  const GgufFile f = GgufFile::open(gguf_path(m));
  const auto src = [&](const std::string& n) -> const StTensor& {
    const StTensor* t = c.find(n);
    if (!t) throw std::runtime_error("fixture lacks " + n);
    return *t;
  };
  EXPECT_EQ(tensor_f32(f, "token_embd.weight"), source_all(src("model.embed_tokens.weight")));
  EXPECT_EQ(tensor_f32(f, "output.weight"), source_all(src("lm_head.weight")));
  // Qwen3-Next RMSNorms scale by (1 + w): stored with the one added.
  for (const auto& [g, hf] : std::vector<std::pair<std::string, std::string>>{
           {"output_norm.weight", "model.norm.weight"},
           {"blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"},
           {"blk.1.post_attention_norm.weight", "model.layers.1.post_attention_layernorm.weight"},
           {"blk.1.attn_q_norm.weight", "model.layers.1.self_attn.q_norm.weight"},
           {"blk.4.nextn.enorm.weight", "mtp.pre_fc_norm_embedding.weight"},
           {"blk.4.nextn.shared_head_norm.weight", "mtp.norm.weight"}}) {
    std::vector<float> want = source_all(src(hf));
    for (float& x : want) x += 1.0f;
    EXPECT_EQ(tensor_f32(f, g), want) << g;
  }
  // The gated norm of the linear attention multiplies by w itself: no offset.
  EXPECT_EQ(tensor_f32(f, "blk.0.ssm_norm.weight"), source_all(src("model.layers.0.linear_attn.norm.weight")));
  std::vector<float> a = source_all(src("model.layers.2.linear_attn.A_log"));
  for (float& x : a) x = -std::exp(x);
  EXPECT_EQ(tensor_f32(f, "blk.2.ssm_a"), a);
  EXPECT_EQ(tensor_f32(f, "blk.2.ssm_dt.bias"), source_all(src("model.layers.2.linear_attn.dt_bias")));
  EXPECT_EQ(tensor_f32(f, "blk.0.ssm_conv1d.weight"), source_all(src("model.layers.0.linear_attn.conv1d.weight")));
  // in_proj_qkvz: per key head g the rows are [q_g, k_g, v_g, z_g]; GGUF splits and regroups them.
  const int64_t nk = cfg["linear_num_key_heads"], nv = cfg["linear_num_value_heads"];
  const int64_t dk = cfg["linear_key_head_dim"], dv = cfg["linear_value_head_dim"], r = nv / nk;
  const int64_t H = cfg["hidden_size"], group = 2 * dk + 2 * r * dv;
  const StTensor& qkvz = src("model.layers.0.linear_attn.in_proj_qkvz.weight");
  const std::vector<float> qkv = tensor_f32(f, "blk.0.attn_qkv.weight"), z = tensor_f32(f, "blk.0.attn_gate.weight");
  for (int64_t g = 0; g < nk; ++g) {
    const auto rows = [&](const std::vector<float>& t, int64_t first, int64_t n) {
      return std::vector<float>(t.begin() + first * H, t.begin() + (first + n) * H);
    };
    EXPECT_EQ(rows(qkv, g * dk, dk), source_rows(qkvz, g * group, dk)) << "q of key head " << g;
    EXPECT_EQ(rows(qkv, nk * dk + g * dk, dk), source_rows(qkvz, g * group + dk, dk)) << "k of key head " << g;
    EXPECT_EQ(rows(qkv, 2 * nk * dk + g * r * dv, r * dv), source_rows(qkvz, g * group + 2 * dk, r * dv))
        << "v of key head " << g;
    EXPECT_EQ(rows(z, g * r * dv, r * dv), source_rows(qkvz, g * group + 2 * dk + r * dv, r * dv))
        << "z of key head " << g;
  }
  // Experts stacked in expert order, for the trunk and the MTP layer.
  const int64_t E = cfg["num_experts"], F = cfg["moe_intermediate_size"];
  for (const auto& [blk, hf] : std::vector<std::pair<std::string, std::string>>{
           {"blk.3.", "model.layers.3."}, {"blk.4.", "mtp.layers.0."}}) {
    const std::vector<float> gate = tensor_f32(f, blk + "ffn_gate_exps.weight");
    const std::vector<float> down = tensor_f32(f, blk + "ffn_down_exps.weight");
    for (int64_t e = 0; e < E; ++e) {
      const std::string p = hf + "mlp.experts." + std::to_string(e) + ".";
      EXPECT_EQ(std::vector<float>(gate.begin() + e * F * H, gate.begin() + (e + 1) * F * H),
                source_all(src(p + "gate_proj.weight"))) << blk << " expert " << e;
      EXPECT_EQ(std::vector<float>(down.begin() + e * F * H, down.begin() + (e + 1) * F * H),
                source_all(src(p + "down_proj.weight"))) << blk << " expert " << e;
    }
  }
}

// Qwen3.5-MoE: HF groups the value heads by key head (head g * r + i reads key head g); the GGUF
// holds them tiled (head i * n_k + g), as llama.cpp's converter writes them. Checked on every
// tensor that has value heads, with the norms' 1 + w and A = -exp(A_log) besides.
TEST_F(ConvertGolden, Qwen35MoeValueHeadsAreTiled) {
  const std::string m = "qwen35moe_odd";
  if (std::find(golden_models().begin(), golden_models().end(), m) == golden_models().end()) GTEST_SKIP() << "no " << m;
  const json cfg = read_json(golden_dir(m) + "/config.json");
  const Checkpoint c = Checkpoint::open(golden_dir(m));
  const GgufFile f = GgufFile::open(gguf_path(m));
  const auto src = [&](const std::string& n) { return source_all(*c.find(n)); };
  const int64_t nk = cfg["linear_num_key_heads"], nv = cfg["linear_num_value_heads"], dk = cfg["linear_key_head_dim"];
  const int64_t dv = cfg["linear_value_head_dim"], r = nv / nk, H = cfg["hidden_size"], K = cfg["linear_conv_kernel_dim"];
  ASSERT_GT(r, 1) << "the fixture must have more value heads than key heads to test the reorder";
  const int64_t qk = 2 * nk * dk;
  const std::string la = "model.layers.0.linear_attn.";
  const auto hf_head = [&](int64_t j) { return (j % nk) * r + j / nk; };  // GGUF head j <- HF head
  // Row-major [rows, width] tensors: GGUF row block (head j) against HF's.
  const auto check_rows = [&](const std::vector<float>& got, const std::vector<float>& hf, int64_t base, int64_t per_head,
                              int64_t width, const std::string& what) {
    for (int64_t j = 0; j < nv; ++j) {
      const int64_t g0 = (base + j * per_head) * width, h0 = (base + hf_head(j) * per_head) * width;
      ASSERT_EQ(std::vector<float>(got.begin() + g0, got.begin() + g0 + per_head * width),
                std::vector<float>(hf.begin() + h0, hf.begin() + h0 + per_head * width)) << what << " head " << j;
    }
  };
  const std::vector<float> qkv = tensor_f32(f, "blk.0.attn_qkv.weight"), qkv_hf = src(la + "in_proj_qkv.weight");
  EXPECT_EQ(std::vector<float>(qkv.begin(), qkv.begin() + qk * H), std::vector<float>(qkv_hf.begin(), qkv_hf.begin() + qk * H));
  check_rows(qkv, qkv_hf, qk, dv, H, "qkv v");
  check_rows(tensor_f32(f, "blk.0.attn_gate.weight"), src(la + "in_proj_z.weight"), 0, dv, H, "z");
  check_rows(tensor_f32(f, "blk.0.ssm_beta.weight"), src(la + "in_proj_b.weight"), 0, 1, H, "b");
  check_rows(tensor_f32(f, "blk.0.ssm_alpha.weight"), src(la + "in_proj_a.weight"), 0, 1, H, "a");
  const std::vector<float> conv = tensor_f32(f, "blk.0.ssm_conv1d.weight"), conv_hf = src(la + "conv1d.weight");
  EXPECT_EQ(std::vector<float>(conv.begin(), conv.begin() + qk * K), std::vector<float>(conv_hf.begin(), conv_hf.begin() + qk * K));
  check_rows(conv, conv_hf, qk, dv, K, "conv1d v");
  std::vector<float> a_log = src(la + "A_log");
  for (float& x : a_log) x = -std::exp(x);
  check_rows(tensor_f32(f, "blk.0.ssm_a"), a_log, 0, 1, 1, "ssm_a");
  check_rows(tensor_f32(f, "blk.0.ssm_dt.bias"), src(la + "dt_bias"), 0, 1, 1, "dt_bias");
  // out_proj [H, n_v * dv]: its columns are the value heads.
  const std::vector<float> out = tensor_f32(f, "blk.0.ssm_out.weight"), out_hf = src(la + "out_proj.weight");
  for (int64_t h = 0; h < H; ++h)
    for (int64_t j = 0; j < nv; ++j)
      for (int64_t d = 0; d < dv; ++d)
        ASSERT_EQ(out[(h * nv + j) * dv + d], out_hf[(h * nv + hf_head(j)) * dv + d]) << h << " " << j << " " << d;
  // The gated norm is shared by the heads and multiplies by w; the other RMSNorms store 1 + w.
  EXPECT_EQ(tensor_f32(f, "blk.0.ssm_norm.weight"), src(la + "norm.weight"));
  std::vector<float> qn = src("model.layers.1.self_attn.q_norm.weight");
  for (float& x : qn) x += 1.0f;
  EXPECT_EQ(tensor_f32(f, "blk.1.attn_q_norm.weight"), qn);
}

// glm4moe: no transform anywhere (GLM's RMSNorms scale by w); the router's score-correction bias
// becomes exp_probs_b, the dense layer's FFN and the shared expert map by name.
TEST_F(ConvertGolden, Glm4MoeTensorsAreTheCheckpoints) {
  const std::string m = "glm4moe_odd";
  if (std::find(golden_models().begin(), golden_models().end(), m) == golden_models().end()) GTEST_SKIP() << "no " << m;
  const Checkpoint c = Checkpoint::open(golden_dir(m));
  const GgufFile f = GgufFile::open(gguf_path(m));
  for (const auto& [g, hf] : std::vector<std::pair<std::string, std::string>>{
           {"output_norm.weight", "model.norm.weight"},
           {"blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"},
           {"blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj.weight"},
           {"blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"},
           {"blk.1.attn_q_norm.weight", "model.layers.1.self_attn.q_norm.weight"},
           {"blk.1.attn_k.bias", "model.layers.1.self_attn.k_proj.bias"},
           {"blk.1.exp_probs_b.bias", "model.layers.1.mlp.gate.e_score_correction_bias"},
           {"blk.1.ffn_gate_inp.weight", "model.layers.1.mlp.gate.weight"},
           {"blk.2.ffn_up_shexp.weight", "model.layers.2.mlp.shared_experts.up_proj.weight"}}) {
    EXPECT_EQ(tensor_f32(f, g), source_all(*c.find(hf))) << g;
  }
}

TEST_F(ConvertGolden, FusedExpertLayoutIsSplitIntoGateAndUp) {
  // qwen3moe_k256 is saved in transformers v5's layout: gate_up_proj [E, 2F, H], gate rows first.
  const std::string m = "qwen3moe_k256";
  const json cfg = read_json(golden_dir(m) + "/config.json");
  const Checkpoint c = Checkpoint::open(golden_dir(m));
  const GgufFile f = GgufFile::open(gguf_path(m));
  const StTensor* gu = c.find("model.layers.1.mlp.experts.gate_up_proj");
  ASSERT_NE(gu, nullptr) << "fixture is not in the fused layout any more";
  const int64_t E = gu->shape[0], F = cfg["moe_intermediate_size"], H = cfg["hidden_size"];
  const std::vector<float> gate = tensor_f32(f, "blk.1.ffn_gate_exps.weight"), up = tensor_f32(f, "blk.1.ffn_up_exps.weight");
  for (int64_t e = 0; e < E; ++e) {
    EXPECT_EQ(std::vector<float>(gate.begin() + e * F * H, gate.begin() + (e + 1) * F * H), source_rows(*gu, e * 2 * F, F));
    EXPECT_EQ(std::vector<float>(up.begin() + e * F * H, up.begin() + (e + 1) * F * H), source_rows(*gu, e * 2 * F + F, F));
  }
}

TEST_F(ConvertGolden, GptOssFusedExpertsAreDeinterleaved) {
  // transformers' GptOssExperts: gate_up_proj [E, H, 2F] with gate in the even columns, up in
  // the odd ones; GGUF: per expert F rows of H. The fixture exists once make_golden.py made it.
  const std::string m = "gpt_oss_odd";
  if (std::find(golden_models().begin(), golden_models().end(), m) == golden_models().end()) {
    GTEST_SKIP() << "no tests/golden/" << m << " yet (make_golden.py models --only " << m << ")";
  }
  const json cfg = read_json(golden_dir(m) + "/config.json");
  const Checkpoint c = Checkpoint::open(golden_dir(m));
  const GgufFile f = GgufFile::open(gguf_path(m));
  const int64_t E = cfg["num_local_experts"], F = cfg["intermediate_size"], H = cfg["hidden_size"];
  const StTensor* gu = c.find("model.layers.1.mlp.experts.gate_up_proj");
  const StTensor* gub = c.find("model.layers.1.mlp.experts.gate_up_proj_bias");
  ASSERT_NE(gu, nullptr) << "fixture is not in the bf16 fused layout";
  ASSERT_NE(gub, nullptr);
  ASSERT_EQ(gu->shape, (std::vector<int64_t>{E, H, 2 * F}));
  const std::vector<float> src = source_all(*gu), bias = source_all(*gub);
  const std::vector<float> gate = tensor_f32(f, "blk.1.ffn_gate_exps.weight"), up = tensor_f32(f, "blk.1.ffn_up_exps.weight");
  const std::vector<float> gb = tensor_f32(f, "blk.1.ffn_gate_exps.bias"), ub = tensor_f32(f, "blk.1.ffn_up_exps.bias");
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = 0; r < F; ++r) {
      for (int64_t h = 0; h < H; ++h) {
        ASSERT_EQ(gate[(e * F + r) * H + h], src[(e * H + h) * 2 * F + 2 * r]) << e << " " << r << " " << h;
        ASSERT_EQ(up[(e * F + r) * H + h], src[(e * H + h) * 2 * F + 2 * r + 1]) << e << " " << r << " " << h;
      }
      ASSERT_EQ(gb[e * F + r], bias[e * 2 * F + 2 * r]);
      ASSERT_EQ(ub[e * F + r], bias[e * 2 * F + 2 * r + 1]);
    }
  }
}

// The strongest check before moraine has its own forward: llama.cpp, reading our GGUF, computes
// the logits transformers computed from the safetensors, continues greedily the same way and
// tokenizes like the HF tokenizer. One node start for every model.
TEST_F(ConvertGolden, LlamaCppReproducesTransformersLogitsAndGreedy) {
  const std::string oracle = std::string(MORAINE_SOURCE_DIR) + "/.cache/oracle";
  ASSERT_TRUE(fs::exists(oracle + "/node_modules/node-llama-cpp/package.json"))
      << "llama.cpp oracle missing at " << oracle << ": run tests/oracle/setup";
  json jobs = json::array();
  for (const std::string& m : golden_models()) {
    const json tokens = read_json(golden_dir(m) + "/tokens.json");
    const json greedy = read_json(golden_dir(m) + "/greedy.json");
    json texts = json::array({tokens["text"]});
    for (const json& c : tokens["tokenizer_cases"]) texts.push_back(c["text"]);
    jobs.push_back({{"gguf", gguf_path(m)}, {"tokens", tokens["ids"]}, {"n_greedy", greedy["tokens"].size()},
                    {"logits_out", scratch_->file(m + ".llama.f32")}, {"texts", texts}});
  }
  for (const auto& [m, t] : kNarrow) {
    jobs.push_back({{"gguf", narrow_path(m, t)}, {"tokens", read_json(golden_dir(m) + "/tokens.json")["ids"]},
                    {"n_greedy", 1}, {"logits_out", narrow_path(m, t) + ".llama.f32"}});
  }
  {
    std::ofstream(scratch_->file("job.json")) << jobs.dump();
  }
  const std::string script = std::string(MORAINE_SOURCE_DIR) + "/tests/convert/llama_golden.mjs";
  const std::string cmd = "node " + shell_quote(script) + " " + shell_quote(oracle) + " " +
                          shell_quote(scratch_->file("job.json")) + " >" + shell_quote(scratch_->file("report.json")) +
                          " 2>" + shell_quote(scratch_->file("node.stderr"));
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "node failed:\n" << read_text(scratch_->file("node.stderr"));
  const json report = read_json(scratch_->file("report.json"));

  for (const std::string& m : golden_models()) {
    SCOPED_TRACE(m);
    const json& r = report.at(gguf_path(m));
    ASSERT_TRUE(r["loaded"].get<bool>()) << r.value("error", "");
    const json shape = read_json(golden_dir(m) + "/logits.json")["shape"];
    const int64_t P = shape[0], V = shape[1];
    ASSERT_EQ(r["n_vocab"].get<int64_t>(), V);
    const std::vector<float> hf = read_f32(golden_dir(m) + "/logits.f32");
    const std::vector<float> ll = read_f32(scratch_->file(m + ".llama.f32"));
    ASSERT_EQ(hf.size(), static_cast<size_t>(P * V));
    ASSERT_EQ(ll.size(), hf.size());
    float max_abs = 0.0f;
    for (float x : hf) max_abs = std::max(max_abs, std::fabs(x));
    // A file where llama.cpp computes another YaRN than transformers (round_yarn_as_llama_cpp):
    // llama.cpp is held to moraine's reference computing llama.cpp's rounding on the same file
    // (the conversion's check), and its gap to transformers is only printed; the reference's own
    // match with transformers is reference_golden_test's.
    model::Model mm = model::Model::load(gguf_path(m));
    const bool other_yarn = round_yarn_as_llama_cpp(mm);
    std::vector<float> want = hf;
    if (other_yarn) {
      const std::vector<int32_t> ids = read_json(golden_dir(m) + "/tokens.json")["ids"].get<std::vector<int32_t>>();
      want = reference::ReferenceExecutor(mm, {2}).forward(ids, true);
      ASSERT_EQ(want.size(), hf.size());
    }
    double worst = 0.0, worst_hf = 0.0;
    for (int64_t p = 0; p < P; ++p) {
      double d = 0.0, d_hf = 0.0;
      for (int64_t v = 0; v < V; ++v) {
        d = std::max<double>(d, std::fabs(want[p * V + v] - ll[p * V + v]));
        d_hf = std::max<double>(d_hf, std::fabs(hf[p * V + v] - ll[p * V + v]));
      }
      worst = std::max(worst, d);
      worst_hf = std::max(worst_hf, d_hf);
      EXPECT_LE(d, 1e-4 * max_abs) << "position " << p;
    }
    std::printf("[ %s ] llama.cpp vs %s: max |dlogit| %.3g = %.3g x max|logit| (%.3g)%s\n", m.c_str(),
                other_yarn ? "the reference with llama.cpp's YaRN rounding" : "transformers", worst, worst / max_abs,
                max_abs, other_yarn ? (" ; vs transformers " + std::to_string(worst_hf / max_abs) + " x max").c_str() : "");
    // transformers' greedy path is not llama.cpp's where their YaRN differs (other_yarn).
    if (!other_yarn) {
      // Greedy: identical, except that the paths may part at a step where transformers' own top-2
      // margin is within what the two engines may differ by (2 x the logit tolerance): a near-tie
      // either may break. After such a step the continuations are no longer comparable.
      const json greedy = read_json(golden_dir(m) + "/greedy.json");
      const json& mine = r["greedy"];
      ASSERT_EQ(mine.size(), greedy["tokens"].size());
      size_t agreed = 0;
      for (; agreed < mine.size(); ++agreed) {
        if (mine[agreed] == greedy["tokens"][agreed]) continue;
        EXPECT_LE(greedy["top1_top2_margin"][agreed].get<double>(), 2e-4 * max_abs)
            << "greedy step " << agreed << ": llama.cpp chose " << mine[agreed] << ", transformers "
            << greedy["tokens"][agreed] << " by a clear margin";
        break;
      }
      std::printf("[ %s ] greedy: %zu of %zu tokens identical\n", m.c_str(), agreed, mine.size());
      EXPECT_GE(agreed, 16u) << "the fixture's greedy path has a near-tie too early to test much";
    }

    // The converted vocabulary tokenizes like the fixture's tokenizer.json did in HF tokenizers.
    const json tokens = read_json(golden_dir(m) + "/tokens.json");
    ASSERT_EQ(r["tokenized"].size(), 1 + tokens["tokenizer_cases"].size());
    EXPECT_EQ(r["tokenized"][0], tokens["full_encoding"]) << tokens["text"];
    for (size_t i = 0; i < tokens["tokenizer_cases"].size(); ++i) {
      EXPECT_EQ(r["tokenized"][i + 1], tokens["tokenizer_cases"][i]["ids"]) << tokens["tokenizer_cases"][i]["text"];
    }
  }

  // llama.cpp loads the narrow files and sees the types we wrote (ggml ids: 0 F32, 1 F16, 8 Q8_0,
  // 30 BF16); they are only loaded here, their values are checked against the source below.
  for (const auto& [m, t] : kNarrow) {
    SCOPED_TRACE(narrow_path(m, t));
    const json& r = report.at(narrow_path(m, t));
    ASSERT_TRUE(r["loaded"].get<bool>()) << r.value("error", "");
    const GgufFile f = GgufFile::open(narrow_path(m, t));
    ASSERT_EQ(r["tensors"].size(), f.tensors().size());
    for (const gguf::TensorInfo& ti : f.tensors()) {
      EXPECT_EQ(r["tensors"][ti.name].get<uint32_t>(), static_cast<uint32_t>(ti.type)) << ti.name;
    }
    EXPECT_EQ(static_cast<TensorType>(r["tensors"]["blk.0.ffn_gate_exps.weight"].get<uint32_t>()), t);
  }
}

TEST(ConvertOutTypes, Bf16F16AndQ8_0HoldTheSourceValues) {
  Scratch s("convert-types");
  const std::string m = "qwen3moe_odd";
  const Checkpoint c = Checkpoint::open(golden_dir(m));
  std::map<TensorType, std::string> paths;
  for (TensorType t : {TensorType::BF16, TensorType::F16, TensorType::Q8_0}) {
    ConvertOptions opt;
    opt.hf_dir = golden_dir(m);
    opt.out_path = s.file(std::string(type_name(t)) + ".gguf");
    opt.outtype = t;
    const ConvertResult r = convert_hf_to_gguf(opt);
    paths[t] = opt.out_path;
    if (t == TensorType::Q8_0) {
      // ffn_down_exps rows are moe_intermediate_size = 40 long: no whole Q8_0 blocks, so F16.
      ASSERT_FALSE(r.notes.empty());
      EXPECT_NE(r.notes[0].find("ffn_down_exps"), std::string::npos) << r.notes[0];
    }
  }
  const StTensor& q = *c.find("model.layers.1.self_attn.q_proj.weight");
  const std::vector<float> want = source_all(q);
  {
    const GgufFile f = GgufFile::open(paths[TensorType::BF16]);
    EXPECT_EQ(f.get_u64("general.file_type"), 32u);
    EXPECT_EQ(f.find_tensor("blk.1.attn_q.weight")->type, TensorType::BF16);
    EXPECT_EQ(f.find_tensor("blk.1.attn_norm.weight")->type, TensorType::F32);
    EXPECT_EQ(f.find_tensor("blk.1.ffn_gate_inp.weight")->type, TensorType::F32);
    // bf16 sources are exact in bf16: the conversion is lossless, bit for bit.
    const gguf::TensorInfo* t = f.find_tensor("blk.1.attn_q.weight");
    EXPECT_EQ(0, std::memcmp(t->data, q.data, q.n_bytes));
  }
  {
    const GgufFile f = GgufFile::open(paths[TensorType::F16]);
    EXPECT_EQ(f.get_u64("general.file_type"), 1u);
    const std::vector<float> got = tensor_f32(f, "blk.1.attn_q.weight");
    for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(got[i], fp16_to_fp32(fp32_to_fp16(want[i]))) << i;
  }
  {
    const GgufFile f = GgufFile::open(paths[TensorType::Q8_0]);
    EXPECT_EQ(f.get_u64("general.file_type"), 7u);
    EXPECT_EQ(f.find_tensor("blk.1.attn_q.weight")->type, TensorType::Q8_0);
    EXPECT_EQ(f.find_tensor("blk.1.ffn_down_exps.weight")->type, TensorType::F16);
    const std::vector<float> got = tensor_f32(f, "blk.1.attn_q.weight");
    // Q8_0 rounds to the nearest of 255 levels of step max|block|/127: error <= half a step
    // (plus the f16 rounding of the scale, < 2^-10 relative, times 127 levels).
    for (size_t b = 0; b < want.size() / 32; ++b) {
      float amax = 0.0f;
      for (size_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(want[b * 32 + i]));
      const float step = amax / 127.0f;
      for (size_t i = 0; i < 32; ++i) {
        ASSERT_LE(std::fabs(got[b * 32 + i] - want[b * 32 + i]), 0.5f * step + amax * (1.0f / 1024.0f))
            << "block " << b << " element " << i;
      }
    }
  }
}

}  // namespace
}  // namespace moraine::convert::test
