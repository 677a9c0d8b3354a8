// Byte-level BPE tokenizer built from GGUF metadata (`tokenizer.ggml.model = gpt2`).
//
// encode: special tokens are split out of the raw text first (see special_tokens.h), each
// remaining run is split into words by the pre-tokenizer's regexes (pre_tokenizer.h), and each
// word is merged by BPE rank (bpe_merges.h). decode maps the byte-level alphabet back to bytes.
// Behaviour follows llama.cpp's tokenizer so both give the same ids for the same text.
//
// A Tokenizer is immutable after construction; encode/decode may run on many threads at once.
#pragma once
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/tokenizer/bpe_merges.h"
#include "common/tokenizer/pre_tokenizer.h"
#include "common/tokenizer/special_tokens.h"
#include "common/tokenizer/tokenizer_error.h"
#include "common/tokenizer/vocab.h"

namespace moraine::tokenizer {

class Tokenizer {
 public:
  explicit Tokenizer(VocabSpec spec);
  static Tokenizer from_gguf(const gguf::GgufFile& file);
  static Tokenizer from_gguf_path(const std::string& path);

  // add_special: prepend BOS / append EOS where the vocabulary asks for them.
  // parse_special: match control tokens written in the text (e.g. "<|im_start|>"). User-defined
  // tokens are matched either way, as in llama.cpp and Hugging Face tokenizers.
  // Text that is not valid UTF-8 has each bad byte replaced by U+FFFD first (as llama.cpp does).
  std::vector<TokenId> encode(std::string_view text, bool add_special = true,
                              bool parse_special = true) const;

  // Concatenated bytes of the tokens. Control and unknown tokens give their text only when
  // render_special is set; unused ones never do. Throws TokenizerError for an id outside the
  // vocabulary.
  std::string decode(std::span<const TokenId> ids, bool render_special = true) const;
  // The bytes of one token (may be part of a UTF-8 character).
  std::string token_bytes(TokenId id, bool render_special = true) const;

  size_t n_vocab() const { return tokens_.size(); }
  const std::string& token_text(TokenId id) const;  // vocabulary form (byte-level alphabet)
  TokenType token_type(TokenId id) const;
  std::optional<TokenId> find_token(std::string_view vocab_text) const;

  std::optional<TokenId> bos() const { return bos_; }
  std::optional<TokenId> eos() const { return eos_; }
  std::optional<TokenId> eot() const { return eot_; }
  std::optional<TokenId> pad() const { return pad_; }
  bool add_bos() const { return add_bos_; }
  bool add_eos() const { return add_eos_; }
  // Tokens that end generation: EOS, EOT, EOM and the known end-of-turn markers.
  bool is_end_of_generation(TokenId id) const { return end_of_generation_.count(id) != 0; }
  const std::string& pre_tokenizer_scheme() const { return pre_.scheme(); }

 private:
  void check_id(TokenId id) const;
  void encode_text(std::string_view text, std::vector<TokenId>& out) const;

  std::vector<std::string> tokens_;
  std::vector<TokenType> types_;
  std::vector<std::string> bytes_;  // decoded bytes of each token (raw text for special ones)
  StringMap text_to_id_;
  StringMap bytes_to_id_;  // every token by its raw bytes (llama3 scheme only)
  bool ignore_merges_ = false;  // a word that is itself a token is taken whole (llama3 scheme)
  PreTokenizer pre_;
  BpeMerges merges_;
  SpecialTokenMatcher special_all_;           // control + user-defined + unknown
  SpecialTokenMatcher special_user_defined_;  // user-defined only (parse_special off)
  std::optional<TokenId> bos_, eos_, eot_, eom_, pad_;
  bool add_bos_ = false, add_eos_ = false;
  std::unordered_set<TokenId> end_of_generation_;
};

}  // namespace moraine::tokenizer
