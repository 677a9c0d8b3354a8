// Where the tokenizer tests find the oracle cache made by tests/oracle/setup. Tests that need it
// fail (not skip) with this message when it is missing.
#pragma once
#include <filesystem>
#include <string>

namespace moraine::tokenizer::test {

inline std::string oracle_dir() { return std::string(MORAINE_SOURCE_DIR) + "/.cache/oracle"; }

inline std::string vocab_path(const std::string& name) {
  return oracle_dir() + "/llama.cpp/models/ggml-vocab-" + name + ".gguf";
}

inline std::string missing_oracle_message(const std::string& path) {
  return "oracle file missing: " + path + " (run tests/oracle/setup to create .cache/oracle)";
}

// The four byte-level BPE vocabularies every tokenizer test runs on.
inline const char* const kVocabs[] = {"qwen2", "qwen35", "gpt-2", "llama-bpe"};

}  // namespace moraine::tokenizer::test
