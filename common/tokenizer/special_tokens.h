// Splits raw text at occurrences of special (added) tokens before pre-tokenization.
//
// The order of matching follows llama.cpp so ids agree with it: tokens are taken longest first;
// for each token in turn, its occurrences are taken left to right wherever they lie wholly in
// text no earlier (longer) token has claimed.
#pragma once
#include <array>
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
  std::vector<std::pair<std::string, TokenId>> tokens_;  // longest first, then lowest id
  std::array<std::vector<uint32_t>, 256> by_first_byte_;  // indices into tokens_
};

}  // namespace moraine::tokenizer
