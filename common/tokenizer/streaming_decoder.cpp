#include "common/tokenizer/streaming_decoder.h"

#include "common/tokenizer/utf8.h"

namespace moraine::tokenizer {

std::string StreamingDecoder::push(TokenId id) {
  pending_ += tokenizer_->token_bytes(id, render_special_);
  const size_t hold = incomplete_utf8_tail(pending_);
  std::string ready = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return ready;
}

std::string StreamingDecoder::flush() {
  std::string rest;
  rest.swap(pending_);
  return rest;
}

}  // namespace moraine::tokenizer
