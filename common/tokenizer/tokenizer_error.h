// The one exception type of the tokenizer: bad vocabulary metadata, unknown schemes, unknown ids.
#pragma once
#include <stdexcept>

namespace moraine::tokenizer {

class TokenizerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace moraine::tokenizer
