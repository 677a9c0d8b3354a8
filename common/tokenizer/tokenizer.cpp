#include "common/tokenizer/tokenizer.h"

#include <algorithm>
#include <array>

#include "common/gguf/gguf.h"
#include "common/tokenizer/byte_alphabet.h"
#include "common/tokenizer/utf8.h"

namespace moraine::tokenizer {
namespace {

// Token texts that end generation. llama.cpp treats these as end-of-generation and as control
// tokens even when a converter marked them normal, which changes how text containing them is
// split; we do the same so ids agree.
constexpr std::array<std::string_view, 12> kEndOfGenerationTexts = {
    "<|eot_id|>", "<|im_end|>",      "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>",
    "<|eom_id|>", "<|end_of_text|>", "<EOT>",   "<|return|>",    "<|call|>",      "<eos>",
};
// When the file names no EOT token, the first of these in the vocabulary is taken.
constexpr std::array<std::string_view, 7> kEndOfTurnTexts = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>",
};

// Pre-tokenizer schemes of the llama3 family: a word that is itself a token is not merged
// (Hugging Face's ignore_merges), and BOS is added unless the file says otherwise.
bool is_llama3_scheme(const std::string& pre) {
  return pre == "llama-bpe" || pre == "llama3" || pre == "llama-v3";
}

StringMap index_texts(std::vector<std::string>& tokens) {
  if (tokens.empty()) throw TokenizerError("tokenizer.ggml.tokens: the vocabulary is empty");
  StringMap index;
  index.reserve(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    // An empty entry could never be produced or matched; give it a unique placeholder name, as
    // llama.cpp does, so ids stay aligned.
    if (tokens[i].empty()) tokens[i] = "[EMPTY_" + std::to_string(i) + "]";
    index[tokens[i]] = static_cast<TokenId>(i);  // a repeated text maps to its last id
  }
  return index;
}

std::optional<TokenId> checked_id(std::optional<TokenId> id, size_t n_vocab, const char* key) {
  if (id && (*id < 0 || static_cast<size_t>(*id) >= n_vocab)) {
    throw TokenizerError(std::string("tokenizer.ggml.") + key + " = " + std::to_string(*id) +
                         " is outside the vocabulary of " + std::to_string(n_vocab) + " tokens");
  }
  return id;
}

}  // namespace

Tokenizer::Tokenizer(VocabSpec spec)
    : tokens_(std::move(spec.tokens)),
      types_(std::move(spec.types)),
      text_to_id_(index_texts(tokens_)),
      ignore_merges_(is_llama3_scheme(spec.pre)),
      pre_(spec.pre),
      merges_(text_to_id_, spec.merges) {
  if (spec.model != "gpt2") {
    throw TokenizerError("unsupported tokenizer model (tokenizer.ggml.model) '" + spec.model +
                         "'; only byte-level BPE ('gpt2') is supported");
  }
  if (types_.empty()) types_.assign(tokens_.size(), TokenType::Normal);
  if (types_.size() != tokens_.size()) {
    throw TokenizerError("tokenizer.ggml.token_type has " + std::to_string(types_.size()) +
                         " entries for " + std::to_string(tokens_.size()) + " tokens");
  }
  const size_t n = tokens_.size();
  bos_ = checked_id(spec.bos, n, "bos_token_id");
  eos_ = checked_id(spec.eos, n, "eos_token_id");
  eot_ = checked_id(spec.eot, n, "eot_token_id");
  eom_ = checked_id(spec.eom, n, "eom_token_id");
  pad_ = checked_id(spec.pad, n, "padding_token_id");
  checked_id(spec.unk, n, "unknown_token_id");
  add_bos_ = spec.add_bos.value_or(is_llama3_scheme(spec.pre));
  add_eos_ = spec.add_eos.value_or(false);
  if (add_bos_ && !bos_) throw TokenizerError("tokenizer.ggml.add_bos_token is set but there is no bos_token_id");
  if (add_eos_ && !eos_) throw TokenizerError("tokenizer.ggml.add_eos_token is set but there is no eos_token_id");

  for (std::string_view text : kEndOfGenerationTexts) {
    const auto it = text_to_id_.find(text);
    if (it == text_to_id_.end()) continue;
    end_of_generation_.insert(it->second);
    types_[static_cast<size_t>(it->second)] = TokenType::Control;
  }
  for (std::string_view text : kEndOfTurnTexts) {
    const auto it = text_to_id_.find(text);
    if (!eot_ && it != text_to_id_.end()) eot_ = it->second;
  }
  if (!eom_) {
    if (const auto it = text_to_id_.find(std::string_view("<|eom_id|>")); it != text_to_id_.end()) eom_ = it->second;
  }
  for (const auto& id : {eos_, eot_, eom_}) {
    if (id) end_of_generation_.insert(*id);
  }

  bytes_.resize(n);
  std::vector<std::pair<std::string, TokenId>> all, user_defined;
  for (size_t i = 0; i < n; ++i) {
    const auto id = static_cast<TokenId>(i);
    switch (types_[i]) {
      case TokenType::Normal:
      case TokenType::Byte: {
        std::optional<std::string> raw = decode_byte_level(tokens_[i]);
        // A text outside the byte alphabet cannot come out of encode; show it as written.
        bytes_[i] = raw ? std::move(*raw) : tokens_[i];
        break;
      }
      case TokenType::Control:
      case TokenType::Unknown:
        bytes_[i] = tokens_[i];
        all.emplace_back(tokens_[i], id);
        break;
      case TokenType::UserDefined:
        bytes_[i] = tokens_[i];
        all.emplace_back(tokens_[i], id);
        user_defined.emplace_back(tokens_[i], id);
        break;
      default:
        // Unused and undefined tokens decode to nothing, as in llama.cpp.
        break;
    }
  }
  special_all_ = SpecialTokenMatcher(std::move(all));
  special_user_defined_ = SpecialTokenMatcher(std::move(user_defined));

  if (ignore_merges_) {
    bytes_to_id_.reserve(text_to_id_.size());
    for (const auto& [text, id] : text_to_id_) {
      if (std::optional<std::string> raw = decode_byte_level(text)) bytes_to_id_[*raw] = id;
    }
  }
}

Tokenizer Tokenizer::from_gguf(const gguf::GgufFile& file) { return Tokenizer(read_vocab_spec(file)); }

Tokenizer Tokenizer::from_gguf_path(const std::string& path) {
  return from_gguf(gguf::GgufFile::open(path));
}

void Tokenizer::check_id(TokenId id) const {
  if (id < 0 || static_cast<size_t>(id) >= tokens_.size()) {
    throw TokenizerError("token id " + std::to_string(id) + " is outside the vocabulary (0.." +
                         std::to_string(tokens_.size() - 1) + ")");
  }
}

const std::string& Tokenizer::token_text(TokenId id) const {
  check_id(id);
  return tokens_[static_cast<size_t>(id)];
}

TokenType Tokenizer::token_type(TokenId id) const {
  check_id(id);
  return types_[static_cast<size_t>(id)];
}

std::optional<TokenId> Tokenizer::find_token(std::string_view vocab_text) const {
  const auto it = text_to_id_.find(vocab_text);
  if (it == text_to_id_.end()) return std::nullopt;
  return it->second;
}

namespace {

// Per-call state. Words repeat heavily in real text, so each distinct word is merged once per
// call; keeping the cache per call keeps encode free of shared mutable state.
struct EncodeScratch {
  BpeMerges::Workspace ws;
  std::unordered_map<std::string_view, std::pair<uint32_t, uint32_t>> cache;  // -> span in ids
  std::vector<TokenId> ids;
};

}  // namespace

std::vector<TokenId> Tokenizer::encode(std::string_view text, bool add_special,
                                       bool parse_special) const {
  std::string repaired;
  if (!is_valid_utf8(text)) {
    repaired = replace_invalid_utf8(text);
    text = repaired;
  }
  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 2);
  if (add_special && add_bos_) out.push_back(*bos_);

  std::vector<SpecialTokenMatcher::Fragment> fragments;
  (parse_special ? special_all_ : special_user_defined_).partition(text, fragments);

  EncodeScratch s;
  const auto encode_word = [&](std::string_view word) {
    // A one-byte word is one byte token (or a whole-word token that is the same thing); no
    // merge can apply, so skip the cache.
    if (word.size() == 1) {
      merges_.encode_word(word, out, s.ws);
      return;
    }
    const auto [it, inserted] = s.cache.try_emplace(word, 0, 0);
    if (inserted) {
      const auto begin = static_cast<uint32_t>(s.ids.size());
      const auto whole = ignore_merges_ ? bytes_to_id_.find(word) : bytes_to_id_.end();
      if (whole != bytes_to_id_.end()) {
        s.ids.push_back(whole->second);
      } else {
        merges_.encode_word(word, s.ids, s.ws);
      }
      it->second = {begin, static_cast<uint32_t>(s.ids.size())};
    }
    out.insert(out.end(), s.ids.begin() + it->second.first, s.ids.begin() + it->second.second);
  };
  for (const auto& f : fragments) {
    if (f.token >= 0) {
      out.push_back(f.token);
    } else {
      pre_.for_each_word(f.text, encode_word);
    }
  }
  if (add_special && add_eos_) out.push_back(*eos_);
  return out;
}

std::string Tokenizer::token_bytes(TokenId id, bool render_special) const {
  check_id(id);
  const auto i = static_cast<size_t>(id);
  const TokenType t = types_[i];
  if (!render_special && (t == TokenType::Control || t == TokenType::Unknown)) return {};
  return bytes_[i];
}

std::string Tokenizer::decode(std::span<const TokenId> ids, bool render_special) const {
  std::string out;
  for (TokenId id : ids) {
    check_id(id);
    const auto i = static_cast<size_t>(id);
    const TokenType t = types_[i];
    if (!render_special && (t == TokenType::Control || t == TokenType::Unknown)) continue;
    out += bytes_[i];
  }
  return out;
}

}  // namespace moraine::tokenizer
