#include "common/tokenizer/vocab.h"

#include "common/gguf/gguf.h"
#include "common/tokenizer/tokenizer_error.h"

namespace moraine::tokenizer {
namespace {

std::string where(const gguf::GgufFile& file, std::string_view key) {
  const std::string path = file.paths().empty() ? std::string("<gguf>") : file.paths().front();
  return path + ": " + std::string(key);
}

const gguf::Array& require_array(const gguf::GgufFile& file, std::string_view key) {
  const gguf::Value* v = file.find(key);
  if (v == nullptr) throw TokenizerError(where(file, key) + ": missing");
  const gguf::Array* a = v->as_array();
  if (a == nullptr) {
    throw TokenizerError(where(file, key) + ": expected an array, found " +
                         std::string(gguf::value_type_name(v->type())));
  }
  return *a;
}

std::vector<std::string> read_strings(const gguf::GgufFile& file, std::string_view key) {
  const gguf::Array& a = require_array(file, key);
  std::vector<std::string> out;
  out.reserve(a.items.size());
  for (size_t i = 0; i < a.items.size(); ++i) {
    const std::string* s = a.items[i].as_string();
    if (s == nullptr) {
      throw TokenizerError(where(file, key) + "[" + std::to_string(i) + "]: expected a string");
    }
    out.push_back(*s);
  }
  return out;
}

std::optional<TokenId> read_id(const gguf::GgufFile& file, std::string_view key) {
  const gguf::Value* v = file.find(key);
  if (v == nullptr) return std::nullopt;
  const std::optional<int64_t> id = v->as_i64();
  if (!id) throw TokenizerError(where(file, key) + ": expected an integer token id");
  return static_cast<TokenId>(*id);
}

std::optional<bool> read_bool(const gguf::GgufFile& file, std::string_view key) {
  const gguf::Value* v = file.find(key);
  if (v == nullptr) return std::nullopt;
  const std::optional<bool> b = v->as_bool();
  if (!b) throw TokenizerError(where(file, key) + ": expected a bool");
  return b;
}

}  // namespace

VocabSpec read_vocab_spec(const gguf::GgufFile& file) {
  VocabSpec spec;
  const std::optional<std::string> model = file.get_string("tokenizer.ggml.model");
  if (!model) throw TokenizerError(where(file, "tokenizer.ggml.model") + ": missing");
  if (*model != "gpt2") {
    throw TokenizerError(where(file, "tokenizer.ggml.model") + ": unsupported tokenizer model '" +
                         *model + "' (only byte-level BPE, 'gpt2', is supported)");
  }
  spec.model = *model;
  // A file without a pre-tokenizer name gets the default scheme, as in llama.cpp.
  spec.pre = file.get_string("tokenizer.ggml.pre").value_or("default");
  spec.tokens = read_strings(file, "tokenizer.ggml.tokens");
  spec.merges = read_strings(file, "tokenizer.ggml.merges");

  if (file.find("tokenizer.ggml.token_type") != nullptr) {
    const gguf::Array& a = require_array(file, "tokenizer.ggml.token_type");
    if (a.items.size() != spec.tokens.size()) {
      throw TokenizerError(where(file, "tokenizer.ggml.token_type") + ": " +
                           std::to_string(a.items.size()) + " entries for " +
                           std::to_string(spec.tokens.size()) + " tokens");
    }
    spec.types.reserve(a.items.size());
    for (size_t i = 0; i < a.items.size(); ++i) {
      const std::optional<int64_t> t = a.items[i].as_i64();
      if (!t) {
        throw TokenizerError(where(file, "tokenizer.ggml.token_type") + "[" + std::to_string(i) +
                             "]: expected an integer");
      }
      // Values outside 0-6 are treated as Undefined, as llama.cpp does.
      spec.types.push_back(*t >= 0 && *t <= 6 ? static_cast<TokenType>(*t) : TokenType::Undefined);
    }
  }

  spec.bos = read_id(file, "tokenizer.ggml.bos_token_id");
  spec.eos = read_id(file, "tokenizer.ggml.eos_token_id");
  spec.eot = read_id(file, "tokenizer.ggml.eot_token_id");
  spec.eom = read_id(file, "tokenizer.ggml.eom_token_id");
  spec.pad = read_id(file, "tokenizer.ggml.padding_token_id");
  spec.unk = read_id(file, "tokenizer.ggml.unknown_token_id");
  spec.add_bos = read_bool(file, "tokenizer.ggml.add_bos_token");
  spec.add_eos = read_bool(file, "tokenizer.ggml.add_eos_token");
  return spec;
}

}  // namespace moraine::tokenizer
