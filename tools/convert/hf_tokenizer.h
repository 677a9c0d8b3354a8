// Imports a Hugging Face byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json and the
// special-token ids of config.json) as the GGUF "gpt2" tokenizer keys llama.cpp reads.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "common/gguf/gguf_value.h"

namespace moraine::convert {

// GGUF token types (llama.cpp's numbering).
enum class TokenType : int32_t { Normal = 1, Unknown = 2, Control = 3, UserDefined = 4, Unused = 5, Byte = 6 };

// The tokenizer.* keys, in the order llama.cpp writes them. vocab_size is config.json's: ids
// the tokenizer does not cover become "[PAD<id>]" entries of type Unused. Throws ConvertError
// naming the file and field for anything it cannot represent (a non-BPE model, a pre-tokenizer
// regex it does not know, an id outside the vocabulary).
// `arch` (general.architecture) adds the special tokens llama.cpp's converter sets for that
// family (glm4moe: bos [gMASK], eot <|user|>, unk <|endoftext|>, eom <|observation|>) where
// the tokenizer has them and the files named none of that type.
std::vector<std::pair<std::string, gguf::Value>> import_hf_tokenizer(const std::string& dir,
                                                                     const nlohmann::json& config,
                                                                     int64_t vocab_size, const std::string& arch = "");

}  // namespace moraine::convert
