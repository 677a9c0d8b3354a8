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

  // The cpu_expert_worker's per-expert call, reference::swiglu_expert's contract: y[m][hidden] =
  // down(silu(gate x) * up x) for m contiguous rows of x, y overwritten (no route weight; the
  // caller combines the slots). Fill ExpertWeights from the three model::Matrix slices:
  // {gate.type, up.type, down.type, gate.data, up.data, down.data, gate.n_cols, gate.n_rows}.
  // Results: bitwise reference::swiglu_expert's for the k-quants (Q2_K..Q6_K gate/up/down: the
  // same activation rounding, integer block sums and per-block float order, the same silu);
  // for Q8_0 / MXFP4 the float sum of each dot is taken in a different order (per-lane partial
  // sums in the register tiles against the per-row kernels'), so each gate/up/down dot is within
  // twice the recursive-summation bound of the other's (tests/cpu_kernels/test_expert_ffn.cpp).
  // Throws std::invalid_argument as run() does.
  void run_expert(const ExpertWeights& w, const float* x, int m, float* y, ThreadPool& pool);

  // Several experts of one layer at once, each with its own rows: for each job, y[m][hidden] =
  // FFN(x[m][hidden]) exactly as run_expert computes it (bitwise: every y element comes from
  // one expert), but in two pool phases for the whole list instead of two per expert (each
  // phase ends in a barrier of the pool; at decode an expert's phase is only ~10-30 us of work
  // on 16 threads). Copies the rows in and out (m x hidden floats each way). Measured on the
  // 2-core dev box (loaded by other builds, so the gap is larger than on a quiet machine), 8
  // L3-resident Q4_K experts at 1 token: run_expert x 8 12.5 ms, run_experts 5.8 ms.
  struct ExpertJob {
    const ExpertWeights* weights = nullptr;
    const float* x = nullptr;  // [m][hidden]
    int m = 0;
    float* y = nullptr;  // [m][hidden], overwritten
  };
  void run_experts(std::span<const ExpertJob> jobs, ThreadPool& pool);

  // Grows the scratch for up to `max_tokens` tokens through `max_experts` experts of this shape,
  // so that later runs within it allocate nothing (call once at start-up).
  void reserve(int max_tokens, int64_t hidden, int64_t ffn, int max_experts = 1);

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
  std::vector<int32_t> iota_;  // run_expert's token list 0..m-1
  std::vector<float> ones_;    // and its route weights
  std::vector<float> x_all_, y_all_;               // run_experts: the jobs' rows, stacked
  std::vector<ExpertAssignment> job_assign_;
};

// Rows of one matrix per pool job: gate+up jobs take `gate_up` rows of one expert, down jobs
// `down` output rows of every expert. Process-wide, for the benches' A/B runs (--gate-up-rows,
// --down-rows); results do not depend on it (each y element is still summed in expert order).
struct FfnJobRows {
  int64_t gate_up = 16;
  int64_t down = 32;
};
void set_ffn_job_rows(FfnJobRows rows);  // values < 1 become 1
FfnJobRows ffn_job_rows();

// One expert over n_tok contiguous tokens: y_accum[t] += route_weight[t] * FFN(x[t]).
// Uses a thread-local MoeFfn for scratch.
void expert_ffn(const ExpertWeights& w, const float* x, int n_tok, const float* route_weight, float* y_accum,
                ThreadPool& pool);

}  // namespace moraine::cpu
