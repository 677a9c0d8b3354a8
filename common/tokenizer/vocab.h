// What a BPE tokenizer is built from: the `tokenizer.ggml.*` metadata of a GGUF file, read into
// plain data so tests can also build small vocabularies by hand.
#pragma once
#include <cstdint>
#include <functional>
#include <string_view>
#include <unordered_map>
#include <optional>
#include <string>
#include <vector>

namespace moraine::gguf {
class GgufFile;
}

namespace moraine::tokenizer {

using TokenId = int32_t;

// Hash for string-keyed maps that can be searched with a string_view without a copy.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StringMap = std::unordered_map<std::string, TokenId, StringHash, std::equal_to<>>;


// `tokenizer.ggml.token_type` values (GGUF's numbering).
enum class TokenType : int32_t {
  Undefined = 0,
  Normal = 1,
  Unknown = 2,
  Control = 3,
  UserDefined = 4,
  Unused = 5,
  Byte = 6,
};

struct VocabSpec {
  std::string model = "gpt2";           // tokenizer.ggml.model
  std::string pre = "default";          // tokenizer.ggml.pre
  std::vector<std::string> tokens;      // tokenizer.ggml.tokens, in byte-level alphabet text
  std::vector<TokenType> types;         // tokenizer.ggml.token_type; empty = all Normal
  std::vector<std::string> merges;      // tokenizer.ggml.merges: "left right", best first
  std::optional<TokenId> bos, eos, eot, eom, pad, unk;
  std::optional<bool> add_bos, add_eos; // tokenizer.ggml.add_bos_token / add_eos_token
};

// Reads the tokenizer metadata; throws TokenizerError naming the key on a missing or mistyped
// entry, and on a tokenizer model other than "gpt2".
VocabSpec read_vocab_spec(const gguf::GgufFile& file);

}  // namespace moraine::tokenizer
