// moraine-quantize: rewrites a GGUF model with its tensors converted to other formats, chosen per
// tensor by name rules. Output streams to disk one tensor at a time (GgufWriter's Fill), so the
// model is never held in memory; rows of a tensor are converted by a pool of threads.
//
//   moraine-quantize IN.gguf OUT.gguf --map "_exps.=q4_k" --map "attn_v=q6_k" --default q8_0
//
// Rules: the first --map whose PATTERN is a substring of the tensor name wins, else --default.
// 1-D tensors (norms, biases) are always F32. A row length that is not a multiple of the chosen
// type's block falls back to q8_0, or to f16 when it is not a multiple of 32 either.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/formats/quant.h"
#include "common/formats/tensor_type.h"
#include "common/formats/type_map.h"
#include "common/gguf/gguf.h"
#include "tools/common/tensor_progress.h"

namespace {

using moraine::TensorType;
using moraine::gguf::GgufFile;
using moraine::gguf::GgufWriter;
using moraine::gguf::TensorInfo;
using moraine::TypeRule;
using moraine::gguf::Value;

// A bad command line or input the user must fix: printed without a stack of context.
class UserError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct TensorPlan {
  const TensorInfo* in = nullptr;
  TensorType out = TensorType::F32;
  uint64_t out_bytes = 0;
  bool copy = false;  // bytes are written unchanged

  moraine::tools::ProgressItem progress_item() const {
    return {in->name, std::string(moraine::type_name(in->type)), std::string(moraine::type_name(out)), out_bytes,
            in->n_bytes, copy};
  }
};

TensorPlan plan_tensor(const TensorInfo& t, const std::vector<TypeRule>& rules, TensorType fallback_default) {
  TensorPlan p;
  p.in = &t;
  const int64_t row = t.shape.empty() ? 1 : t.shape[0];
  if (!moraine::type_traits(t.type).computable) {
    // Integer tensors and formats moraine cannot decode are carried over as they are.
    p.out = t.type;
    p.copy = true;
    if (t.type != TensorType::I8 && t.type != TensorType::I16 && t.type != TensorType::I32 &&
        t.type != TensorType::I64 && t.type != TensorType::F64) {
      std::fprintf(stderr, "moraine-quantize: %s: kept as %s (moraine cannot decode it)\n", t.name.c_str(),
                   std::string(moraine::type_name(t.type)).c_str());
    }
  } else {
    const moraine::TypeChoice choice = moraine::choose_weight_type(t.name, t.shape, rules, fallback_default);
    p.out = choice.type;
    if (!choice.note.empty()) std::fprintf(stderr, "moraine-quantize: %s\n", choice.note.c_str());
  }
  p.copy = p.copy || p.out == t.type;
  const int64_t n_rows = t.n_rows();
  p.out_bytes = p.copy ? t.n_bytes : moraine::row_bytes(p.out, row) * static_cast<uint64_t>(n_rows);
  return p;
}

// Converts the rows of one tensor into `dst` on `n_threads` threads; the calling thread redraws
// the progress bar meanwhile. Rows are claimed in chunks of about 64K elements: small enough to
// balance, large enough that claiming costs nothing next to quantizing.
void convert_tensor(const TensorPlan& p, uint8_t* dst, int n_threads, moraine::tools::TensorProgress& progress,
                    size_t index) {
  const TensorInfo& t = *p.in;
  const int64_t row = t.shape.empty() ? 1 : t.shape[0];
  const size_t in_row_bytes = moraine::row_bytes(t.type, row);
  const size_t out_row_bytes = moraine::row_bytes(p.out, row);
  const int64_t chunk = std::max<int64_t>(1, 65536 / std::max<int64_t>(row, 1));
  const moraine::tools::ProgressItem item = p.progress_item();
  moraine::tools::for_rows_in_parallel(
      t.n_rows(), chunk, n_threads,
      [&](int64_t begin, int64_t end) {
        std::vector<float> scratch(static_cast<size_t>(row));
        for (int64_t r = begin; r < end; ++r) {
          const uint8_t* src = t.data + static_cast<size_t>(r) * in_row_bytes;
          const float* f = scratch.data();
          if (t.type == TensorType::F32) {
            f = reinterpret_cast<const float*>(src);
          } else {
            moraine::dequantize_row(t.type, src, scratch.data(), row);
          }
          moraine::quantize_row(p.out, f, dst + static_cast<size_t>(r) * out_row_bytes, row);
        }
      },
      [&](double fraction) {
        if (progress.tty()) progress.draw(index, item, fraction);
      });
}

struct Options {
  std::string in_path;
  std::string out_path;
  std::vector<std::string> maps;
  std::string default_type = "q8_0";
  int threads = 0;
};

int run(const Options& opt) {
  std::vector<TypeRule> rules;
  TensorType default_type;
  try {
    for (const auto& m : opt.maps) rules.push_back(moraine::parse_type_rule(m));
    default_type = moraine::parse_weight_type(opt.default_type, "--default");
  } catch (const std::invalid_argument& e) {
    throw UserError(e.what());
  }
  if (opt.threads < 0) throw UserError("--threads must be >= 0 (0 = all cores)");
  const int threads = opt.threads > 0 ? opt.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  std::optional<GgufFile> in;
  try {
    in.emplace(GgufFile::open(opt.in_path));
  } catch (const std::exception& e) {
    throw UserError("cannot read " + opt.in_path + ": " + e.what());
  }

  std::vector<TensorPlan> plans;
  uint64_t total_out = 0;
  std::map<TensorType, int64_t> elements_by_type;  // of tensors with 2+ dims: names the file type
  bool any_quantized = false;
  for (const TensorInfo& t : in->tensors()) {
    plans.push_back(plan_tensor(t, rules, default_type));
    total_out += plans.back().out_bytes;
    if (moraine::effective_dims(t.shape) >= 2) elements_by_type[plans.back().out] += t.n_elements();
    any_quantized = any_quantized || moraine::type_traits(plans.back().out).block_elems > 1;
  }

  GgufWriter w;
  for (const auto& [key, value] : in->metadata()) {
    if (key.rfind("split.", 0) == 0) continue;  // a split input becomes one output file
    w.set(key, value);
  }
  const uint32_t file_type = moraine::llama_file_type(elements_by_type);
  w.set("general.file_type", Value::u32(file_type));
  // ggml's quantization version (GGML_QNT_VERSION); llama.cpp writes it into quantized files.
  if (any_quantized) w.set("general.quantization_version", Value::u32(2));

  moraine::tools::TensorProgress progress(plans.size(), total_out);
  for (size_t i = 0; i < plans.size(); ++i) {
    const TensorPlan& p = plans[i];
    moraine::tools::TensorProgress* prog = &progress;
    w.add_tensor(p.in->name, p.in->shape, p.out, [&p, prog, i, threads](uint8_t* dst, uint64_t n_bytes) {
      if (n_bytes != p.out_bytes) throw std::logic_error("writer asked for an unexpected size of " + p.in->name);
      if (p.copy) {
        std::copy(p.in->data, p.in->data + p.in->n_bytes, dst);
      } else {
        try {
          convert_tensor(p, dst, threads, *prog, i);
        } catch (const std::exception& e) {
          throw UserError("tensor " + p.in->name + " (" + std::string(moraine::type_name(p.in->type)) + " -> " +
                          std::string(moraine::type_name(p.out)) + "): " + e.what());
        }
      }
      prog->finish(i, p.progress_item());
    });
  }
  w.write(opt.out_path);
  progress.end();
  std::fprintf(stderr, "moraine-quantize: wrote %s: %.1f MB from %.1f MB in %.1f s, file type %u\n",
               opt.out_path.c_str(), static_cast<double>(total_out) / 1e6,
               static_cast<double>(in->file_bytes()) / 1e6, progress.seconds(), file_type);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Convert a GGUF model's tensors to other formats, chosen per tensor by name."};
  Options opt;
  app.add_option("input", opt.in_path, "input GGUF file (first shard of a split model)")->required();
  app.add_option("output", opt.out_path, "output GGUF file")->required();
  app.add_option("--map", opt.maps,
                 "PATTERN=TYPE: tensors whose name contains PATTERN get TYPE (first match wins; repeatable)")
      ->allow_extra_args(false);
  app.add_option("--default", opt.default_type, "type of 2-D+ tensors no --map matches")->capture_default_str();
  app.add_option("--threads", opt.threads, "conversion threads (0 = all cores)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    return run(opt);
  } catch (const std::exception& e) {
    // Start on a fresh line when a progress bar may be half drawn.
    std::fprintf(stderr, "%smoraine-quantize: error: %s\n", isatty(STDERR_FILENO) == 1 ? "\n" : "", e.what());
    return 1;
  }
}
