// Every named shape: tensor names, shapes and types, and the metadata llama.cpp reads, checked
// against the published model configurations (written out here, not taken from moraine-synth).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <map>
#include <string>
#include <vector>

#include "common/formats/tensor_type.h"
#include "common/gguf/gguf.h"
#include "synth_run.h"
#include "tests/interop/llama_oracle.h"

namespace moraine::test {
namespace {

using gguf::GgufFile;
using ::testing::HasSubstr;

struct Expected {
  std::string shape, arch;
  int64_t layers, hidden, n_head, n_kv, head_dim, n_rot, experts, used, ff_exp, ff_shexp, ctx, dense_ff;
  double theta;
  // qwen3next linear attention
  int64_t interval = 0, conv = 0, ssm_dim = 0, k_heads = 0, v_heads = 0;
};

// Qwen3-30B-A3B and Qwen3-Next-80B-A3B from their config.json; the tiny ones as documented.
const std::vector<Expected>& expected_shapes() {
  static const std::vector<Expected> v = {
      {"qwen3moe-30b-a3b", "qwen3moe", 48, 2048, 32, 4, 128, 128, 128, 8, 768, 0, 40960, 6144, 1e6},
      {"qwen3next-80b-a3b", "qwen3next", 48, 2048, 16, 2, 256, 64, 512, 10, 512, 512, 262144, 5120, 1e7,
       4, 4, 128, 16, 32},
      {"qwen3moe-tiny", "qwen3moe", 4, 256, 8, 2, 32, 32, 8, 2, 256, 0, 4096, 768, 1e6},
      {"qwen3next-tiny", "qwen3next", 4, 256, 4, 2, 64, 16, 16, 4, 128, 128, 4096, 768, 1e7, 4, 4, 32, 4, 8},
  };
  return v;
}

using ShapeMap = std::map<std::string, std::vector<int64_t>>;

// The tensors llama.cpp's qwen3moe / qwen3next loaders create, with their ggml shapes.
ShapeMap expected_tensors(const Expected& e, int64_t layers, int64_t experts, int64_t vocab) {
  ShapeMap m;
  const int64_t H = e.hidden, F = e.ff_exp, E = experts;
  m["token_embd.weight"] = {H, vocab};
  m["output_norm.weight"] = {H};
  m["output.weight"] = {H, vocab};
  for (int64_t il = 0; il < layers; ++il) {
    const std::string b = "blk." + std::to_string(il) + ".";
    const bool next = e.arch == "qwen3next";
    m[b + "attn_norm.weight"] = {H};
    if (next && (il + 1) % e.interval != 0) {
      const int64_t kd = e.k_heads * e.ssm_dim, vd = e.v_heads * e.ssm_dim;
      m[b + "attn_qkv.weight"] = {H, 2 * kd + vd};
      m[b + "attn_gate.weight"] = {H, vd};
      m[b + "ssm_ba.weight"] = {H, 2 * e.v_heads};
      m[b + "ssm_conv1d.weight"] = {e.conv, 2 * kd + vd};
      m[b + "ssm_dt.bias"] = {e.v_heads};
      m[b + "ssm_a"] = {e.v_heads};
      m[b + "ssm_norm.weight"] = {e.ssm_dim};
      m[b + "ssm_out.weight"] = {vd, H};
    } else {
      m[b + "attn_q.weight"] = {H, e.n_head * e.head_dim * (next ? 2 : 1)};
      m[b + "attn_k.weight"] = {H, e.n_kv * e.head_dim};
      m[b + "attn_v.weight"] = {H, e.n_kv * e.head_dim};
      m[b + "attn_output.weight"] = {e.n_head * e.head_dim, H};
      m[b + "attn_q_norm.weight"] = {e.head_dim};
      m[b + "attn_k_norm.weight"] = {e.head_dim};
    }
    m[b + (next ? "post_attention_norm.weight" : "ffn_norm.weight")] = {H};
    m[b + "ffn_gate_inp.weight"] = {H, E};
    m[b + "ffn_gate_exps.weight"] = {H, F, E};
    m[b + "ffn_up_exps.weight"] = {H, F, E};
    m[b + "ffn_down_exps.weight"] = {F, H, E};
    if (next) {
      m[b + "ffn_gate_inp_shexp.weight"] = {H};
      m[b + "ffn_gate_shexp.weight"] = {H, e.ff_shexp};
      m[b + "ffn_up_shexp.weight"] = {H, e.ff_shexp};
      m[b + "ffn_down_shexp.weight"] = {e.ff_shexp, H};
    }
  }
  return m;
}

uint64_t u(const GgufFile& f, const std::string& key) {
  const auto v = f.get_u64(key);
  EXPECT_TRUE(v.has_value()) << "missing " << key;
  return v.value_or(~0ull);
}

TEST(SynthShapes, EveryNamedShapeHasLlamaCppTensorsAndMetadata) {
  ScratchDir dir("synth-shapes");
  for (const Expected& e : expected_shapes()) {
    SCOPED_TRACE(e.shape);
    const bool big = e.shape.find("tiny") == std::string::npos;
    // The big shapes with 2 layers of 16 experts and a small vocab keep the files small; the
    // tiny ones are written whole. The next shapes need 4 layers to include an attention layer.
    const int64_t layers = big ? (e.arch == "qwen3next" ? 4 : 2) : e.layers;
    const int64_t experts = big ? 16 : e.experts;
    const int64_t vocab = 1024;
    std::string args = "--shape " + e.shape + " -o " + dir.file(e.shape + ".gguf") + " --vocab-size 1024 --seed 3";
    if (big) args += " --layers " + std::to_string(layers) + " --experts 16";
    const SynthRun r = run_synth(args, dir.path());
    ASSERT_EQ(r.status, 0) << r.err;
    const GgufFile f = GgufFile::open(dir.file(e.shape + ".gguf"));

    const ShapeMap want = expected_tensors(e, layers, experts, vocab);
    ShapeMap got;
    for (const auto& t : f.tensors()) got[t.name] = t.shape;
    EXPECT_EQ(got, want);

    // Types: routers and conv taps F32, experts Q4_K, other matrices Q8_0, vectors F32.
    for (const auto& t : f.tensors()) {
      TensorType want_type = TensorType::Q8_0;
      if (t.shape.size() == 1 || t.name.find("ffn_gate_inp") != std::string::npos ||
          t.name.find("ssm_conv1d") != std::string::npos) {
        want_type = TensorType::F32;
      } else if (t.name.find("_exps.") != std::string::npos) {
        // q4_k needs rows of 256; shorter expert rows (tiny shapes) fall back to q8_0.
        want_type = t.shape[0] % 256 == 0 ? TensorType::Q4_K : TensorType::Q8_0;
      }
      EXPECT_EQ(t.type, want_type) << t.name;
    }

    const std::string a = e.arch + ".";
    EXPECT_EQ(f.get_string("general.architecture"), e.arch);
    EXPECT_EQ(u(f, a + "block_count"), static_cast<uint64_t>(layers));
    EXPECT_EQ(u(f, a + "embedding_length"), static_cast<uint64_t>(e.hidden));
    EXPECT_EQ(u(f, a + "context_length"), static_cast<uint64_t>(e.ctx));
    EXPECT_EQ(u(f, a + "feed_forward_length"), static_cast<uint64_t>(e.dense_ff));
    EXPECT_EQ(u(f, a + "attention.head_count"), static_cast<uint64_t>(e.n_head));
    EXPECT_EQ(u(f, a + "attention.head_count_kv"), static_cast<uint64_t>(e.n_kv));
    EXPECT_EQ(u(f, a + "attention.key_length"), static_cast<uint64_t>(e.head_dim));
    EXPECT_EQ(u(f, a + "attention.value_length"), static_cast<uint64_t>(e.head_dim));
    EXPECT_EQ(u(f, a + "rope.dimension_count"), static_cast<uint64_t>(e.n_rot));
    EXPECT_EQ(u(f, a + "expert_count"), static_cast<uint64_t>(experts));
    EXPECT_EQ(u(f, a + "expert_used_count"), static_cast<uint64_t>(e.used));
    EXPECT_EQ(u(f, a + "expert_feed_forward_length"), static_cast<uint64_t>(e.ff_exp));
    EXPECT_FLOAT_EQ(static_cast<float>(f.get_f64(a + "rope.freq_base").value_or(0)), static_cast<float>(e.theta));
    EXPECT_FLOAT_EQ(static_cast<float>(f.get_f64(a + "attention.layer_norm_rms_epsilon").value_or(0)), 1e-6f);
    if (e.arch == "qwen3next") {
      EXPECT_EQ(u(f, a + "expert_shared_feed_forward_length"), static_cast<uint64_t>(e.ff_shexp));
      EXPECT_EQ(u(f, a + "ssm.conv_kernel"), static_cast<uint64_t>(e.conv));
      EXPECT_EQ(u(f, a + "ssm.state_size"), static_cast<uint64_t>(e.ssm_dim));
      EXPECT_EQ(u(f, a + "ssm.group_count"), static_cast<uint64_t>(e.k_heads));
      EXPECT_EQ(u(f, a + "ssm.time_step_rank"), static_cast<uint64_t>(e.v_heads));
      EXPECT_EQ(u(f, a + "ssm.inner_size"), static_cast<uint64_t>(e.v_heads * e.ssm_dim));
      EXPECT_EQ(u(f, a + "full_attention_interval"), static_cast<uint64_t>(e.interval));
      const gguf::Array* rec = f.get_array(a + "attention.recurrent_layers");
      ASSERT_NE(rec, nullptr);
      ASSERT_EQ(rec->items.size(), static_cast<size_t>(layers));
      for (int64_t il = 0; il < layers; ++il) {
        EXPECT_EQ(rec->items[static_cast<size_t>(il)].as_bool(), (il + 1) % e.interval != 0) << il;
      }
    }
    // The token list matches the embedding, as llama.cpp requires.
    const gguf::Array* tokens = f.get_array("tokenizer.ggml.tokens");
    ASSERT_NE(tokens, nullptr);
    EXPECT_EQ(tokens->items.size(), static_cast<size_t>(vocab));
    EXPECT_EQ(f.get_string("tokenizer.ggml.model"), "gpt2");
  }
}

// GLM-4.5-Air and Qwen3.5-35B-A3B: the published config.json numbers (written out here), on
// files cut to a few layers and 16 experts; the tensor layouts are llama.cpp's (synth_llama_test,
// arch_llama_test).
TEST(SynthShapes, GlmAirAndQwen35CarryTheirPublishedHyperparameters) {
  ScratchDir dir("synth-glm-q35");
  const auto shape_of = [](const GgufFile& f, const std::string& name) {
    const auto* t = f.find_tensor(name);
    return t == nullptr ? std::vector<int64_t>{} : t->shape;
  };
  {
    SynthRun r = run_synth("--shape glm4.5-air --layers 2 --experts 16 --vocab-size 1024 -o " + dir.file("air.gguf"), dir.path());
    ASSERT_EQ(r.status, 0) << r.err;
    const GgufFile f = GgufFile::open(dir.file("air.gguf"));
    const std::string a = "glm4moe.";
    EXPECT_EQ(f.get_string("general.architecture"), "glm4moe");
    EXPECT_EQ(u(f, a + "embedding_length"), 4096u);
    EXPECT_EQ(u(f, a + "context_length"), 131072u);
    EXPECT_EQ(u(f, a + "feed_forward_length"), 10944u);
    EXPECT_EQ(u(f, a + "attention.head_count"), 96u);
    EXPECT_EQ(u(f, a + "attention.head_count_kv"), 8u);
    EXPECT_EQ(u(f, a + "attention.key_length"), 128u);
    EXPECT_EQ(u(f, a + "rope.dimension_count"), 64u);
    EXPECT_EQ(u(f, a + "expert_used_count"), 8u);
    EXPECT_EQ(u(f, a + "expert_feed_forward_length"), 1408u);
    EXPECT_EQ(u(f, a + "expert_shared_count"), 1u);
    EXPECT_EQ(u(f, a + "leading_dense_block_count"), 1u);
    EXPECT_EQ(f.find(a + "expert_weights_norm")->as_bool(), true);
    EXPECT_FLOAT_EQ(static_cast<float>(f.get_f64(a + "expert_weights_scale").value_or(0)), 1.0f);
    EXPECT_FLOAT_EQ(static_cast<float>(f.get_f64(a + "rope.freq_base").value_or(0)), 1e6f);
    EXPECT_FLOAT_EQ(static_cast<float>(f.get_f64(a + "attention.layer_norm_rms_epsilon").value_or(0)), 1e-5f);
    EXPECT_EQ(shape_of(f, "blk.0.ffn_gate.weight"), (std::vector<int64_t>{4096, 10944}));
    EXPECT_EQ(shape_of(f, "blk.0.attn_q.bias"), (std::vector<int64_t>{96 * 128}));
    EXPECT_EQ(shape_of(f, "blk.1.exp_probs_b.bias"), (std::vector<int64_t>{16}));
    EXPECT_EQ(shape_of(f, "blk.1.ffn_up_shexp.weight"), (std::vector<int64_t>{4096, 1408}));
    EXPECT_EQ(f.find_tensor("blk.1.ffn_gate_inp_shexp.weight"), nullptr);   // the shared expert has no gate
    EXPECT_EQ(f.find_tensor("blk.0.attn_q_norm.weight"), nullptr);          // Air has no q/k norm
    EXPECT_EQ(f.find_tensor("blk.0.ffn_gate_inp.weight"), nullptr);         // layer 0 is dense
  }
  {
    SynthRun r = run_synth("--shape qwen35moe-35b-a3b --layers 4 --experts 16 --vocab-size 1024 -o " + dir.file("q35.gguf"),
                           dir.path());
    ASSERT_EQ(r.status, 0) << r.err;
    const GgufFile f = GgufFile::open(dir.file("q35.gguf"));
    const std::string a = "qwen35moe.";
    EXPECT_EQ(f.get_string("general.architecture"), "qwen35moe");
    EXPECT_EQ(u(f, a + "embedding_length"), 2048u);
    EXPECT_EQ(u(f, a + "context_length"), 262144u);
    EXPECT_EQ(u(f, a + "attention.head_count"), 16u);
    EXPECT_EQ(u(f, a + "attention.head_count_kv"), 2u);
    EXPECT_EQ(u(f, a + "attention.key_length"), 256u);
    EXPECT_EQ(u(f, a + "rope.dimension_count"), 64u);
    EXPECT_EQ(u(f, a + "expert_used_count"), 8u);
    EXPECT_EQ(u(f, a + "expert_feed_forward_length"), 512u);
    EXPECT_EQ(u(f, a + "expert_shared_feed_forward_length"), 512u);
    EXPECT_EQ(u(f, a + "ssm.conv_kernel"), 4u);
    EXPECT_EQ(u(f, a + "ssm.state_size"), 128u);
    EXPECT_EQ(u(f, a + "ssm.group_count"), 16u);
    EXPECT_EQ(u(f, a + "ssm.time_step_rank"), 32u);
    EXPECT_EQ(u(f, a + "ssm.inner_size"), 32u * 128u);
    EXPECT_EQ(u(f, a + "full_attention_interval"), 4u);
    EXPECT_FLOAT_EQ(static_cast<float>(f.get_f64(a + "rope.freq_base").value_or(0)), 1e7f);
    const gguf::Array* sec = f.get_array(a + "rope.dimension_sections");
    ASSERT_NE(sec, nullptr);
    ASSERT_EQ(sec->items.size(), 4u);
    const int64_t want[4] = {11, 11, 10, 0};
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(sec->items[i].as_i64(), want[i]) << i;
    EXPECT_EQ(shape_of(f, "blk.0.ssm_beta.weight"), (std::vector<int64_t>{2048, 32}));
    EXPECT_EQ(shape_of(f, "blk.0.ssm_alpha.weight"), (std::vector<int64_t>{2048, 32}));
    EXPECT_EQ(f.find_tensor("blk.0.ssm_ba.weight"), nullptr);
    EXPECT_EQ(shape_of(f, "blk.3.attn_q.weight"), (std::vector<int64_t>{2048, 2 * 16 * 256}));
  }
}

TEST(SynthShapes, ShapeVocabByDefaultAndVocabFromGgufCopiedAndPadded) {
  ScratchDir dir("synth-vocab");
  const GgufFile vocab = GgufFile::open(qwen2_vocab_gguf());
  const gguf::Array* src_tokens = vocab.get_array("tokenizer.ggml.tokens");
  ASSERT_NE(src_tokens, nullptr);
  const size_t n_src = src_tokens->items.size();

  // More rows than the vocab has tokens: padded with unused tokens, and said so.
  const size_t n_vocab = n_src + 77;
  SynthRun r = run_synth("--shape qwen3moe-tiny --layers 1 -o " + dir.file("pad.gguf") + " --vocab-from " +
                             qwen2_vocab_gguf() + " --vocab-size " + std::to_string(n_vocab),
                         dir.path());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("padded"));
  const GgufFile f = GgufFile::open(dir.file("pad.gguf"));
  EXPECT_EQ(f.find_tensor("token_embd.weight")->shape[1], static_cast<int64_t>(n_vocab));
  EXPECT_EQ(f.find_tensor("output.weight")->shape[1], static_cast<int64_t>(n_vocab));
  // Every tokenizer.* key of the source is there; the per-token arrays agree on the source's
  // tokens and are padded past them.
  int copied = 0;
  for (const auto& [key, value] : vocab.metadata()) {
    if (key.rfind("tokenizer.", 0) != 0) continue;
    ++copied;
    const gguf::Value* got = f.find(key);
    ASSERT_NE(got, nullptr) << key;
    if (key == "tokenizer.ggml.tokens" || key == "tokenizer.ggml.token_type" || key == "tokenizer.ggml.scores") {
      const gguf::Array* a = got->as_array();
      ASSERT_EQ(a->items.size(), n_vocab) << key;
      for (size_t i = 0; i < n_src; i += 997) {
        EXPECT_EQ(a->items[i].to_display(), value.as_array()->items[i].to_display()) << key << " " << i;
      }
      if (key == "tokenizer.ggml.token_type") {
        EXPECT_EQ(a->items[n_vocab - 1].as_i64(), 5);  // unused
      }
    } else {
      EXPECT_EQ(got->to_display(1u << 20), value.to_display(1u << 20)) << key;
    }
  }
  EXPECT_GE(copied, 5);

  // A --vocab-size smaller than the vocabulary is refused, naming both.
  r = run_synth("--shape qwen3moe-tiny --layers 1 -o " + dir.file("small.gguf") + " --vocab-from " +
                    qwen2_vocab_gguf() + " --vocab-size 1000",
                dir.path());
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.err, HasSubstr("more than --vocab-size 1000"));
}

TEST(SynthShapes, TokenizerJsonImported) {
  ScratchDir dir("synth-tokjson");
  const std::string tok = std::string(MORAINE_SOURCE_DIR) + "/tests/golden/qwen3moe_odd/tokenizer.json";
  const SynthRun r = run_synth("--shape qwen3moe-tiny --layers 1 -o " + dir.file("t.gguf") + " --tokenizer-json " + tok +
                                   " --vocab-size 151936",
                               dir.path());
  ASSERT_EQ(r.status, 0) << r.err;
  const GgufFile f = GgufFile::open(dir.file("t.gguf"));
  EXPECT_EQ(f.get_string("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(f.get_string("tokenizer.ggml.pre"), "qwen2");
  std::ifstream in(tok);
  const nlohmann::json j = nlohmann::json::parse(in);
  ASSERT_NE(f.get_array("tokenizer.ggml.merges"), nullptr);
  EXPECT_EQ(f.get_array("tokenizer.ggml.merges")->items.size(), j["model"]["merges"].size());
  EXPECT_GT(j["model"]["merges"].size(), 100u);
  EXPECT_EQ(f.get_array("tokenizer.ggml.tokens")->items.size(), 151936u);
}

TEST(SynthShapes, MapRulesOverrideTheBuiltInOnesAndBadInputIsNamed) {
  ScratchDir dir("synth-map");
  SynthRun r = run_synth("--shape qwen3moe-tiny --layers 1 --vocab-size 512 -o " + dir.file("m.gguf") +
                             " --map ffn_down_exps=q6_k --map ffn_gate_inp=q8_0 --default f16",
                         dir.path());
  ASSERT_EQ(r.status, 0) << r.err;
  const GgufFile f = GgufFile::open(dir.file("m.gguf"));
  EXPECT_EQ(f.find_tensor("blk.0.ffn_down_exps.weight")->type, TensorType::Q6_K);
  EXPECT_EQ(f.find_tensor("blk.0.ffn_up_exps.weight")->type, TensorType::Q4_K);
  EXPECT_EQ(f.find_tensor("blk.0.ffn_gate_inp.weight")->type, TensorType::Q8_0);
  EXPECT_EQ(f.find_tensor("blk.0.attn_q.weight")->type, TensorType::F16);
  EXPECT_EQ(f.find_tensor("blk.0.attn_norm.weight")->type, TensorType::F32);

  r = run_synth("--shape qwen3moe-huge -o " + dir.file("x.gguf"), dir.path());
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.err, HasSubstr("'qwen3moe-huge' is not a known shape"));
  EXPECT_THAT(r.err, HasSubstr("qwen3next-80b-a3b"));
  r = run_synth("--shape qwen3moe-tiny -o " + dir.file("x.gguf") + " --map attn_v=q7_k", dir.path());
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.err, HasSubstr("'q7_k' is not a type"));
  r = run_synth("--shape qwen3moe-tiny -o " + dir.file("x.gguf") + " --vocab-from " + dir.file("missing.gguf"),
                dir.path());
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.err, HasSubstr("--vocab-from " + dir.file("missing.gguf")));
  EXPECT_FALSE(std::filesystem::exists(dir.file("x.gguf")));
}

}  // namespace
}  // namespace moraine::test
