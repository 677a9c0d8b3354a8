#include "tools/kernel_bench/sampling_bench.h"

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "common/sampling/sampler.h"

namespace moraine::kernel_bench {

void add_sampling_subcommand(CLI::App& app, SamplingBenchOptions& opt) {
  CLI::App* sub = app.add_subcommand("sampling", "per-token sampling time over a vocabulary of logits");
  sub->add_option("--vocab", opt.vocab, "logits per token")->check(CLI::Range(2, 4 << 20));
  sub->add_option("--min-seconds", opt.min_seconds, "minimum time per row")->check(CLI::Range(0.0, 60.0));
}

int run_sampling_bench(const SamplingBenchOptions& opt) {
  std::mt19937_64 rng(1);
  std::normal_distribution<float> noise(0.0f, 2.0f);
  std::vector<float> flat(static_cast<size_t>(opt.vocab));
  for (float& x : flat) x = noise(rng);
  // Peaked: a trained model puts most of the mass on a few tokens; here 20 of them 15-21 above the rest.
  std::vector<float> peaked = flat;
  std::uniform_int_distribution<int> pick(0, opt.vocab - 1);
  for (int i = 0; i < 20; ++i) peaked[static_cast<size_t>(pick(rng))] += 15.0f + 0.3f * static_cast<float>(i);
  struct Row {
    const char* name;
    sampling::SamplerParams p;
  };
  const Row rows[] = {{"greedy", {0.0f, 0, 1.0f, 7}},
                      {"temp 0.8", {0.8f, 0, 1.0f, 7}},
                      {"temp 0.8 top-p 0.95", {0.8f, 0, 0.95f, 7}},
                      {"temp 0.8 top-k 40 top-p 0.95", {0.8f, 40, 0.95f, 7}}};
  std::printf("vocabulary %d logits (%.2f MB per token); us per token\n", opt.vocab, opt.vocab * 4.0 / 1e6);
  std::printf("%-30s %12s %12s\n", "sampler", "flat", "peaked");
  for (const Row& r : rows) {
    double us[2];
    for (int shape = 0; shape < 2; ++shape) {
      const std::vector<float>& l = shape == 0 ? flat : peaked;
      sampling::Sampler s(r.p);
      long sink = 0;
      int n = 0;
      const auto t0 = std::chrono::steady_clock::now();
      double sec = 0;
      do {
        sink += s.sample(l);
        ++n;
        sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      } while (sec < opt.min_seconds || n < 3);
      us[shape] = sec * 1e6 / n;
      if (sink == -1) std::printf(" ");   // keeps the draws
    }
    std::printf("%-30s %12.1f %12.1f\n", r.name, us[0], us[1]);
  }
  return 0;
}

}  // namespace moraine::kernel_bench
