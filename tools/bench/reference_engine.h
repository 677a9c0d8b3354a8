// BenchEngine over the in-process CPU reference executor ("engine: cpu-reference"): every weight
// is read from the mapped GGUF in RAM, so all bytes of a decode token are RAM bytes.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/reference/executor.h"
#include "tools/bench/bench_engine.h"

namespace moraine::bench {

// Weight bytes one decode token reads, split as the bound needs them.
struct ModelReadBytes {
  double dense = 0;             // everything but the routed experts (incl. one token_embd row, the lm head)
  double experts = 0;           // top-k routed experts summed over the layers
  double expert_bytes = 0;      // one expert of one layer (gate + up + down)
  double total() const { return dense + experts; }
};

// dense bytes + n_layer * top-k * expert bytes, from the bound weights of the trunk layers
// (nextn layers are not run by the reference and are not counted).
ModelReadBytes decode_read_bytes(const model::Model& m);

class ReferenceEngine final : public BenchEngine {
 public:
  ReferenceEngine(std::unique_ptr<model::Model> m, int n_threads);
  std::string name() const override { return "cpu-reference"; }
  int64_t n_vocab() const override { return exec_.n_vocab(); }
  void reset() override { exec_.reset(); }
  std::span<const float> prefill(std::span<const int32_t> tokens) override;
  std::span<const float> decode_one(int32_t token) override;
  EngineStats stats() const override;
  int n_threads() const override { return exec_.n_threads(); }

 private:
  std::unique_ptr<model::Model> model_;  // before exec_, which holds a reference to it
  reference::ReferenceExecutor exec_;
  ModelReadBytes bytes_;
  std::vector<float> logits_;
};

}  // namespace moraine::bench
