// moraine-bench: prefill and decode tok/s of a GGUF next to the decode bound of this machine's
// measured bandwidths (options: bench_cli.cpp). Until the process group and the CUDA
// backend are in, the only engine is the in-process CPU reference executor, and every output
// says "engine: cpu-reference".
//
//   moraine-bench -m model.gguf -n 64 --prompt-lengths 512,8192 --threads 16 --json
#include <iostream>
#include <memory>

#include "common/model/hparams.h"
#include "common/model/model.h"
#include "tools/bench/bench_cli.h"
#include "tools/bench/reference_engine.h"

int main(int argc, char** argv) {
  using namespace moraine::bench;
  const EngineFactory reference = [](const BenchOptions& o) {
    auto m = std::make_unique<moraine::model::Model>(moraine::model::Model::load(o.model));
    ModelSummary s{o.model, moraine::model::arch_name(m->hp.arch), m->file.file_bytes(), m->hp.n_layer,
                   m->hp.n_expert, m->hp.n_expert_used};
    return EngineUnderTest{std::make_unique<ReferenceEngine>(std::move(m), o.threads), s};
  };
  return bench_main(argc, argv, reference, std::cout, std::cerr);
}
