// Hugging Face checkpoint directory -> GGUF file: the library behind moraine-convert.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/formats/tensor_type.h"

namespace moraine::convert {

struct ConvertOptions {
  std::string hf_dir;                     // config.json, *.safetensors, tokenizer files
  std::string out_path;                   // the .gguf to write (atomically)
  TensorType outtype = TensorType::BF16;  // F32, F16, BF16 or Q8_0
  std::string name;                       // general.name; the directory's name when empty
  // Called as each tensor is converted: (index from 1, count, GGUF name).
  std::function<void(size_t, size_t, const std::string&)> progress;
};

struct ConvertResult {
  std::string arch;                 // general.architecture written
  size_t n_tensors = 0;
  std::vector<std::string> notes;   // e.g. tensors kept in F16 because Q8_0 blocks do not fit
};

// Throws ConvertError (tools/convert/safetensors.h) naming the file, key or tensor at fault.
ConvertResult convert_hf_to_gguf(const ConvertOptions& opt);

}  // namespace moraine::convert
