// moraine-convert refuses what it does not understand, naming it: an unknown architecture, a
// tensor it cannot map, a missing or misshapen tensor, settings the GGUF architecture cannot
// express, unsupported dtypes, broken files. Each case starts from a golden checkpoint
// (tests/golden/qwen3moe_odd) with one thing changed.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <functional>

#include "tests/convert/convert_test_util.h"
#include "tools/convert/convert.h"
#include "tools/convert/safetensors.h"

namespace moraine::convert::test {
namespace {

using nlohmann::json;

// A golden checkpoint's tensors as raw bytes (so a case can add, drop or reshape).
std::vector<RawTensor> golden_tensors(const std::string& model = "qwen3moe_odd") {
  const Checkpoint c = Checkpoint::open(golden_dir(model));
  std::vector<RawTensor> out;
  for (const StTensor& t : c.tensors()) {
    RawTensor r{t.name, "BF16", t.shape, std::vector<uint8_t>(t.data, t.data + t.n_bytes)};
    if (t.dtype != StDtype::BF16) throw std::runtime_error("fixture tensor " + t.name + " is not bf16");
    out.push_back(std::move(r));
  }
  return out;
}

// A checkpoint folder: the golden config and tokenizer (after `edit_config`), and `tensors`.
class Case {
 public:
  Case(const std::vector<RawTensor>& tensors, const std::function<void(json&)>& edit_config = {},
       const std::string& model = "qwen3moe_odd")
      : dir_("convert-refusal") {
    json cfg = read_json(golden_dir(model) + "/config.json");
    if (edit_config) edit_config(cfg);
    std::ofstream(dir_.file("config.json")) << cfg.dump(1);
    for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
      fs::copy_file(golden_dir(model) + "/" + f, dir_.file(f));
    }
    write_safetensors(dir_.file("model.safetensors"), tensors);
  }
  const Scratch& dir() const { return dir_; }

  // Converts; the converter's error, if any, fails the test.
  void converts() const {
    ConvertOptions opt;
    opt.hf_dir = dir_.path();
    opt.out_path = dir_.file("out.gguf");
    opt.outtype = TensorType::F32;
    EXPECT_NO_THROW(convert_hf_to_gguf(opt));
  }

  // The converter's error message; fails the test when it converts instead.
  std::string error() const {
    ConvertOptions opt;
    opt.hf_dir = dir_.path();
    opt.out_path = dir_.file("out.gguf");
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

 private:
  Scratch dir_;
};

TEST(ConvertRefusal, GoldenCopyConverts) {
  // The base every refusal case edits converts as it is: the refusals below are caused by the edit.
  Case c(golden_tensors());
  ConvertOptions opt;
  opt.hf_dir = c.dir().path();
  opt.out_path = c.dir().file("out.gguf");
  opt.outtype = TensorType::F32;
  EXPECT_EQ(convert_hf_to_gguf(opt).arch, "qwen3moe");
}

TEST(ConvertRefusal, UnknownArchitectureIsNamed) {
  Case c(golden_tensors(), [](json& cfg) { cfg["architectures"] = {"LlamaForCausalLM"}; });
  const std::string e = c.error();
  EXPECT_NE(e.find("LlamaForCausalLM"), std::string::npos) << e;
  EXPECT_NE(e.find("Qwen3MoeForCausalLM"), std::string::npos) << "should list what it knows: " << e;
}

TEST(ConvertRefusal, UnmappableTensorIsNamed) {
  auto t = golden_tensors();
  t.push_back({"model.layers.1.mlp.mystery.weight", "BF16", {4, 8}, std::vector<uint8_t>(64, 0)});
  const std::string e = Case(t).error();
  EXPECT_NE(e.find("model.layers.1.mlp.mystery.weight"), std::string::npos) << e;
}

TEST(ConvertRefusal, MissingTensorIsNamed) {
  auto t = golden_tensors();
  std::erase_if(t, [](const RawTensor& r) { return r.name == "model.layers.2.mlp.experts.5.up_proj.weight"; });
  const std::string e = Case(t).error();
  EXPECT_NE(e.find("model.layers.2.mlp.experts.5.up_proj.weight"), std::string::npos) << e;
}

TEST(ConvertRefusal, MisshapenTensorIsNamedWithBothShapes) {
  auto t = golden_tensors();
  for (RawTensor& r : t) {
    if (r.name == "model.layers.0.self_attn.k_proj.weight") r.shape = {r.shape[1], r.shape[0]};
  }
  const std::string e = Case(t).error();
  EXPECT_NE(e.find("model.layers.0.self_attn.k_proj.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("[96, 48]"), std::string::npos) << e;
  EXPECT_NE(e.find("[48, 96]"), std::string::npos) << e;
}

TEST(ConvertRefusal, InexpressibleConfigIsNamed) {
  {
    const std::string e = Case(golden_tensors(), [](json& c) { c["norm_topk_prob"] = false; }).error();
    EXPECT_NE(e.find("norm_topk_prob"), std::string::npos) << e;
  }
  {
    const std::string e = Case(golden_tensors(), [](json& c) { c["mlp_only_layers"] = {1}; }).error();
    EXPECT_NE(e.find("mlp_only_layers"), std::string::npos) << e;
  }
  {
    const std::string e = Case(golden_tensors(), [](json& c) {
                            c["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"rope_theta", 1e6}};
                          }).error();
    EXPECT_NE(e.find("yarn"), std::string::npos) << e;
  }
  {
    const std::string e = Case(golden_tensors(), [](json& c) { c.erase("hidden_size"); }).error();
    EXPECT_NE(e.find("hidden_size"), std::string::npos) << e;
  }
}

// deepseek2: settings where transformers and llama.cpp's deepseek2 would compute different models.
TEST(ConvertRefusal, Deepseek2SettingsTheGgufCannotHoldAreNamed) {
  const auto err = [](const char* model, const std::function<void(json&)>& edit) {
    return Case(golden_tensors(model), edit, model).error();
  };
  const auto has = [](const std::string& e, const char* w) { EXPECT_NE(e.find(w), std::string::npos) << "missing '" << w << "' in: " << e; };
  has(err("deepseek_v3", [](json& c) { c["scoring_func"] = "softmax"; }), "scoring_func");
  has(err("deepseek_v2", [](json& c) { c["scoring_func"] = "sigmoid"; }), "scoring_func");
  has(err("deepseek_v2", [](json& c) { c["topk_method"] = "group_limited_greedy"; }), "topk_method");
  has(err("deepseek_v2", [](json& c) { c["n_group"] = 2; c["topk_group"] = 1; }), "n_group");
  has(err("deepseek_v3", [](json& c) { c["topk_group"] = 4; }), "topk_group");
  has(err("deepseek_v3", [](json& c) { c["rope_parameters"]["mscale"] = 0.5; }), "rope_parameters.mscale");
  has(err("deepseek_v3", [](json& c) { c["rope_parameters"].erase("mscale_all_dim"); }), "mscale_all_dim");
  has(err("deepseek_v3", [](json& c) { c["rope_parameters"]["factor"] = 20.0; }), "rope_parameters.factor");
  has(err("deepseek_v3", [](json& c) { c["rope_parameters"]["beta_fast"] = 16.0; }), "beta_fast");
  has(err("deepseek_v3", [](json& c) { c["rope_parameters"]["rope_type"] = "linear"; }), "rope_type");
  has(err("deepseek_v3", [](json& c) { c["num_key_value_heads"] = 2; }), "num_key_value_heads");
  has(err("deepseek_v3", [](json& c) { c["attention_bias"] = true; }), "attention_bias");
  has(err("deepseek_v2", [](json& c) { c.erase("kv_lora_rank"); }), "kv_lora_rank");
  // A checkpoint of the wrong q path: q LoRA tensors where config.json says q directly.
  has(err("deepseek_v3", [](json& c) { c["q_lora_rank"] = nullptr; }), "self_attn.q_proj.weight");
}

// MTP layers (model.layers.{n_layer}) are dropped as llama.cpp's converter drops them, but only
// where config.json declares them.
TEST(ConvertRefusal, Deepseek2MtpLayersAreDroppedOnlyWhereDeclared) {
  std::vector<RawTensor> t = golden_tensors("deepseek_v3");
  RawTensor extra = t.front();
  extra.name = "model.layers.3.eh_proj.weight";
  t.push_back(extra);
  Case(t, {}, "deepseek_v3").converts();
  const std::string e = Case(t, [](json& c) { c.erase("num_nextn_predict_layers"); }, "deepseek_v3").error();
  EXPECT_NE(e.find("model.layers.3.eh_proj.weight"), std::string::npos) << e;
}

TEST(ConvertRefusal, UnsupportedDtypeIsNamed) {
  auto t = golden_tensors();
  for (RawTensor& r : t) {
    if (r.name == "model.norm.weight") {
      r.dtype = "I64";
      r.bytes.resize(r.bytes.size() * 4);
    }
  }
  const std::string e = Case(t).error();
  EXPECT_NE(e.find("model.norm.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("I64"), std::string::npos) << e;
}

TEST(ConvertRefusal, BrokenSafetensorsSaySoWithoutCrashing) {
  Case c(golden_tensors());
  const std::string path = c.dir().file("model.safetensors");
  const std::string bytes = read_text(path);
  {
    // Header length pointing past the end of the file.
    std::string b = bytes;
    const uint64_t huge = 1ull << 40;
    std::memcpy(b.data(), &huge, 8);
    std::ofstream(path, std::ios::binary) << b;
    const std::string e = c.error();
    EXPECT_NE(e.find("header length"), std::string::npos) << e;
  }
  {
    // Truncated data: the last tensor's bytes run past the end.
    std::ofstream(path, std::ios::binary) << bytes.substr(0, bytes.size() - 100);
    const std::string e = c.error();
    EXPECT_NE(e.find("data_offsets"), std::string::npos) << e;
  }
  {
    // Header that is not JSON.
    std::string b = bytes;
    b[9] = '#';
    std::ofstream(path, std::ios::binary) << b;
    const std::string e = c.error();
    EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;
  }
}

TEST(ConvertRefusal, UnknownPreTokenizerIsNamed) {
  Case c(golden_tensors());
  json tok = read_json(c.dir().file("tokenizer.json"));
  tok["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\s+|\\w+";
  std::ofstream(c.dir().file("tokenizer.json")) << tok.dump();
  const std::string e = c.error();
  EXPECT_NE(e.find("pre_tokenizer"), std::string::npos) << e;
  EXPECT_NE(e.find("\\\\s+|\\\\w+"), std::string::npos) << e;
}

TEST(ConvertCli, ReportsProgressAndErrors) {
  const std::string tool = std::string(MORAINE_BUILD_DIR) + "/tools/moraine-convert";
  ASSERT_TRUE(fs::exists(tool)) << tool << " is not built";
  Scratch s("convert-cli");
  {
    const std::string cmd = shell_quote(tool) + " " + shell_quote(golden_dir("qwen3next_k256")) + " " +
                            shell_quote(s.file("ok.gguf")) + " --outtype q8_0 2>" + shell_quote(s.file("err"));
    ASSERT_EQ(std::system(cmd.c_str()), 0) << read_text(s.file("err"));
    const std::string err = read_text(s.file("err"));
    EXPECT_NE(err.find("[1/37] token_embd.weight"), std::string::npos) << err;
    EXPECT_NE(err.find("[37/37] output.weight"), std::string::npos) << err;
    EXPECT_TRUE(fs::exists(s.file("ok.gguf")));
  }
  {
    Case c(golden_tensors(), [](json& cfg) { cfg["architectures"] = {"MixtralForCausalLM"}; });
    const std::string cmd = shell_quote(tool) + " " + shell_quote(c.dir().path()) + " " + shell_quote(s.file("bad.gguf")) +
                            " 2>" + shell_quote(s.file("err2"));
    const int rc = std::system(cmd.c_str());
    EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 1) << rc;
    const std::string err = read_text(s.file("err2"));
    EXPECT_NE(err.find("error:"), std::string::npos) << err;
    EXPECT_NE(err.find("MixtralForCausalLM"), std::string::npos) << err;
    EXPECT_FALSE(fs::exists(s.file("bad.gguf")));
  }
}

}  // namespace
}  // namespace moraine::convert::test
