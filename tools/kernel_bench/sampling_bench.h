// `moraine-kernel-bench sampling`: the coordinator's per-token sampling time (common/sampling) over a
// real vocabulary's worth of logits, for greedy and the usual temperature / top-k / top-p settings,
// on two logit shapes (flat random, and peaked as a trained model's are). It runs on the decode
// path between two steps, so its microseconds add to every token's.
#pragma once

namespace CLI {
class App;
}

namespace moraine::kernel_bench {

struct SamplingBenchOptions {
  int vocab = 151936;        // Qwen3's
  double min_seconds = 0.2;  // per row
};

void add_sampling_subcommand(CLI::App& app, SamplingBenchOptions& opt);
int run_sampling_bench(const SamplingBenchOptions& opt);

}  // namespace moraine::kernel_bench
