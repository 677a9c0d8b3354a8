#include "tools/bench/bench_run.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <span>

namespace moraine::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Greedy pick, refusing logits a faulty run would show: wrong width, NaN or inf.
int32_t checked_argmax(std::span<const float> logits, int64_t n_vocab, const std::string& where) {
  if (static_cast<int64_t>(logits.size()) != n_vocab) {
    throw BenchFault(where + ": the engine returned " + std::to_string(logits.size()) + " logits, expected " +
                     std::to_string(n_vocab));
  }
  int64_t best = 0;
  for (int64_t i = 0; i < n_vocab; ++i) {
    if (!std::isfinite(logits[i])) {
      throw BenchFault(where + ": logit " + std::to_string(i) + " is " + (std::isnan(logits[i]) ? "NaN" : "inf"));
    }
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

Timing summarize(int64_t n_tokens, const std::vector<double>& seconds) {
  Timing t;
  t.n_tokens = n_tokens;
  t.counted_runs = static_cast<int>(seconds.size());
  std::vector<double> rates;
  for (double s : seconds) rates.push_back(static_cast<double>(n_tokens) / s);
  double sum = 0;
  for (double r : rates) sum += r;
  t.tok_s = sum / static_cast<double>(rates.size());
  double var = 0;
  for (double r : rates) var += (r - t.tok_s) * (r - t.tok_s);
  t.stddev = rates.size() > 1 ? std::sqrt(var / static_cast<double>(rates.size() - 1)) : 0.0;
  return t;
}

void check_engine_fault(const BenchEngine& e, const std::string& where) {
  const std::string f = e.detected_fault();
  if (!f.empty()) throw BenchFault(where + ": the engine reports a fault: " + f);
}

void check_runs(int runs) {
  if (runs < 2) throw std::invalid_argument("--repeat must be >= 2: the first run is the warm-up");
}

}  // namespace

std::vector<int32_t> bench_prompt(int64_t n, int64_t n_vocab) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  uint64_t s = 0x6d6f7261696e65ull;  // "moraine"
  for (int32_t& id : ids) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    id = static_cast<int32_t>((s >> 33) % static_cast<uint64_t>(n_vocab));
  }
  return ids;
}

Timing time_prefill(BenchEngine& e, const std::vector<int32_t>& prompt, int runs) {
  check_runs(runs);
  const std::string test = "pp" + std::to_string(prompt.size());
  std::vector<double> seconds;
  int32_t first_pick = -1;
  for (int r = 0; r < runs; ++r) {
    const std::string where = test + " run " + std::to_string(r + 1);
    e.reset();
    double s = 0;
    int32_t pick = -1;
    if (e.self_timed()) {
      const BenchEngine::Generated g = e.generate(prompt, 1);
      check_engine_fault(e, where);
      if (g.ids.size() != 1) throw BenchFault(where + ": the engine returned " + std::to_string(g.ids.size()) + " tokens, expected 1");
      s = g.prefill_s;
      pick = g.ids[0];
    } else {
      const auto t0 = Clock::now();
      const std::span<const float> logits = e.prefill(prompt);
      s = std::chrono::duration<double>(Clock::now() - t0).count();
      check_engine_fault(e, where);
      pick = checked_argmax(logits, e.n_vocab(), where);
    }
    if (r == 0) {
      first_pick = pick;
    } else {
      if (pick != first_pick) {
        throw BenchFault(where + ": greedy pick " + std::to_string(pick) + " differs from the warm-up's " +
                         std::to_string(first_pick) + " (non-deterministic engine)");
      }
      seconds.push_back(s);
    }
  }
  return summarize(static_cast<int64_t>(prompt.size()), seconds);
}

namespace {

// One greedy decode of n_gen tokens after a one-token prompt from an empty context; `seconds`:
// the decode steps' time.
std::vector<int32_t> decode_run(BenchEngine& e, int64_t n_gen, const std::string& where, double& seconds) {
  const std::vector<int32_t> start = bench_prompt(1, e.n_vocab());
  e.reset();
  std::vector<int32_t> output;
  if (e.self_timed()) {
    // n_gen + 1 tokens: the prefill gives the first, then n_gen timed decode steps.
    const BenchEngine::Generated g = e.generate(start, n_gen + 1);
    check_engine_fault(e, where);
    if (static_cast<int64_t>(g.ids.size()) != n_gen + 1) {
      throw BenchFault(where + ": the engine returned " + std::to_string(g.ids.size()) + " tokens, expected " +
                       std::to_string(n_gen + 1));
    }
    seconds = g.decode_s;
    return g.ids;
  }
  int32_t tok = checked_argmax(e.prefill(start), e.n_vocab(), where + " (1-token prompt)");
  output.push_back(tok);
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < n_gen; ++i) {
    tok = checked_argmax(e.decode_one(tok), e.n_vocab(), where + " token " + std::to_string(i + 1));
    output.push_back(tok);
  }
  seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  check_engine_fault(e, where);
  return output;
}

}  // namespace

Timing time_decode(BenchEngine& e, int64_t n_gen, int runs) {
  check_runs(runs);
  const std::string test = "tg" + std::to_string(n_gen);
  std::vector<double> seconds;
  std::vector<int32_t> first_output;
  for (int r = 0; r < runs; ++r) {
    const std::string where = test + " run " + std::to_string(r + 1);
    double s = 0;
    const std::vector<int32_t> output = decode_run(e, n_gen, where, s);
    if (r == 0) {
      first_output = output;
      continue;
    }
    const auto diff = std::mismatch(output.begin(), output.end(), first_output.begin());
    if (diff.first != output.end()) {
      const auto at = diff.first - output.begin();
      throw BenchFault(where + ": greedy output differs from the warm-up's at token " + std::to_string(at) + " (" +
                       std::to_string(*diff.first) + " vs " + std::to_string(*diff.second) + "): non-deterministic engine");
    }
    seconds.push_back(s);
  }
  Timing t = summarize(n_gen, seconds);
  t.output = std::move(first_output);
  return t;
}

Timing time_decode_once(BenchEngine& e, int64_t n_gen) {
  double s = 0;
  std::vector<int32_t> output = decode_run(e, n_gen, "tg" + std::to_string(n_gen) + " cold-cache run", s);
  Timing t = summarize(n_gen, {s});
  t.output = std::move(output);
  return t;
}

}  // namespace moraine::bench
