// The CPU expert worker's FFN: gate, up, SwiGLU and down of routed experts, fused per expert
// so the intermediate (n_tok x ffn floats) stays in cache, on one flat job list per phase.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/formats/tensor_type.h"
#include "kernels/cpu/thread_pool.h"

namespace moraine::cpu {

// One expert's three matrices, GGUF layout (row-major, one quantized row per output).
struct ExpertWeights {
  TensorType gate_type = TensorType::F32, up_type = TensorType::F32, down_type = TensorType::F32;
  const void* gate = nullptr;  // [ffn rows][hidden]
  const void* up = nullptr;    // [ffn rows][hidden]
  const void* down = nullptr;  // [hidden rows][ffn]
  int64_t hidden = 0, ffn = 0;
};

// One expert's share of a layer's tokens: it adds route_weight[i] * FFN(x[tokens[i]]) into
// y_accum[tokens[i]]. tokens are row indices into the layer's x / y_accum, distinct within one
// assignment.
struct ExpertAssignment {
  const ExpertWeights* weights = nullptr;
  const int32_t* tokens = nullptr;
  const float* route_weight = nullptr;
  int n_tok = 0;
};

// Runs one layer's routed experts. Phases (each one flat job list on the pool): quantize each
// token's x once per activation type (inline for a few tokens); gate+up row chunks of every
// expert, the last chunk of each expert applying SwiGLU and quantizing its intermediate; down
// by output-row chunks across all experts, so no two jobs write the same y element (no
// atomics) and the sum order is fixed (experts in list order): results do not depend on the
// thread count. Scratch grows on demand and is reused;
// a steady layer loop allocates nothing.
class MoeFfn {
 public:
  // x, y_accum: [n_tokens][hidden] floats. Throws std::invalid_argument on inconsistent shapes,
  // types without a kernel, dimensions not a multiple of a block, or token indices out of range.
  void run(std::span<const ExpertAssignment> experts, const float* x, float* y_accum, int n_tokens, int64_t hidden,
           ThreadPool& pool);

 private:
  struct Plan {
    int64_t h_offset = 0;  // where this expert's [n_tok][ffn] gate/up/h rows start
    int64_t q_offset = 0;  // where its quantized intermediate rows start (bytes)
    size_t q_row_bytes = 0;
    int first_job = 0;  // first gate/up job
  };
  std::vector<uint8_t> xq_;    // per activation type: [n_tokens][row bytes]
  std::vector<float> gate_, up_;
  std::vector<uint8_t> hq_;
  std::vector<Plan> plan_;
  std::unique_ptr<std::atomic<int>[]> remaining_;  // gate/up chunks left per expert
  size_t remaining_capacity_ = 0;
};

// One expert over n_tok contiguous tokens: y_accum[t] += route_weight[t] * FFN(x[t]).
// Uses a thread-local MoeFfn for scratch.
void expert_ffn(const ExpertWeights& w, const float* x, int n_tok, const float* route_weight, float* y_accum,
                ThreadPool& pool);

}  // namespace moraine::cpu
