// moraine-perplexity: the perplexity of a GGUF model over a text on the CPU reference executor,
// computed as llama.cpp's llama-perplexity computes it: the text (one trailing newline dropped)
// is tokenized whole, cut into non-overlapping chunks of -c tokens (the first token of each made
// BOS where the vocabulary adds one), each chunk is evaluated from an empty cache and only the
// tokens of its second half are scored (positions ctx/2 .. ctx-2 predict the next token), so
// every scored token has at least ctx/2 tokens of context. With --kl-base the base model runs the
// same chunks and each scored row is compared with the base's: KL(base || model), top-1
// agreement and the perplexity difference (tools/common/perplexity_stats.h).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/reference/executor.h"
#include "common/tokenizer/tokenizer.h"
#include "tools/common/perplexity_stats.h"

namespace {

using Clock = std::chrono::steady_clock;
using moraine::tools::MeanAndError;

struct Options {
  std::string model;
  std::string text;
  std::string kl_base;
  int ctx = 512;      // llama-perplexity's default -c
  int chunks = 0;     // 0: every whole chunk of the text
  int threads = 0;
  uint64_t dot_order = 0;   // ExecutorOptions::dot_order: 0, the kernels' own float order
};

// Rows of logits asked of the executor at once: bounds the memory of a chunk's scored half
// (ctx / 2 rows of n_vocab floats) without changing a number (its rows are computed alone).
constexpr int64_t kRowsPerForward = 64;

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(path + ": cannot read the text: " + std::strerror(errno));
  std::ostringstream s;
  s << f.rdbuf();
  std::string text = s.str();
  if (!text.empty() && text.back() == '\n') text.pop_back();   // as llama.cpp's -f reads a file
  return text;
}

// One model evaluating chunks: an empty cache per chunk, its first half fed without logits, then
// the scored rows a batch at a time.
class ChunkEvaluator {
 public:
  ChunkEvaluator(const std::string& path, const Options& o)
      : model_(moraine::model::Model::load(path)), exec_(model_, executor_options(o)) {}
  const moraine::model::Model& model() const { return model_; }
  int64_t n_vocab() const { return exec_.n_vocab(); }

  void begin(std::span<const int32_t> first_half) {
    exec_.reset();
    exec_.forward(first_half, false);
  }
  // Logits [tokens.size()][n_vocab] of the next rows.
  std::vector<float> rows(std::span<const int32_t> tokens) { return exec_.forward(tokens, true); }

 private:
  static moraine::reference::ExecutorOptions executor_options(const Options& o) {
    moraine::reference::ExecutorOptions e;
    e.n_threads = o.threads;
    e.dot_order = o.dot_order;
    return e;
  }
  moraine::model::Model model_;
  moraine::reference::ReferenceExecutor exec_;
};

// Progress on stderr: a redrawn bar on a terminal, one line per chunk otherwise (logs, CI).
class ChunkProgress {
 public:
  explicit ChunkProgress(int n) : n_(n), tty_(isatty(STDERR_FILENO) == 1), start_(Clock::now()) {}
  void done(int chunks_done, double ppl) {
    const double secs = std::chrono::duration<double>(Clock::now() - start_).count();
    const double per_chunk = secs / chunks_done, eta = per_chunk * (n_ - chunks_done);
    if (!tty_) {
      std::fprintf(stderr, "[%d/%d] PPL %.4f  %.2f s/chunk  ETA %.0f s\n", chunks_done, n_, ppl, per_chunk, eta);
      return;
    }
    constexpr int kWidth = 30;
    const int filled = kWidth * chunks_done / n_;
    std::fprintf(stderr, "\r\033[K[%s%s] %d/%d chunks  PPL %.4f  %.2f s/chunk  ETA %.0f s",
                 std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(kWidth - filled), '.').c_str(), chunks_done, n_, ppl, per_chunk, eta);
    if (chunks_done == n_) std::fprintf(stderr, "\n");
    std::fflush(stderr);
  }

 private:
  int n_;
  bool tty_;
  Clock::time_point start_;
};

std::vector<int32_t> tokenize_text(const moraine::model::Model& model, const Options& o,
                                   std::optional<int32_t>& bos_per_chunk) {
  std::unique_ptr<moraine::tokenizer::Tokenizer> tok;
  try {
    tok = std::make_unique<moraine::tokenizer::Tokenizer>(moraine::tokenizer::Tokenizer::from_gguf(model.file));
  } catch (const std::exception& e) {
    throw std::runtime_error(o.model + ": no usable tokenizer (" + e.what() + ")");
  }
  std::vector<int32_t> tokens = tok->encode(read_text(o.text), /*add_special=*/true, /*parse_special=*/false);
  if (tokens.size() < static_cast<size_t>(o.ctx))
    throw std::runtime_error(o.text + ": " + std::to_string(tokens.size()) + " tokens, shorter than one chunk of -c " +
                             std::to_string(o.ctx) + " (give a longer text or a smaller -c)");
  if (tok->add_bos() && tok->bos()) bos_per_chunk = *tok->bos();
  return tokens;
}

void print_mean(const char* label, MeanAndError m, const char* format) {
  std::printf(format, label, m.mean, m.error);
}

int run(const Options& o) {
  ChunkEvaluator model(o.model, o);
  std::unique_ptr<ChunkEvaluator> base;
  if (!o.kl_base.empty()) {
    base = std::make_unique<ChunkEvaluator>(o.kl_base, o);
    if (base->n_vocab() != model.n_vocab())
      throw std::runtime_error(o.kl_base + ": a vocabulary of " + std::to_string(base->n_vocab()) + " tokens, " +
                               o.model + " has " + std::to_string(model.n_vocab()));
  }
  std::optional<int32_t> bos;
  const std::vector<int32_t> tokens = tokenize_text(model.model(), o, bos);
  const int64_t ctx = o.ctx, first = ctx / 2, V = model.n_vocab();
  int n_chunks = static_cast<int>(static_cast<int64_t>(tokens.size()) / ctx);
  if (o.chunks > 0) n_chunks = std::min(n_chunks, o.chunks);
  std::fprintf(stderr, "moraine-perplexity: %zu tokens, %d chunks of %lld, %lld scored per chunk\n", tokens.size(),
               n_chunks, static_cast<long long>(ctx), static_cast<long long>(ctx - 1 - first));

  moraine::tools::PerplexityStats ppl;
  moraine::tools::DivergenceStats divergence;
  ChunkProgress progress(n_chunks);
  for (int c = 0; c < n_chunks; ++c) {
    std::vector<int32_t> chunk(tokens.begin() + c * ctx, tokens.begin() + (c + 1) * ctx);
    if (bos) chunk[0] = *bos;
    const std::span<const int32_t> all(chunk);
    model.begin(all.first(static_cast<size_t>(first)));
    if (base) base->begin(all.first(static_cast<size_t>(first)));
    // The last token is only predicted, never fed: rows first .. ctx - 2.
    for (int64_t at = first; at < ctx - 1; at += kRowsPerForward) {
      const std::span<const int32_t> feed = all.subspan(static_cast<size_t>(at),
                                                        static_cast<size_t>(std::min(kRowsPerForward, ctx - 1 - at)));
      const std::vector<float> rows = model.rows(feed);
      std::vector<float> base_rows;
      if (base) base_rows = base->rows(feed);
      for (size_t r = 0; r < feed.size(); ++r) {
        const std::span<const float> row(rows.data() + r * V, static_cast<size_t>(V));
        const int32_t next = chunk[static_cast<size_t>(at) + r + 1];
        ppl.add(row, next);
        if (base) divergence.add(std::span<const float>(base_rows.data() + r * V, static_cast<size_t>(V)), row, next);
      }
    }
    progress.done(c + 1, ppl.ppl().mean);
  }

  std::printf("%s: %d chunks of %lld tokens, %zu scored\n", o.model.c_str(), n_chunks, static_cast<long long>(ctx),
              ppl.count());
  // llama-perplexity's own line and precision.
  print_mean("Final estimate: PPL", ppl.ppl(), "%s = %.4f +/- %.5f\n");
  if (base) {
    print_mean("base PPL", divergence.base_ppl(), "%s = %.4f +/- %.5f\n");
    print_mean("delta PPL (model - base)", divergence.delta_ppl(), "%s = %.6f +/- %.6f\n");
    print_mean("mean KLD", divergence.kl(), "%s = %.6f +/- %.6f\n");
    const MeanAndError top = divergence.top1();
    print_mean("top-1 agreement", {100 * top.mean, 100 * top.error}, "%s = %.3f +/- %.3f %%\n");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moraine-perplexity: perplexity of a model over a text (as llama-perplexity computes it), and its "
               "KL divergence from a base model, on the CPU reference executor"};
  Options o;
  app.add_option("-m,--model", o.model, "GGUF model file")->required();
  app.add_option("-f,--file", o.text, "text file to score")->required();
  app.add_option("--kl-base", o.kl_base, "base GGUF (e.g. the F32 file) to compare the model's logits with");
  app.add_option("-c,--ctx-size", o.ctx, "tokens per chunk; the second half of each is scored")
      ->check(CLI::Range(4, 1 << 24));
  app.add_option("--chunks", o.chunks, "score at most this many chunks (0 = all)")->check(CLI::NonNegativeNumber);
  app.add_option("-t,--threads", o.threads, "worker threads (0 = all cores)")->check(CLI::NonNegativeNumber);
  // How far another valid float order alone moves the numbers: the scale below which two correct
  // engines cannot be told apart (docs/perf-log.md, session 24: 0.01-0.1% on the quantized files).
  app.add_option("--dot-order", o.dot_order,
                 "float order of every dot (0 = the kernels' own; another seed: another valid order, "
                 "common/reference/matmul.h)");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::cerr << "moraine-perplexity: " << e.what() << "\n";
    return 1;
  }
}
