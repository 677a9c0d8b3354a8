// moraine-synth: writes a GGUF of a real MoE model's shape (or a tiny variant) with random
// weights whose routers prefer experts by a Zipf law, for benchmarks and tests that need the
// real tensor sizes but not a trained model. Neighbouring tokens share experts more often than
// memoryless routing would (router_locality.h), as real routers do.
//
//   moraine-synth --shape qwen3moe-30b-a3b -o synth.gguf --layers 4
//       --vocab-from .cache/oracle/llama.cpp/models/ggml-vocab-qwen2.gguf --zipf 1.0
//
// Types: --map/--default as moraine-quantize (first matching --map wins, 1-D tensors stay F32).
// After the user's rules come the built-in ones: routers (ffn_gate_inp) and conv taps
// (ssm_conv1d) F32, as llama.cpp keeps them, and the experts (_exps.) q4_k; everything else
// --default (q8_0). Output streams to disk tensor by tensor; rows are generated and quantized
// on all cores, and the bytes do not depend on the thread count.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
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
#include "tools/synth/fast_quantize.h"
#include "tools/synth/shapes.h"
#include "tools/synth/vocab_meta.h"
#include "tools/synth/weight_init.h"

namespace {

using moraine::TensorType;
using moraine::TypeRule;
using moraine::gguf::GgufWriter;
using moraine::gguf::Value;
using namespace moraine::synth;

struct Options {
  std::string shape;
  std::string out_path;
  int64_t layers = 0;   // 0: the shape's
  int64_t experts = 0;  // 0: the shape's
  int64_t vocab_size = 0;
  std::vector<std::string> maps;
  std::string default_type = "q8_0";
  std::string vocab_from;
  std::string tokenizer_json;
  uint64_t seed = 0;
  double zipf = 1.0;
  int threads = 0;
};

// Rules after the user's: what llama.cpp never quantizes, then the usual expert type.
// Per-expert biases (gpt-oss: ffn_*_exps.bias) stay F32 as llama.cpp keeps every bias.
const char* const kBuiltinRules[] = {"ffn_gate_inp=f32", "ssm_conv1d=f32", "_exps.bias=f32", "_exps.=q4_k"};

struct Planned {
  TensorSpec spec;
  TensorType type;
  uint64_t bytes;
};

int run(const Options& opt) {
  ShapeSpec shape = find_shape(opt.shape);
  if (opt.layers < 0 || opt.experts < 0 || opt.vocab_size < 0) {
    throw std::invalid_argument("--layers, --experts and --vocab-size must be positive");
  }
  if (opt.layers > 0) shape.n_layer = opt.layers;
  if (opt.experts > 0) {
    shape.n_expert = opt.experts;
    shape.n_expert_used = std::min(shape.n_expert_used, shape.n_expert);
  }
  if (opt.zipf < 0 || opt.zipf > 4) throw std::invalid_argument("--zipf must be in [0, 4] (0 = uniform routing)");
  if (opt.threads < 0) throw std::invalid_argument("--threads must be >= 0 (0 = all cores)");
  const int threads = opt.threads > 0 ? opt.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  std::vector<TypeRule> rules;
  for (const auto& m : opt.maps) rules.push_back(moraine::parse_type_rule(m));
  for (const char* m : kBuiltinRules) rules.push_back(moraine::parse_type_rule(m));
  const TensorType default_type = moraine::parse_weight_type(opt.default_type, "--default");

  const std::optional<int64_t> explicit_vocab = opt.vocab_size > 0 ? std::optional<int64_t>(opt.vocab_size) : std::nullopt;
  VocabMeta vocab = !opt.vocab_from.empty()      ? vocab_from_gguf(opt.vocab_from, shape.vocab, explicit_vocab)
                    : !opt.tokenizer_json.empty() ? vocab_from_tokenizer_json(opt.tokenizer_json, shape.vocab, explicit_vocab)
                                                  : byte_level_vocab(shape.vocab, explicit_vocab);
  if (!vocab.note.empty()) std::fprintf(stderr, "moraine-synth: %s\n", vocab.note.c_str());
  shape.vocab = vocab.n_vocab;

  const WeightInit init(shape, opt.seed, opt.zipf);

  std::vector<Planned> plan;
  uint64_t total = 0;
  std::map<TensorType, int64_t> elements_by_type;
  bool any_quantized = false;
  for (TensorSpec& t : tensor_list(shape)) {
    const moraine::TypeChoice c = moraine::choose_weight_type(t.name, t.shape, rules, default_type);
    if (!c.note.empty()) std::fprintf(stderr, "moraine-synth: %s\n", c.note.c_str());
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    const uint64_t bytes = moraine::row_bytes(c.type, t.shape[0]) * static_cast<uint64_t>(n / t.shape[0]);
    if (moraine::effective_dims(t.shape) >= 2) elements_by_type[c.type] += n;
    any_quantized = any_quantized || moraine::type_traits(c.type).block_elems > 1;
    total += bytes;
    plan.push_back({std::move(t), c.type, bytes});
  }

  GgufWriter w;
  w.set("general.architecture", Value::string(shape.arch));
  w.set("general.name", Value::string("moraine-synth " + opt.shape));
  for (auto& [k, v] : arch_metadata(shape)) w.set(k, std::move(v));
  w.set("general.file_type", Value::u32(moraine::llama_file_type(elements_by_type)));
  // How the file was made, so a reader can check or reproduce the routing skew.
  w.set("moraine.synth.shape", Value::string(opt.shape));
  w.set("moraine.synth.seed", Value::u64(opt.seed));
  w.set("moraine.synth.zipf", Value::f32(static_cast<float>(opt.zipf)));
  w.set("moraine.synth.massive_dim", Value::u32(static_cast<uint32_t>(init.massive_dim())));
  // The slow subspace the recency heads write and the routers read (router_locality.h).
  w.set("moraine.synth.slow_dim_first", Value::u32(static_cast<uint32_t>(init.recency().slow_first)));
  w.set("moraine.synth.slow_dim_count", Value::u32(static_cast<uint32_t>(init.recency().slow_count)));
  w.set("moraine.synth.slow_share", Value::f32(static_cast<float>(kSlowShare)));
  w.set("moraine.synth.slow_variance", Value::f32(static_cast<float>(kSlowVariance)));
  for (auto& [k, v] : vocab.keys) w.set(k, std::move(v));
  // ggml's quantization version (GGML_QNT_VERSION); llama.cpp writes it into quantized files.
  if (any_quantized) w.set("general.quantization_version", Value::u32(2));

  moraine::tools::TensorProgress progress(plan.size(), total);
  for (size_t i = 0; i < plan.size(); ++i) {
    const Planned& p = plan[i];
    moraine::tools::TensorProgress* prog = &progress;
    w.add_tensor(p.spec.name, p.spec.shape, p.type, [&p, &init, prog, i, threads](uint8_t* dst, uint64_t n_bytes) {
      if (n_bytes != p.bytes) throw std::logic_error("writer asked for an unexpected size of " + p.spec.name);
      const int64_t row = p.spec.shape[0];
      const size_t out_row = moraine::row_bytes(p.type, row);
      int64_t n_rows = 1;
      for (size_t d = 1; d < p.spec.shape.size(); ++d) n_rows *= p.spec.shape[d];
      // About 64K elements per claimed chunk: balances well and keeps the scratch in cache.
      const int64_t chunk = std::max<int64_t>(1, 65536 / row);
      const moraine::tools::ProgressItem item{p.spec.name, "random", std::string(moraine::type_name(p.type)),
                                              p.bytes, p.bytes, false};
      moraine::tools::for_rows_in_parallel(
          n_rows, chunk, threads,
          [&](int64_t begin, int64_t end) {
            if (p.type == TensorType::F32) {
              init.fill_rows(p.spec, begin, end, reinterpret_cast<float*>(dst + static_cast<size_t>(begin) * out_row));
              return;
            }
            thread_local std::vector<float> scratch;
            scratch.resize(static_cast<size_t>((end - begin) * row));
            init.fill_rows(p.spec, begin, end, scratch.data());
            for (int64_t r = begin; r < end; ++r) {
              fast_quantize_row(p.type, scratch.data() + (r - begin) * row, dst + static_cast<size_t>(r) * out_row,
                                    row);
            }
          },
          [&](double fraction) {
            if (prog->tty()) prog->draw(i, item, fraction);
          });
      prog->finish(i, item);
    });
  }
  w.write(opt.out_path);
  progress.end();
  const double secs = progress.seconds();
  std::fprintf(stderr, "moraine-synth: wrote %s: %s, %lld layers, %lld experts (top-%lld), vocab %lld, %.1f MB in %.1f s (%.0f MB/s, %d threads)\n",
               opt.out_path.c_str(), opt.shape.c_str(), static_cast<long long>(shape.n_layer),
               static_cast<long long>(shape.n_expert), static_cast<long long>(shape.n_expert_used),
               static_cast<long long>(shape.vocab), static_cast<double>(total) / 1e6, secs,
               secs > 0 ? static_cast<double>(total) / 1e6 / secs : 0.0, threads);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Write a GGUF with a real MoE model's shape, random weights and Zipf-skewed routers."};
  Options opt;
  std::string shapes;
  for (const ShapeSpec& s : named_shapes()) shapes += (shapes.empty() ? "" : ", ") + s.name;
  app.add_option("--shape", opt.shape, "model shape: " + shapes)->required();
  app.add_option("-o,--output", opt.out_path, "output GGUF file")->required();
  app.add_option("--layers", opt.layers, "number of layers (default: the shape's)");
  app.add_option("--experts", opt.experts, "experts per layer (default: the shape's; top-k is capped to it)");
  app.add_option("--vocab-size", opt.vocab_size,
                 "embedding rows and token count (default: the shape's, or the vocabulary's when larger)");
  app.add_option("--map", opt.maps,
                 "PATTERN=TYPE: tensors whose name contains PATTERN get TYPE (first match wins; repeatable; "
                 "then ffn_gate_inp=f32, ssm_conv1d=f32, _exps.bias=f32, _exps.=q4_k)")
      ->allow_extra_args(false);
  app.add_option("--default", opt.default_type, "type of 2-D+ tensors no rule matches")->capture_default_str();
  auto* vf = app.add_option("--vocab-from", opt.vocab_from, "copy the tokenizer.* keys of this GGUF");
  auto* tj = app.add_option("--tokenizer-json", opt.tokenizer_json, "import a Hugging Face tokenizer.json (or its folder)");
  vf->excludes(tj);
  app.add_option("--seed", opt.seed, "random seed (with the tensor name, decides every value)")->capture_default_str();
  app.add_option("--zipf", opt.zipf, "Zipf exponent of expert popularity per layer (0 = uniform)")->capture_default_str();
  app.add_option("--threads", opt.threads, "generation threads (0 = all cores)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    return run(opt);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%smoraine-synth: error: %s\n", isatty(STDERR_FILENO) == 1 ? "\n" : "", e.what());
    return 1;
  }
}
