#include "tests/interop/llama_oracle.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace moraine::test {
namespace fs = std::filesystem;

namespace {

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') out += "'\\''";
    else out += c;
  }
  return out + "'";
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::string llama_oracle_dir() {
  const std::string dir = std::string(MORAINE_SOURCE_DIR) + "/.cache/oracle";
  if (!fs::exists(dir + "/node_modules/node-llama-cpp/package.json")) {
    throw std::runtime_error("llama.cpp oracle missing: " + dir +
                             "/node_modules/node-llama-cpp not found; run tests/oracle/setup");
  }
  return dir;
}

std::map<std::string, LlamaReport> run_llama_oracle(const std::vector<std::string>& gguf_paths,
                                                    int n_tokens, const std::string& scratch_dir) {
  const std::string oracle = llama_oracle_dir();
  const std::string script = std::string(MORAINE_SOURCE_DIR) + "/tests/interop/llama_logits.mjs";
  const std::string stderr_path = scratch_dir + "/node.stderr";
  std::string cmd = "node " + shell_quote(script) + " " + shell_quote(oracle) + " " +
                    shell_quote(scratch_dir) + " " + std::to_string(n_tokens);
  for (const auto& p : gguf_paths) cmd += " " + shell_quote(p);
  cmd += " >" + shell_quote(stderr_path) + " 2>&1";
  const int rc = std::system(cmd.c_str());
  if (rc != 0) {
    throw std::runtime_error("llama.cpp oracle (node " + script + ") failed with status " +
                             std::to_string(rc) + ":\n" + read_text(stderr_path));
  }
  const auto report = nlohmann::json::parse(read_text(scratch_dir + "/report.json"));
  std::map<std::string, LlamaReport> out;
  for (const auto& p : gguf_paths) {
    const auto& e = report.at(p);
    LlamaReport r;
    r.loaded = e.at("loaded").get<bool>();
    r.error = e.value("error", "");
    r.type_description = e.value("type_description", "");
    if (e.contains("tensors")) {
      for (const auto& [name, type] : e.at("tensors").items()) r.tensor_types[name] = type.get<uint32_t>();
    }
    r.n_vocab = e.value("n_vocab", int64_t{0});
    if (r.loaded && n_tokens > 0) {
      const std::string logits_path = scratch_dir + "/" + fs::path(p).filename().string() + ".logits";
      const auto expect_bytes = static_cast<uintmax_t>(n_tokens) * r.n_vocab * sizeof(float);
      if (!fs::exists(logits_path) || fs::file_size(logits_path) != expect_bytes) {
        throw std::runtime_error("llama.cpp oracle wrote no logits of the expected size to " +
                                 logits_path);
      }
      r.logits.resize(static_cast<size_t>(n_tokens) * r.n_vocab);
      std::ifstream in(logits_path, std::ios::binary);
      in.read(reinterpret_cast<char*>(r.logits.data()), static_cast<std::streamsize>(expect_bytes));
    }
    out.emplace(p, std::move(r));
  }
  return out;
}

void add_minimal_llama_vocab(gguf::GgufWriter& writer, int64_t n_vocab) {
  using gguf::Value;
  using gguf::ValueType;
  if (n_vocab < 259) throw std::invalid_argument("minimal llama vocab needs at least 259 tokens");
  // Token types as llama.cpp numbers them: 1 normal, 2 unknown, 3 control, 6 byte.
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<Value> types = {Value::i32(2), Value::i32(3), Value::i32(3)};
  static const char* hex = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">");
    types.push_back(Value::i32(6));
  }
  for (int64_t i = static_cast<int64_t>(tokens.size()); i < n_vocab; ++i) {
    tokens.push_back("tok" + std::to_string(i));
    types.push_back(Value::i32(1));
  }
  std::vector<Value> scores(static_cast<size_t>(n_vocab), Value::f32(0.0f));
  writer.set("tokenizer.ggml.model", Value::string("llama"));
  writer.set("tokenizer.ggml.tokens", Value::string_array(tokens));
  writer.set("tokenizer.ggml.scores", Value::array(ValueType::FLOAT32, std::move(scores)));
  writer.set("tokenizer.ggml.token_type", Value::array(ValueType::INT32, std::move(types)));
}

ScratchDir::ScratchDir(const std::string& tag) {
  std::string templ = (fs::temp_directory_path() / ("moraine-" + tag + "-XXXXXX")).string();
  if (mkdtemp(templ.data()) == nullptr) {
    throw std::runtime_error("cannot create a scratch folder like " + templ);
  }
  path_ = templ;
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

}  // namespace moraine::test
