// Helpers shared by the converter tests: the golden fixtures (tests/golden, made by
// make_golden.py from Hugging Face transformers), scratch folders and a small safetensors writer
// for building deliberately broken checkpoints.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "common/model/model.h"
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace moraine::convert::test {

// llama.cpp rounds YaRN's correction dims whatever the checkpoint says: it has no key for HF's
// truncate=false (gpt-oss's config), which moraine-convert writes as rope.scaling.yarn_truncate
// and the reference honours. This makes the reference compute what llama.cpp computes on such a
// file, so a comparison with llama.cpp checks the conversion, not that known difference (0.26%
// of max |logit| on gpt_oss_odd). Returns whether any layer changed.
inline bool round_yarn_as_llama_cpp(model::Model& m) {
  bool changed = false;
  for (model::LayerWeights& L : m.layers) {
    model::RopePart& r = L.recipe.mixer.attn.rope;
    if (r.scaling == model::RopeScaling::Yarn && !r.yarn_truncate) {
      r.yarn_truncate = true;
      changed = true;
    }
  }
  return changed;
}


namespace fs = std::filesystem;

inline std::string golden_dir(const std::string& model) {
  return std::string(MORAINE_SOURCE_DIR) + "/tests/golden/" + model;
}

// The fixtures the converter tests run on: the Qwen ones always, and gpt_oss_odd, qwen2moe_odd,
// glm4moe_odd, qwen35moe_odd once make_golden.py has made them (their folder with config.json and
// transformers' logits).
inline const std::vector<std::string>& golden_models() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v = {"qwen3moe_odd", "qwen3moe_k256", "qwen3next_odd", "qwen3next_k256"};
    for (const char* m : {"gpt_oss_odd", "qwen2moe_odd", "glm4moe_odd", "qwen35moe_odd", "deepseek_v2", "deepseek_v3"}) {
      if (fs::exists(golden_dir(m) + "/config.json") && fs::exists(golden_dir(m) + "/logits.f32")) v.push_back(m);
    }
    return v;
  }();
  return names;
}

// general.architecture of a fixture's config.json "architectures".
inline std::string golden_arch(const nlohmann::json& cfg) {
  const std::string hf = cfg.at("architectures").at(0).get<std::string>();
  if (hf == "Qwen3MoeForCausalLM") return "qwen3moe";
  if (hf == "Qwen3NextForCausalLM") return "qwen3next";
  if (hf == "GptOssForCausalLM") return "gpt-oss";
  if (hf == "Qwen2MoeForCausalLM") return "qwen2moe";
  if (hf == "Glm4MoeForCausalLM") return "glm4moe";
  if (hf == "Qwen3_5MoeForCausalLM") return "qwen35moe";
  if (hf == "DeepseekV2ForCausalLM" || hf == "DeepseekV3ForCausalLM") return "deepseek2";
  throw std::runtime_error("golden fixture of unknown architecture " + hf);
}

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  return nlohmann::json::parse(in);
}

inline std::vector<float> read_f32(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') out += "'\\''";
    else out += c;
  }
  return out + "'";
}

// A fresh empty folder under the system temp dir, removed by the destructor.
class Scratch {
 public:
  explicit Scratch(const std::string& tag) {
    std::string templ = (fs::temp_directory_path() / ("moraine-" + tag + "-XXXXXX")).string();
    if (mkdtemp(templ.data()) == nullptr) throw std::runtime_error("cannot create a scratch folder like " + templ);
    path_ = templ;
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// One tensor of a safetensors file written by tests: raw little-endian bytes.
struct RawTensor {
  std::string name;
  std::string dtype;  // "BF16", "F32", "I64", ...
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

inline void write_safetensors(const std::string& path, const std::vector<RawTensor>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  uint64_t off = 0;
  for (const RawTensor& t : tensors) {
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes.size()}}};
    off += t.bytes.size();
  }
  std::string h = header.dump();
  while (h.size() % 8) h += ' ';
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = h.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const RawTensor& t : tensors) out.write(reinterpret_cast<const char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
}

}  // namespace moraine::convert::test
