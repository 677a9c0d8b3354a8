// moraine-convert HF_DIR OUT.gguf [--outtype f32|bf16|f16|q8_0]: a Hugging Face checkpoint
// (safetensors + config.json + tokenizer.json) of an architecture tools/convert/arch/ knows
// (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Qwen2-MoE, GLM-4.5, gpt-oss) to a GGUF file that llama.cpp and moraine load.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <map>
#include <string>

#include "tools/convert/convert.h"

int main(int argc, char** argv) {
  CLI::App app{"Convert a Hugging Face MoE checkpoint (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Qwen2-MoE, GLM-4.5, gpt-oss) to GGUF"};
  moraine::convert::ConvertOptions opt;
  std::string outtype = "bf16";
  app.add_option("hf_dir", opt.hf_dir, "checkpoint directory (config.json, *.safetensors, tokenizer.json)")
      ->required();
  app.add_option("out", opt.out_path, "GGUF file to write")->required();
  app.add_option("--outtype", outtype, "type of the weight matrices (norms, routers stay f32; MXFP4 experts stay MXFP4)")
      ->check(CLI::IsMember({"f32", "bf16", "f16", "q8_0"}))
      ->capture_default_str();
  app.add_option("--name", opt.name, "general.name (default: the directory's name)");
  CLI11_PARSE(app, argc, argv);

  static const std::map<std::string, moraine::TensorType> kTypes = {
      {"f32", moraine::TensorType::F32}, {"bf16", moraine::TensorType::BF16},
      {"f16", moraine::TensorType::F16}, {"q8_0", moraine::TensorType::Q8_0}};
  opt.outtype = kTypes.at(outtype);
  // A terminal gets one updating line; a log gets one line per tensor.
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  opt.progress = [tty](size_t i, size_t n, const std::string& name) {
    std::fprintf(stderr, tty ? "\r[%zu/%zu] %-60s" : "[%zu/%zu] %s\n", i, n, name.c_str());
    if (tty && i == n) std::fputc('\n', stderr);
  };
  try {
    const auto r = moraine::convert::convert_hf_to_gguf(opt);
    for (const std::string& note : r.notes) std::fprintf(stderr, "moraine-convert: note: %s\n", note.c_str());
    std::fprintf(stderr, "moraine-convert: wrote %s (%s, %zu tensors, %s)\n", opt.out_path.c_str(), r.arch.c_str(),
                 r.n_tensors, outtype.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moraine-convert: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
