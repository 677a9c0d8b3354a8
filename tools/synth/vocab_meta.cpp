#include "tools/synth/vocab_meta.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "common/gguf/gguf.h"
#include "common/tokenizer/byte_alphabet.h"
#include "tools/convert/hf_tokenizer.h"

namespace moraine::synth {

namespace fs = std::filesystem;
using gguf::Value;
using gguf::ValueType;

namespace {

constexpr int32_t kTokenUnused = 5;   // llama.cpp's LLAMA_TOKEN_TYPE_UNUSED
constexpr int32_t kTokenControl = 3;  // LLAMA_TOKEN_TYPE_CONTROL

std::string pad_token(int64_t id) { return "[PAD" + std::to_string(id) + "]"; }

// Appends unused tokens to the per-token arrays until they hold n entries.
Value padded(const std::string& key, const Value& v, int64_t n) {
  const gguf::Array* a = v.as_array();
  if (!a || static_cast<int64_t>(a->items.size()) >= n) return v;
  std::vector<Value> items = a->items;
  for (int64_t id = static_cast<int64_t>(items.size()); id < n; ++id) {
    if (key == "tokenizer.ggml.tokens") items.push_back(Value::string(pad_token(id)));
    else if (key == "tokenizer.ggml.token_type") items.push_back(Value::i32(kTokenUnused));
    else items.push_back(Value::f32(0.0f));  // tokenizer.ggml.scores
  }
  return Value::array(a->elem_type, std::move(items));
}

int64_t decide_vocab(int64_t n_tokens, int64_t shape_vocab, std::optional<int64_t> explicit_size,
                     const std::string& source, std::string& note) {
  if (explicit_size) {
    if (n_tokens > *explicit_size) {
      throw std::invalid_argument(source + " has " + std::to_string(n_tokens) + " tokens, more than --vocab-size " +
                                  std::to_string(*explicit_size));
    }
    if (n_tokens < *explicit_size) {
      note = "padded " + source + "'s " + std::to_string(n_tokens) + " tokens with unused tokens to --vocab-size " +
             std::to_string(*explicit_size);
    }
    return *explicit_size;
  }
  if (n_tokens > shape_vocab) {
    note = "vocab size " + std::to_string(n_tokens) + " (the token count of " + source + ") instead of the shape's " +
           std::to_string(shape_vocab);
    return n_tokens;
  }
  if (n_tokens < shape_vocab) {
    note = "padded " + source + "'s " + std::to_string(n_tokens) + " tokens with unused tokens to the shape's vocab size " +
           std::to_string(shape_vocab);
  }
  return shape_vocab;
}

}  // namespace

VocabMeta vocab_from_gguf(const std::string& path, int64_t shape_vocab, std::optional<int64_t> explicit_size) {
  std::optional<gguf::GgufFile> f;
  try {
    f.emplace(gguf::GgufFile::open(path));
  } catch (const std::exception& e) {
    throw std::invalid_argument("--vocab-from " + path + ": " + e.what());
  }
  const gguf::Array* tokens = f->get_array("tokenizer.ggml.tokens");
  if (!tokens || tokens->elem_type != ValueType::STRING || tokens->items.empty()) {
    throw std::invalid_argument("--vocab-from " + path + ": no tokenizer.ggml.tokens string array");
  }
  VocabMeta v;
  const int64_t n_tokens = static_cast<int64_t>(tokens->items.size());
  v.n_vocab = decide_vocab(n_tokens, shape_vocab, explicit_size, path, v.note);
  for (const auto& [key, value] : f->metadata()) {
    if (key.rfind("tokenizer.", 0) != 0) continue;
    const bool per_token =
        key == "tokenizer.ggml.tokens" || key == "tokenizer.ggml.token_type" || key == "tokenizer.ggml.scores";
    if (per_token) {
      const gguf::Array* a = value.as_array();
      if (!a || static_cast<int64_t>(a->items.size()) != n_tokens) {
        throw std::invalid_argument("--vocab-from " + path + ": " + key + " does not have one entry per token (" +
                                    std::to_string(n_tokens) + ")");
      }
    }
    v.keys.emplace_back(key, per_token ? padded(key, value, v.n_vocab) : value);
  }
  return v;
}

VocabMeta vocab_from_tokenizer_json(const std::string& path, int64_t shape_vocab, std::optional<int64_t> explicit_size) {
  // The importer reads DIR/tokenizer.json, DIR/tokenizer_config.json, and takes special ids
  // from config.json when the folder has one, as for a checkpoint.
  const fs::path p(path);
  const fs::path dir = fs::is_directory(p) ? p : p.parent_path();
  if (!fs::is_directory(p) && p.filename() != "tokenizer.json") {
    throw std::invalid_argument("--tokenizer-json " + path + ": expected a file named tokenizer.json (or its folder)");
  }
  if (!fs::exists(dir / "tokenizer.json")) throw std::invalid_argument("--tokenizer-json " + path + ": no tokenizer.json there");
  nlohmann::json config = nlohmann::json::object();
  if (fs::exists(dir / "config.json")) {
    std::ifstream in(dir / "config.json");
    try {
      config = nlohmann::json::parse(in);
    } catch (const std::exception& e) {
      throw std::invalid_argument((dir / "config.json").string() + ": invalid JSON: " + e.what());
    }
  }
  // The id count of tokenizer.json (model vocab + added tokens) decides the vocab, as for a GGUF.
  int64_t n_ids = 0;
  {
    std::ifstream in(dir / "tokenizer.json");
    nlohmann::json tok;
    try {
      tok = nlohmann::json::parse(in);
    } catch (const std::exception& e) {
      throw std::invalid_argument((dir / "tokenizer.json").string() + ": invalid JSON: " + e.what());
    }
    if (tok.contains("model") && tok["model"].contains("vocab") && tok["model"]["vocab"].is_object()) {
      for (const auto& [piece, id] : tok["model"]["vocab"].items()) {
        if (id.is_number_integer()) n_ids = std::max(n_ids, id.get<int64_t>() + 1);
      }
    }
    if (tok.contains("added_tokens") && tok["added_tokens"].is_array()) {
      for (const auto& t : tok["added_tokens"]) {
        if (t.contains("id") && t["id"].is_number_integer()) n_ids = std::max(n_ids, t["id"].get<int64_t>() + 1);
      }
    }
  }
  VocabMeta v;
  v.n_vocab = decide_vocab(n_ids, shape_vocab, explicit_size, (dir / "tokenizer.json").string(), v.note);
  try {
    v.keys = convert::import_hf_tokenizer(dir.string(), config, v.n_vocab);
  } catch (const std::exception& e) {
    throw std::invalid_argument("--tokenizer-json " + path + ": " + e.what());
  }
  return v;
}

VocabMeta byte_level_vocab(int64_t shape_vocab, std::optional<int64_t> explicit_size) {
  // The 256 byte tokens, one end-of-text control token, then unused tokens: every text
  // tokenizes (byte by byte, no merges), which is all a model with random weights needs.
  constexpr int64_t kEndOfText = 256;
  VocabMeta v;
  v.n_vocab = explicit_size.value_or(shape_vocab);
  if (v.n_vocab < kEndOfText + 1) {
    throw std::invalid_argument("vocab size " + std::to_string(v.n_vocab) +
                                " is too small for the built-in byte-level vocabulary (257 tokens)");
  }
  std::vector<Value> tokens, types;
  tokens.reserve(static_cast<size_t>(v.n_vocab));
  types.reserve(static_cast<size_t>(v.n_vocab));
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(Value::string(std::string(tokenizer::byte_to_alphabet_text(static_cast<uint8_t>(b)))));
    types.push_back(Value::i32(1));  // normal
  }
  tokens.push_back(Value::string("<|endoftext|>"));
  types.push_back(Value::i32(kTokenControl));
  for (int64_t id = kEndOfText + 1; id < v.n_vocab; ++id) {
    tokens.push_back(Value::string(pad_token(id)));
    types.push_back(Value::i32(kTokenUnused));
  }
  v.keys.emplace_back("tokenizer.ggml.model", Value::string("gpt2"));
  v.keys.emplace_back("tokenizer.ggml.pre", Value::string("qwen2"));
  v.keys.emplace_back("tokenizer.ggml.tokens", Value::array(ValueType::STRING, std::move(tokens)));
  v.keys.emplace_back("tokenizer.ggml.token_type", Value::array(ValueType::INT32, std::move(types)));
  v.keys.emplace_back("tokenizer.ggml.merges", Value::array(ValueType::STRING, {}));
  v.keys.emplace_back("tokenizer.ggml.eos_token_id", Value::u32(kEndOfText));
  v.keys.emplace_back("tokenizer.ggml.padding_token_id", Value::u32(kEndOfText));
  v.keys.emplace_back("tokenizer.ggml.bos_token_id", Value::u32(kEndOfText));
  v.keys.emplace_back("tokenizer.ggml.add_bos_token", Value::boolean(false));
  v.note = "built-in byte-level vocabulary (256 bytes + <|endoftext|>), padded to " + std::to_string(v.n_vocab) +
           " tokens; pass --vocab-from or --tokenizer-json for a real one";
  return v;
}

}  // namespace moraine::synth
