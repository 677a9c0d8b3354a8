// moraine-bench: prefill and decode tok/s of a GGUF next to the decode bound of this machine's
// measured bandwidths (options: bench_cli.cpp). Engines: the in-process CPU reference executor
// ("cpu-reference") and the process group ("group-cpu" / "group-cuda", started by the bench
// with the --vram/--ram budgets); every output names the engine.
//
//   moraine-bench -m model.gguf -n 64 --prompt-lengths 512,8192 --threads 16 --json
//   moraine-bench -m model.gguf --engine group --backend cuda --vram 12G --ram 32G --census-warmup
#include <iostream>
#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "common/model/hparams.h"
#include "common/model/model.h"
#include "coordinator/placement.h"
#include "tools/bench/bench_cli.h"
#include "tools/bench/bench_run.h"
#include "tools/bench/group_engine.h"
#include "tools/bench/prefill_bound.h"
#include "tools/bench/reference_engine.h"

int main(int argc, char** argv) {
  using namespace moraine::bench;
  const EngineFactory reference = [](const BenchOptions& o) {
    auto m = std::make_unique<moraine::model::Model>(moraine::model::Model::load(o.model));
    ModelSummary s{o.model, m->hp.arch_string(), m->file.file_bytes(), m->hp.n_layer,
                   m->hp.n_expert, m->hp.n_expert_used, moraine::bench::prefill_model(*m)};
    if (o.engine == "group") {
      GroupEngineOptions g;
      g.model = o.model;
      g.backend = o.backend;
      g.cpu_workers = o.cpu_workers;
      g.vram_adapt_every = o.vram_adapt_every;
      g.threads = o.threads > 0 ? o.threads : static_cast<int>(std::thread::hardware_concurrency());
      g.vram = o.vram_text;
      g.ram = o.ram_text;
      g.bin_dir = o.bin_dir;
      g.supervisor_args = o.supervisor_args;
      g.check_logits = o.check_logits;
      g.speculate = o.speculate;
      int64_t longest = 1;
      for (int64_t n : o.prompt_lengths) longest = std::max(longest, n);
      // g.max_tokens stays 0: the coordinator's window, as a user's group gets (a --supervisor-arg
      // --max-tokens=N wins). It was min(longest prompt, 512), which at -p 8192 kept 512-row windows.
      // The longest run is the census warm-up's: the longest prompt, then n + 1 tokens, the
      // last of which is never fed back.
      const int64_t needed = longest + o.n_gen + 1;
      if (o.ctx > 0 && o.ctx < needed) {
        throw std::invalid_argument("--ctx " + std::to_string(o.ctx) + " is less than the " + std::to_string(needed) +
                                    " positions the runs need (longest prompt " + std::to_string(longest) + " + n " +
                                    std::to_string(o.n_gen) + " + 1)");
      }
      g.ctx = o.ctx > 0 ? o.ctx : needed;
      // The group plans min(--ctx, the model's context_length): a longer run would only fail
      // inside the gpu_worker, mid-bench.
      if (moraine::group::planned_context(*m, g.ctx) < needed) {
        throw std::invalid_argument(o.model + ": the runs need " + std::to_string(needed) +
                                    " positions (longest prompt " + std::to_string(longest) + " + n " +
                                    std::to_string(o.n_gen) + " + 1), more than the model's context_length " +
                                    std::to_string(moraine::group::planned_context(*m, needed)));
      }
      g.socket_dir = o.socket_dir;
      auto engine = std::make_unique<GroupEngine>(g, std::move(m));
      if (o.census_warmup) engine->warm_census(bench_prompt(longest, engine->n_vocab()), o.n_gen + 1);
      return EngineUnderTest{std::move(engine), s};
    }
    return EngineUnderTest{std::make_unique<ReferenceEngine>(std::move(m), o.threads), s};
  };
  return bench_main(argc, argv, reference, std::cout, std::cerr);
}
