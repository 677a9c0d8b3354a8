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
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/formats/quant.h"
#include "common/formats/tensor_type.h"
#include "common/gguf/gguf.h"

namespace {

using moraine::TensorType;
using moraine::gguf::GgufFile;
using moraine::gguf::GgufWriter;
using moraine::gguf::TensorInfo;
using moraine::gguf::Value;
using Clock = std::chrono::steady_clock;

// A bad command line or input the user must fix: printed without a stack of context.
class UserError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Rule {
  std::string pattern;
  TensorType type;
};

// Types moraine can write as weights: computable ones, except Q8_K, which ggml uses only for
// activations (no llama.cpp matmul takes a Q8_K weight).
bool is_weight_target(TensorType t) {
  return moraine::type_traits(t).computable && t != TensorType::Q8_K;
}

std::string weight_target_names() {
  std::string out;
  for (uint32_t raw = 0; raw < 64; ++raw) {
    const moraine::TypeTraits* tr = moraine::find_type_traits(raw);
    if (tr && is_weight_target(tr->type)) out += (out.empty() ? "" : ", ") + std::string(tr->name);
  }
  return out;
}

TensorType parse_target_type(const std::string& name, const std::string& where) {
  const std::optional<TensorType> t = moraine::type_from_name(name);
  if (!t || !is_weight_target(*t)) {
    throw UserError(where + ": '" + name + "' is not a type moraine-quantize writes (use one of: " +
                    weight_target_names() + ")");
  }
  return *t;
}

Rule parse_rule(const std::string& text) {
  const size_t eq = text.rfind('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == text.size()) {
    throw UserError("--map '" + text + "': expected PATTERN=TYPE, e.g. --map \"_exps.=q4_k\"");
  }
  return {text.substr(0, eq), parse_target_type(text.substr(eq + 1), "--map '" + text + "'")};
}

// llama.cpp's LLAMA_FTYPE number naming a file whose most common weight type is `t` (the same
// table llama.cpp uses to guess a file type; a K-quant names its "_M" mix).
uint32_t llama_file_type(TensorType t) {
  switch (t) {
    case TensorType::F32: return 0;
    case TensorType::F16: return 1;
    case TensorType::Q4_0: return 2;
    case TensorType::Q4_1: return 3;
    case TensorType::Q8_0: return 7;
    case TensorType::Q5_0: return 8;
    case TensorType::Q5_1: return 9;
    case TensorType::Q2_K: return 10;
    case TensorType::Q3_K: return 12;  // Q3_K_M
    case TensorType::Q4_K: return 15;  // Q4_K_M
    case TensorType::Q5_K: return 17;  // Q5_K_M
    case TensorType::Q6_K: return 18;
    case TensorType::IQ2_XXS: return 19;
    case TensorType::IQ2_XS: return 20;
    case TensorType::IQ3_XXS: return 23;
    case TensorType::IQ1_S: return 24;
    case TensorType::IQ4_NL: return 25;
    case TensorType::IQ3_S: return 26;
    case TensorType::IQ2_S: return 28;
    case TensorType::IQ4_XS: return 30;
    case TensorType::IQ1_M: return 31;
    case TensorType::BF16: return 32;
    case TensorType::TQ1_0: return 36;
    case TensorType::TQ2_0: return 37;
    case TensorType::MXFP4: return 38;  // MXFP4_MOE
    default: return 1024;               // LLAMA_FTYPE_GUESSED: no file type names it
  }
}

// Dimensions as ggml counts them: trailing 1s do not count, so a [n, 1] tensor is 1-D.
int effective_dims(const TensorInfo& t) {
  int n = 1;
  for (size_t i = 1; i < t.shape.size(); ++i) {
    if (t.shape[i] != 1) n = static_cast<int>(i) + 1;
  }
  return n;
}

struct TensorPlan {
  const TensorInfo* in = nullptr;
  TensorType out = TensorType::F32;
  uint64_t out_bytes = 0;
  bool copy = false;  // bytes are written unchanged
};

TensorPlan plan_tensor(const TensorInfo& t, const std::vector<Rule>& rules, TensorType fallback_default) {
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
  } else if (effective_dims(t) == 1) {
    p.out = TensorType::F32;  // norms and biases: tiny, and precision there is cheap to keep
  } else {
    TensorType want = fallback_default;
    for (const Rule& r : rules) {
      if (t.name.find(r.pattern) != std::string::npos) {
        want = r.type;
        break;
      }
    }
    p.out = want;
    if (row % moraine::type_traits(want).block_elems != 0) {
      p.out = (row % 32 == 0) ? TensorType::Q8_0 : TensorType::F16;
      std::fprintf(stderr, "moraine-quantize: %s: row length %lld is not a multiple of %lld (%s); using %s\n",
                   t.name.c_str(), static_cast<long long>(row),
                   static_cast<long long>(moraine::type_traits(want).block_elems),
                   std::string(moraine::type_name(want)).c_str(),
                   std::string(moraine::type_name(p.out)).c_str());
    }
  }
  p.copy = p.copy || p.out == t.type;
  const int64_t n_rows = t.n_rows();
  p.out_bytes = p.copy ? t.n_bytes : moraine::row_bytes(p.out, row) * static_cast<uint64_t>(n_rows);
  return p;
}

// Progress on stderr: a redrawn bar on a terminal, one line per tensor otherwise (logs, CI).
class Progress {
 public:
  Progress(size_t n_tensors, uint64_t total_out_bytes)
      : tty_(isatty(STDERR_FILENO) == 1), n_(n_tensors), total_(total_out_bytes), start_(Clock::now()) {}

  bool tty() const { return tty_; }

  // `fraction` of tensor i (0-based) is done.
  void draw(size_t i, const TensorPlan& p, double fraction) {
    const uint64_t out_now = done_out_ + static_cast<uint64_t>(fraction * static_cast<double>(p.out_bytes));
    const uint64_t in_now = done_in_ + static_cast<uint64_t>(fraction * static_cast<double>(p.in->n_bytes));
    const double secs = std::chrono::duration<double>(Clock::now() - start_).count();
    const double mbps = secs > 0 ? static_cast<double>(in_now) / 1e6 / secs : 0.0;
    const double overall = total_ ? static_cast<double>(out_now) / static_cast<double>(total_) : 1.0;
    constexpr int kWidth = 24;
    const int filled = std::clamp(static_cast<int>(overall * kWidth), 0, kWidth);
    std::fprintf(stderr, "\r\033[K[%s%s] tensor %zu/%zu  %.1f/%.1f MB  %.0f MB/s  %s -> %s",
                 std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(kWidth - filled), '.').c_str(), i + 1, n_,
                 static_cast<double>(out_now) / 1e6, static_cast<double>(total_) / 1e6, mbps,
                 p.in->name.c_str(), std::string(moraine::type_name(p.out)).c_str());
    std::fflush(stderr);
  }

  void finish_tensor(size_t i, const TensorPlan& p) {
    done_out_ += p.out_bytes;
    done_in_ += p.in->n_bytes;
    if (tty_) {
      draw(i, p, 0.0);
      return;
    }
    const double secs = std::chrono::duration<double>(Clock::now() - start_).count();
    std::fprintf(stderr, "[%zu/%zu] %s %s -> %s%s  %.1f/%.1f MB  %.0f MB/s\n", i + 1, n_, p.in->name.c_str(),
                 std::string(moraine::type_name(p.in->type)).c_str(), std::string(moraine::type_name(p.out)).c_str(),
                 p.copy ? " (copied)" : "", static_cast<double>(done_out_) / 1e6, static_cast<double>(total_) / 1e6,
                 secs > 0 ? static_cast<double>(done_in_) / 1e6 / secs : 0.0);
  }

  void end() {
    if (tty_) std::fprintf(stderr, "\n");
  }

  double seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

 private:
  bool tty_;
  size_t n_;
  uint64_t total_;
  uint64_t done_out_ = 0;
  uint64_t done_in_ = 0;
  Clock::time_point start_;
};

// Converts the rows of one tensor into `dst` on `n_threads` threads; the calling thread redraws
// the progress bar meanwhile. Rows are claimed in chunks of about 64K elements: small enough to
// balance, large enough that claiming costs nothing next to quantizing.
void convert_tensor(const TensorPlan& p, uint8_t* dst, int n_threads, Progress& progress, size_t index) {
  const TensorInfo& t = *p.in;
  const int64_t row = t.shape.empty() ? 1 : t.shape[0];
  const int64_t n_rows = t.n_rows();
  const size_t in_row_bytes = moraine::row_bytes(t.type, row);
  const size_t out_row_bytes = moraine::row_bytes(p.out, row);
  const int64_t chunk = std::max<int64_t>(1, 65536 / std::max<int64_t>(row, 1));
  std::atomic<int64_t> next{0}, rows_done{0};
  int running = 0;  // guarded by `mutex`
  std::exception_ptr error;
  std::mutex mutex;
  std::condition_variable all_done;

  auto work = [&] {
    std::vector<float> scratch(static_cast<size_t>(row));
    try {
      for (;;) {
        const int64_t begin = next.fetch_add(chunk);
        if (begin >= n_rows) break;
        const int64_t end = std::min(n_rows, begin + chunk);
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
        rows_done.fetch_add(end - begin);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex);
      if (!error) error = std::current_exception();
      next.store(n_rows);  // stop the others early
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (--running == 0) all_done.notify_one();
  };

  const int n = static_cast<int>(std::clamp<int64_t>(n_threads, 1, std::max<int64_t>(1, n_rows / chunk + 1)));
  running = n;
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) pool.emplace_back(work);
  {
    // Redraw ten times a second until the last worker is done (without waiting out the tick).
    std::unique_lock<std::mutex> lock(mutex);
    while (!all_done.wait_for(lock, std::chrono::milliseconds(100), [&] { return running == 0; })) {
      if (progress.tty()) {
        progress.draw(index, p, static_cast<double>(rows_done.load()) / static_cast<double>(std::max<int64_t>(n_rows, 1)));
      }
    }
  }
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

struct Options {
  std::string in_path;
  std::string out_path;
  std::vector<std::string> maps;
  std::string default_type = "q8_0";
  int threads = 0;
};

int run(const Options& opt) {
  std::vector<Rule> rules;
  for (const auto& m : opt.maps) rules.push_back(parse_rule(m));
  const TensorType default_type = parse_target_type(opt.default_type, "--default");
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
    if (effective_dims(t) >= 2) elements_by_type[plans.back().out] += t.n_elements();
    any_quantized = any_quantized || moraine::type_traits(plans.back().out).block_elems > 1;
  }

  GgufWriter w;
  for (const auto& [key, value] : in->metadata()) {
    if (key.rfind("split.", 0) == 0) continue;  // a split input becomes one output file
    w.set(key, value);
  }
  TensorType dominant = TensorType::F32;
  int64_t most = -1;
  for (const auto& [type, n] : elements_by_type) {
    if (n > most) {
      most = n;
      dominant = type;
    }
  }
  w.set("general.file_type", Value::u32(llama_file_type(dominant)));
  // ggml's quantization version (GGML_QNT_VERSION); llama.cpp writes it into quantized files.
  if (any_quantized) w.set("general.quantization_version", Value::u32(2));

  Progress progress(plans.size(), total_out);
  for (size_t i = 0; i < plans.size(); ++i) {
    const TensorPlan& p = plans[i];
    Progress* prog = &progress;
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
      prog->finish_tensor(i, p);
    });
  }
  w.write(opt.out_path);
  progress.end();
  std::fprintf(stderr, "moraine-quantize: wrote %s: %.1f MB from %.1f MB in %.1f s, file type %u\n",
               opt.out_path.c_str(), static_cast<double>(total_out) / 1e6,
               static_cast<double>(in->file_bytes()) / 1e6, progress.seconds(), llama_file_type(dominant));
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
