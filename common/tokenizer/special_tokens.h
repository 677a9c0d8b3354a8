// Splits raw text at occurrences of special (added) tokens before pre-tokenization.
//
// The order of matching follows llama.cpp so ids agree with it: tokens are taken longest first;
// for each token in turn, its occurrences are taken left to right wherever they lie wholly in
// text no earlier (longer) token has claimed.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/tokenizer/vocab.h"

namespace moraine::tokenizer {

class SpecialTokenMatcher {
 public:
  struct Fragment {
    std::string_view text;  // raw text (token < 0) or the special token's text
    TokenId token = -1;     // the special token, or -1 for text still to pre-tokenize
  };

  SpecialTokenMatcher() = default;
  explicit SpecialTokenMatcher(std::vector<std::pair<std::string, TokenId>> tokens);

  bool empty() const { return tokens_.empty(); }

  // Appends text and special-token fragments of `text`, in order.
  void partition(std::string_view text, std::vector<Fragment>& out) const;

 private:
  // Appends (priority, pos) for every token that occurs at text[pos].
  void occurrences_at(std::string_view text, size_t pos,
                      std::vector<std::pair<uint32_t, size_t>>& found) const;

  std::vector<std::pair<std::string, TokenId>> tokens_;  // priority order: longest, then lowest id
  // Indices into tokens_ sorted by text, so the tokens sharing a prefix form one range that
  // narrows byte by byte (a trie walk with binary searches). 1 MB of "<|<|<|..." against the
  // 256 "<|reserved_special_token_N|>" of llama-bpe took 479 ms to encode when every token with
  // the right first byte was compared, 49 ms this way.
  std::vector<uint32_t> sorted_;
  std::array<bool, 256> starts_token_{};
};

}  // namespace moraine::tokenizer
