// Runs llama.cpp (node-llama-cpp on CPU, installed by tests/oracle/setup into .cache/oracle) on
// GGUF files moraine wrote, so tests can compare what llama.cpp reads with what we meant.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/gguf/gguf.h"

namespace moraine::test {

// What llama.cpp saw in one file.
struct LlamaReport {
  bool loaded = false;
  std::string error;             // llama.cpp's message when it refused the file
  std::string type_description;  // llama_model_desc(), e.g. "llama ?B Q8_0"
  std::map<std::string, uint32_t> tensor_types;  // name -> ggml type id, per node-llama-cpp
  int64_t n_vocab = 0;
  std::vector<float> logits;     // [n_tokens][n_vocab], token t evaluated at position t
};

// The oracle folder; throws std::runtime_error naming tests/oracle/setup when it is missing,
// so a test without the oracle fails loudly instead of skipping.
std::string llama_oracle_dir();

// One node start for all files (starting llama.cpp costs far more than our tiny models).
// n_tokens = 0 only loads each file. `scratch_dir` receives the logits files.
std::map<std::string, LlamaReport> run_llama_oracle(const std::vector<std::string>& gguf_paths,
                                                    int n_tokens, const std::string& scratch_dir);

// The smallest vocabulary llama.cpp accepts with node-llama-cpp on top: a SentencePiece-style
// ("llama") list of <unk>, <s>, </s>, the 256 byte tokens, then plain filler tokens. A vocab-less
// file ("none") loads in llama.cpp but node-llama-cpp aborts in the tokenizer (measured).
void add_minimal_llama_vocab(gguf::GgufWriter& writer, int64_t n_vocab);

// A fresh empty folder under the system temp dir, removed by the destructor.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& tag);
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace moraine::test
