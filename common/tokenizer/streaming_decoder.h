// Turns a stream of token ids into text that is always whole UTF-8: a character whose bytes are
// spread over several tokens is held back until its last byte arrives, so a client never receives
// half a character.
#pragma once
#include <string>

#include "common/tokenizer/tokenizer.h"

namespace moraine::tokenizer {

class StreamingDecoder {
 public:
  explicit StreamingDecoder(const Tokenizer& tokenizer, bool render_special = true)
      : tokenizer_(&tokenizer), render_special_(render_special) {}

  // The text that became complete with this token (possibly empty). Throws TokenizerError for an
  // unknown id, leaving the held bytes as they were.
  std::string push(TokenId id);

  // Everything still held (an incomplete character at the end of the stream), as raw bytes.
  std::string flush();

  size_t held_bytes() const { return pending_.size(); }

 private:
  const Tokenizer* tokenizer_;
  bool render_special_;
  std::string pending_;
};

}  // namespace moraine::tokenizer
