// The CPU expert worker's FFN: gate, up, SwiGLU and down of routed experts, fused per expert
// so the intermediate (n_tok x ffn floats) stays in cache, on one flat job list per phase.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/formats/tensor_type.h"
#include "kernels/cpu/cpu_kernel_tuning.h"
#include "kernels/cpu/thread_pool.h"

namespace moraine::cpu {

// One expert's three matrices, GGUF layout (row-major, one quantized row per output).
struct ExpertWeights {
  TensorType gate_type = TensorType::F32, up_type = TensorType::F32, down_type = TensorType::F32;
  const void* gate = nullptr;  // [ffn rows][hidden]
  const void* up = nullptr;    // [ffn rows][hidden]
  const void* down = nullptr;  // [hidden rows][ffn]
  int64_t hidden = 0, ffn = 0;
  // gpt-oss's experts (model::ExpertsPart): per-expert F32 biases (nullptr: none) added to the
  // gate, up and down outputs, and its clamped SwiGLU, g = min(gate, limit), u = clamp(up, +-limit),
  // act = g * sigmoid(alpha g) * (u + 1): reference::biased_expert's arithmetic, bit for bit.
  const float* gate_bias = nullptr;  // [ffn]
  const float* up_bias = nullptr;    // [ffn]
  const float* down_bias = nullptr;  // [hidden]
  bool clamped_swiglu = false;
  float swiglu_alpha = 1.702f, swiglu_limit = 7.0f;
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

// Where a layer call's time goes, per pool worker (MoeFfn::set_phase_trace; the kernel bench's
// --phase-trace). Times are steady_clock nanoseconds; a worker that ran no job keeps jobs == 0.
struct alignas(64) FfnWorkerPhases {  // one cache line each: the workers write their own
  int64_t first_start_ns = 0;  // its first job began
  int64_t gate_up_end_ns = 0;  // its last gate/up job ended (0: it ran none)
  int64_t rows_done_ns = 0;    // its last gate/up job had its rows (before counting itself done)
  int64_t ready_set_ns = 0;    // it quantized an expert's intermediate (the expert's down may start; 0: none)
  int64_t down_wait_ns = 0;    // summed time its down jobs waited for their experts' intermediates
  int64_t last_end_ns = 0;     // its last job ended
  int jobs = 0;
};
struct FfnPhaseTrace {
  int64_t call_start_ns = 0;  // run_layer began
  int64_t list_start_ns = 0;  // the job list was handed to the pool (after planning)
  int64_t call_end_ns = 0;    // the pool's list returned
  std::vector<FfnWorkerPhases> workers;  // pool.size() entries, resized by the call
};

// Runs one layer's routed experts as ONE job list on the pool (ThreadPool::run_sliced_phases):
// phase 1, thread w's equal share (FfnSlices) of every expert's gate+up rows, each job applying
// SwiGLU to its rows, the last one of an expert quantizing its intermediate and marking the expert
// ready; phase 2, thread w's share of the down rows. A thread done with its share of a phase takes
// the last jobs of slower threads before it moves on. A job waits (spinning, and pulling its own
// weight rows into L2 meanwhile) only for what it reads: gate/up for the quantized rows, down for
// its expert's intermediate. Shares are cut at multiples of 4 rows (the tiles' step), so which
// thread computes a row never changes its bits. Accumulating experts (run()) write per-expert
// partials; the job finishing a chunk's last partial adds the chunk into y_accum in expert list
// order, so no two jobs write the same y element and the sum order is fixed: results do not
// depend on the thread count, the slices or the prefetch distances. Scratch grows on demand and
// is reused; a steady layer loop allocates nothing, and a call of the same shape as the last
// reuses its job list.
class MoeFfn {
 public:
  MoeFfn() = default;
  explicit MoeFfn(const CpuKernelTuning& tuning) : tuning_(tuning) {}
  // The tuning the next calls use (kernel tier cap, AMX threshold, prefetch distances, tiles,
  // slices). Only the kernel choices (max_isa, amx_min_tokens, tiles) may move Q8_0 / MXFP4
  // results, within the summation bound; the k-quants stay bitwise.
  void set_tuning(const CpuKernelTuning& tuning) { tuning_ = tuning; }
  const CpuKernelTuning& tuning() const { return tuning_; }
  // Each later call writes its phase times there (nullptr, the default: none). A trace costs a
  // few clock reads per job; the caller owns it and reads it between calls.
  void set_phase_trace(FfnPhaseTrace* trace) { trace_ = trace; }

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
  // one expert), in one job list for the whole layer instead of one per expert (8 Q4_K experts
  // at 1 token on the 2-core dev box: 12.5 -> 5.8 ms). Rows are read where they are and results
  // written straight to each job's y (no staging copies).
  struct ExpertJob {
    const ExpertWeights* weights = nullptr;
    const float* x = nullptr;  // [m][hidden]
    int m = 0;
    float* y = nullptr;  // [m][hidden], overwritten
  };
  void run_experts(std::span<const ExpertJob> jobs, ThreadPool& pool);

  // The cpu_expert_worker's form: the rows stay in the layer's activation block x
  // ([n_rows][hidden]); job j's row i is x[rows[i]] (rows may repeat across jobs: each distinct
  // row is quantized once per activation type, and rows no job names are not touched). Same
  // results as the ExpertJob form on the gathered rows, without gathering them.
  struct RowsJob {
    const ExpertWeights* weights = nullptr;
    const int32_t* rows = nullptr;  // m indices into x
    int m = 0;
    float* y = nullptr;  // [m][hidden], overwritten
  };
  void run_experts(std::span<const RowsJob> jobs, const float* x, int n_rows, ThreadPool& pool);

  // Pulls into each pool thread's L2 (prefetcht1) the weight rows that thread reads when
  // run_experts is next called with these experts at m rows each (its own slices of the list).
  // For the cpu_expert_worker's idle time between two layer calls: a call whose rows sit in its
  // threads' L2 runs at their compute rate instead of a cold stream (H200 host, Q4_K at 1 expert,
  // a right guess: 36.9 -> 27.0 us; a wrong one costs nothing). stop(ctx), when given, is polled
  // every 1 KB of lines per thread: the prefetch ends as soon as it returns true (the call it
  // prepares has arrived). Computes and writes nothing; throws std::invalid_argument on
  // inconsistent experts. Returns false when stop() ended it before every thread had pulled all
  // its rows.
  bool prefetch_experts(std::span<const ExpertWeights* const> experts, int m, ThreadPool& pool, bool (*stop)(const void* ctx) = nullptr,
                        const void* ctx = nullptr);

  // Grows the scratch for up to `max_tokens` tokens through `max_experts` experts of this shape,
  // so that later runs within it allocate nothing (call once at start-up).
  void reserve(int max_tokens, int64_t hidden, int64_t ffn, int max_experts = 1);

 private:
  static constexpr int kActTypeCount = 6;  // Q8_0, Q8_K, F32, F16, BF16, Q8_1
  struct Plan {
    int64_t h_offset = 0;  // where this expert's [n_tok][ffn] gate/up/h rows start
    int64_t q_offset = 0;  // where its quantized intermediate rows start (bytes)
    int64_t y_offset = 0;  // where its [n_tok][hidden] down partials start (accumulating experts)
    size_t q_row_bytes = 0;
  };
  // The activation types the layer needs (list[0..n)) and where each one's rows are in xq_.
  struct ActRows {
    int list[kActTypeCount] = {};
    int n = 0;
    size_t offset[kActTypeCount] = {}, row[kActTypeCount] = {};
  };
  // One job: rows [r0, r1) of one expert's gate+up (down == 0) or down (1) matrices.
  struct Span {
    int32_t expert = 0, down = 0;
    int64_t r0 = 0, r1 = 0;
  };
  // The layer, once x_rows_ (a source pointer per token row, n_tokens of them) and out_ (per
  // assignment: its own output rows, overwritten, or nullptr to accumulate into y_accum[token])
  // are set.
  void run_layer(std::span<const ExpertAssignment> experts, float* y_accum, int n_tokens, int64_t hidden, ThreadPool& pool);
  // Validates the layer and lays out its scratch; false when no expert has tokens.
  bool plan_layer(std::span<const ExpertAssignment> experts, float* y_accum, int n_tokens, int64_t hidden);
  // spans_ and slice_end_ (two phases of n_slices slices), chunk_spans_ for accumulating experts.
  void build_spans(std::span<const ExpertAssignment> experts, int64_t hidden, int n_slices);
  void quantize_x(int64_t job, int64_t hidden);
  void run_gate_up(const Span& sp, std::span<const ExpertAssignment> experts, int64_t hidden, FfnWorkerPhases* ph);
  void run_down(const Span& sp, std::span<const ExpertAssignment> experts, float* y_accum, int64_t hidden, FfnWorkerPhases* ph);
  // prefetch_experts' part: each thread pulls the rows of its own slices toward its L2.
  void prefetch_slices(std::span<const ExpertAssignment> experts, int64_t hidden, ThreadPool& pool);
  // Where a span's first matrix rows start, and how many bytes.
  const uint8_t* span_weights(const Span& sp, std::span<const ExpertAssignment> experts, int64_t hidden, size_t& bytes) const;
  template <typename T>
  static void grow_atomics(std::unique_ptr<std::atomic<T>[]>& a, size_t& capacity, size_t n);

  CpuKernelTuning tuning_;
  FfnPhaseTrace* trace_ = nullptr;
  std::vector<uint8_t> xq_;    // per activation type: [n_tokens][row bytes]
  std::vector<float> gate_, up_, part_;
  std::vector<uint8_t> hq_;
  std::vector<Plan> plan_;
  ActRows act_;
  int n_accumulating_ = 0;            // experts with tokens and no own output rows
  int64_t x_jobs_ = 0;                // quantization jobs at the front of the list (slice 0)
  std::vector<const float*> x_rows_;  // [n_tokens]: where each token row's floats are
  std::vector<float*> out_;           // [experts]
  std::vector<uint8_t> row_used_;     // [n_tokens]
  std::vector<int32_t> used_rows_;    // the rows some expert reads, ascending
  std::vector<int32_t> active_;       // experts with tokens, in list order
  std::unique_ptr<std::atomic<int>[]> remaining_;  // gate/up chunks left per expert
  std::unique_ptr<std::atomic<int>[]> ready_;      // per expert: intermediate quantized
  std::unique_ptr<std::atomic<int>[]> chunk_left_;  // per down chunk: accumulating experts' spans left
  size_t expert_capacity_ = 0, ready_capacity_ = 0, chunk_capacity_ = 0;
  alignas(64) std::atomic<int64_t> x_done_{0};  // quantization jobs finished
  std::vector<int32_t> iota_;  // run_expert's token list 0..m-1
  std::vector<float> ones_;    // and its route weights
  std::vector<ExpertAssignment> job_assign_;
  std::vector<int64_t> slice_end_;     // the list's slice ends (two phases)
  std::vector<int32_t> chunk_spans_;   // accumulating experts: their down spans per down chunk
  std::vector<Span> spans_;
  std::vector<int64_t> plan_key_, plan_key_next_;  // what spans_ / slice_end_ were built for
  // prefetch_experts: run_layer plans as usual, then only prefetches (when prefetch_ is set).
  struct Prefetch {
    bool (*stop)(const void* ctx) = nullptr;
    const void* ctx = nullptr;
  };
  const Prefetch* prefetch_ = nullptr;
  std::atomic<bool> prefetch_cut_{false};   // a thread's prefetch was stopped before its last row
  std::vector<int64_t> prefetch_ends_;
  float prefetch_sink_ = 0.0f;  // the outputs' stand-in (never written)
};

// One expert over n_tok contiguous tokens: y_accum[t] += route_weight[t] * FFN(x[t]).
// Uses a thread-local MoeFfn for scratch.
void expert_ffn(const ExpertWeights& w, const float* x, int n_tok, const float* route_weight, float* y_accum,
                ThreadPool& pool, const CpuKernelTuning& tuning = {});

}  // namespace moraine::cpu
