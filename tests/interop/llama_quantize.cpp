// moraine-test-llama-quantize: quantizes a GGUF file with llama.cpp's OWN quantizer, calling
// llama_model_quantize() in the prebuilt libllama that node-llama-cpp ships (tests/oracle/setup
// puts it under .cache/oracle), so the quantizer-interop test reads files exactly as llama.cpp's
// llama-quantize writes them without building llama.cpp (many minutes on 2 cores). The library
// is loaded with dlopen: without the oracle cache the tool exits 3 saying what to run.
//
//   moraine-test-llama-quantize IN.gguf OUT.gguf TYPE [--imatrix uniform] [--lib DIR]
//
// TYPE is a moraine type name (q4_1, iq4_xs, ...); the file type is llama.cpp's for it
// (llama_file_type in common/formats/type_map.h), so llama.cpp picks its usual per-tensor mix.
// --imatrix uniform: an importance matrix of ones for every matrix (ne0 * n_expert values per
// tensor, what llama.cpp checks), which the IQ2 / IQ1 / IQ3_XXS types require; a format test
// needs valid blocks, not the best ones.
#include <dlfcn.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "common/formats/tensor_type.h"
#include "common/formats/type_map.h"
#include "common/gguf/gguf.h"
#include "llama.h"

namespace {

namespace fs = std::filesystem;

struct Imatrix {
  std::vector<std::string> names;
  std::vector<std::vector<float>> values;
  std::vector<llama_model_imatrix_data> entries;  // terminated by a null name
};

// Ones for every tensor with more than one row, sized as llama.cpp checks (ne0 * ne2).
Imatrix uniform_imatrix(const std::string& path) {
  Imatrix m;
  const auto file = moraine::gguf::GgufFile::open(path);
  for (const auto& t : file.tensors()) {
    if (t.shape.size() < 2 || t.shape[1] < 2) continue;
    const int64_t n_expert = t.shape.size() >= 3 ? t.shape[2] : 1;
    m.names.push_back(t.name);
    m.values.emplace_back(static_cast<size_t>(t.shape[0] * n_expert), 1.0f);
  }
  for (size_t i = 0; i < m.names.size(); ++i) m.entries.push_back({m.names[i].c_str(), m.values[i].data(), m.values[i].size()});
  m.entries.push_back({nullptr, nullptr, 0});
  return m;
}

std::string default_lib_dir() {
  return std::string(MORAINE_SOURCE_DIR) + "/.cache/oracle/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Quantize a GGUF file with llama.cpp's own llama_model_quantize (test oracle)"};
  std::string in, out, type_name, imatrix = "none", lib_dir = default_lib_dir();
  int threads = 2;
  app.add_option("input", in, "F32/F16/BF16 GGUF file")->required();
  app.add_option("output", out, "quantized GGUF file")->required();
  app.add_option("type", type_name, "moraine type name, e.g. q4_1, iq4_xs")->required();
  app.add_option("--imatrix", imatrix, "none or uniform")->check(CLI::IsMember({"none", "uniform"}));
  app.add_option("--lib", lib_dir, "folder holding libllama (node-llama-cpp's prebuilt binaries)");
  app.add_option("--threads", threads, "quantizer threads");
  CLI11_PARSE(app, argc, argv);

  const auto type = moraine::type_from_name(type_name);
  const uint32_t ftype = type ? moraine::llama_file_type(*type) : 1024;
  if (ftype == 1024) {
    std::fprintf(stderr, "moraine-test-llama-quantize: %s is not a type llama.cpp names a file type after\n", type_name.c_str());
    return 2;
  }
  fs::path lib;
  if (fs::is_directory(lib_dir)) {
    for (const auto& e : fs::directory_iterator(lib_dir)) {
      const std::string f = e.path().filename().string();
      if (f.starts_with("libllama.") && f.ends_with(".so") && !f.starts_with("libllama-")) lib = e.path();
    }
  }
  if (lib.empty()) {
    std::fprintf(stderr, "moraine-test-llama-quantize: no libllama*.so in %s: run tests/oracle/setup (node-llama-cpp's prebuilt llama.cpp)\n",
                 lib_dir.c_str());
    return 3;
  }
  void* h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    std::fprintf(stderr, "moraine-test-llama-quantize: cannot load %s: %s\n", lib.c_str(), dlerror());
    return 3;
  }
  auto backend_init = reinterpret_cast<void (*)()>(dlsym(h, "llama_backend_init"));
  auto default_params = reinterpret_cast<llama_model_quantize_params (*)()>(dlsym(h, "llama_model_quantize_default_params"));
  auto quantize = reinterpret_cast<uint32_t (*)(const char*, const char*, const llama_model_quantize_params*)>(dlsym(h, "llama_model_quantize"));
  if (!backend_init || !default_params || !quantize) {
    std::fprintf(stderr, "moraine-test-llama-quantize: %s lacks llama_backend_init / llama_model_quantize\n", lib.c_str());
    return 3;
  }
  backend_init();
  llama_model_quantize_params p = default_params();
  p.nthread = threads;
  p.ftype = static_cast<llama_ftype>(ftype);
  Imatrix im;
  if (imatrix == "uniform") {
    im = uniform_imatrix(in);
    p.imatrix = im.entries.data();
  }
  const uint32_t rc = quantize(in.c_str(), out.c_str(), &p);
  if (rc != 0) {
    std::fprintf(stderr, "moraine-test-llama-quantize: llama_model_quantize(%s -> %s, ftype %u) failed (%u)\n", in.c_str(), out.c_str(), ftype, rc);
    return 1;
  }
  return 0;
}
