// The one error type of model loading: the message names the file, and the key or tensor.
#pragma once
#include <stdexcept>

namespace moraine::model {

class ModelError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace moraine::model
