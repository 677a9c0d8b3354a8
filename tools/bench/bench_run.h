// Timed runs of a BenchEngine with the checks that decide whether a number may be printed:
// finite logits everywhere, and the same greedy output on every run (warm-up included).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "tools/bench/bench_engine.h"

namespace moraine::bench {

// A run that produced a number we refuse to print; what() says what went wrong and where.
class BenchFault : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Timing {
  int64_t n_tokens = 0;   // prompt length (prefill) or tokens generated (decode)
  double tok_s = 0;       // mean over the counted runs (every run after the first)
  double stddev = 0;      // over the counted runs
  int counted_runs = 0;
  std::vector<int32_t> output;   // decode: the greedy ids every run produced (prompt's first token first)
};

// The fixed prompt: n ids from a 64-bit LCG with a fixed seed, in [0, n_vocab). The same ids
// on every machine and run, so llama.cpp and moraine can be fed the same sequence.
std::vector<int32_t> bench_prompt(int64_t n, int64_t n_vocab);

// `runs` >= 2 prefills of the prompt from an empty context; the first is the warm-up.
Timing time_prefill(BenchEngine& e, const std::vector<int32_t>& prompt, int runs);
// `runs` >= 2 greedy decodes of n_gen tokens after a one-token prompt; the first is the warm-up.
Timing time_decode(BenchEngine& e, int64_t n_gen, int runs);
// One greedy decode as time_decode's, counted on its own: the first run after the engine
// started, while its file cache is cold (BenchEngine::has_file_tier).
Timing time_decode_once(BenchEngine& e, int64_t n_gen);

}  // namespace moraine::bench
