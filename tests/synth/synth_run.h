// Runs the built moraine-synth as a user would, for the tests of tests/synth.
#pragma once
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace moraine::test {

struct SynthRun {
  int status = -1;
  std::string err;  // stderr
};

inline std::string read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// `args` is appended to the command line as it is (shell quoting is the caller's).
inline SynthRun run_synth(const std::string& args, const std::string& scratch_dir) {
  const std::string tool = std::string(MORAINE_BUILD_DIR) + "/tools/synth/moraine-synth";
  const std::string err_path = scratch_dir + "/synth.stderr";
  const int rc = std::system((tool + " " + args + " 2>" + err_path).c_str());
  return {rc, read_file_bytes(err_path)};
}

inline std::string qwen2_vocab_gguf() {
  return std::string(MORAINE_SOURCE_DIR) + "/.cache/oracle/llama.cpp/models/ggml-vocab-qwen2.gguf";
}

}  // namespace moraine::test
