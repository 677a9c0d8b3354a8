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

// Runs one layer's routed experts as ONE flat job list on the pool (one fork/join per layer):
// [quantize each used token row once per activation type (inline for a few)] [gate+up row
// chunks of every expert; each chunk applies SwiGLU to its rows, the last of an expert quantizes its
// intermediate and marks the expert ready] [down row chunks, expert by expert]. A job waits
// (spinning) only for what it reads: gate/up for the quantized rows, an expert's down chunks
// for that expert's intermediate. Jobs are claimed in list order, so what a job waits for was
// claimed earlier by a running thread: no deadlock, and there is no pool-wide barrier between
// the phases (down work of the first experts overlaps the gate/up tail of the last ones).
// Each down chunk writes a per-expert partial; the job that completes a chunk's last expert
// adds the chunk into y_accum in expert list order, so no two jobs write the same y element
// (no atomics) and the sum order is fixed: results do not depend on the thread count, and are
// bitwise those of the earlier two-barrier version. Scratch grows on demand and is reused; a
// steady layer loop allocates nothing. On the sliced schedule the jobs are cut per thread
// instead (FfnSliceOptions::balanced; for accumulating experts with FfnSliceOptions::accumulating).
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
  // one expert), in one job list for the whole layer instead of one per expert. Rows are read
  // where they are and results written straight to each job's y (no staging copies).
  // Measured on the 2-core dev box (loaded by other builds, so the gap is larger than on a
  // quiet machine), 8 L3-resident Q4_K experts at 1 token: run_expert x 8 12.5 ms, run_experts
  // (then two phases) 5.8 ms.
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
  // results as the ExpertJob form on the gathered rows, without gathering them (the worker used
  // to copy each expert's rows into a stack, which run_experts then copied again).
  struct RowsJob {
    const ExpertWeights* weights = nullptr;
    const int32_t* rows = nullptr;  // m indices into x
    int m = 0;
    float* y = nullptr;  // [m][hidden], overwritten
  };
  void run_experts(std::span<const RowsJob> jobs, const float* x, int n_rows, ThreadPool& pool);

  // Pulls into each pool thread's L2 (prefetcht1) the weight rows that thread reads when
  // run_experts is next called with these experts at m rows each (its own slices of the
  // balanced two-phase list; other schedules: nothing). For the cpu_expert_worker's idle time
  // between two layer calls (~41 us at 12G, session 9): a layer's experts of the previous token
  // are often routed again (routing locality), and a call whose rows sit in its threads' L2 runs
  // at their compute rate instead of a cold stream. stop(ctx), when given, is polled every 1 KB
  // of lines per thread: the prefetch ends as soon as it returns true (the call it prepares has
  // arrived). Computes and writes nothing; throws std::invalid_argument on inconsistent experts.
  // Measured (H200 host, moraine-kernel-bench cpu --gap-prefetch, 15 threads, gap 40 us, p50 us
  // at 1 / 2 / 4 experts): the next call's experts (a right guess) Q4_K 36.9 / 58.8 / 104.5 ->
  // 27.0 / 42.7 / 79.5, Q8_0 58.4 / 101.7 / 180.2 -> 37.8 / 74.6 / 153.5; other experts (a wrong
  // guess) 35.5 / 52.6 / 88.5 and 56.2 / 92.4 / 161.8: no loss.
  // Returns false when stop() ended it before every thread had pulled all its rows.
  bool prefetch_experts(std::span<const ExpertWeights* const> experts, int m, ThreadPool& pool, bool (*stop)(const void* ctx) = nullptr,
                        const void* ctx = nullptr);

  // Grows the scratch for up to `max_tokens` tokens through `max_experts` experts of this shape,
  // so that later runs within it allocate nothing (call once at start-up).
  void reserve(int max_tokens, int64_t hidden, int64_t ffn, int max_experts = 1);

 private:
  struct Plan {
    int64_t h_offset = 0;  // where this expert's [n_tok][ffn] gate/up/h rows start
    int64_t q_offset = 0;  // where its quantized intermediate rows start (bytes)
    int64_t y_offset = 0;  // where its [n_tok][hidden] down partials start (accumulating experts)
    size_t q_row_bytes = 0;
  };
  // The layer, once x_rows_ (a source pointer per token row, n_tokens of them) and out_ (per
  // assignment: its own output rows, overwritten, or nullptr to accumulate into y_accum[token])
  // are set.
  void run_layer(std::span<const ExpertAssignment> experts, float* y_accum, int n_tokens, int64_t hidden, ThreadPool& pool);
  template <typename T>
  static void grow_atomics(std::unique_ptr<std::atomic<T>[]>& a, size_t& capacity, size_t n);

  std::vector<uint8_t> xq_;    // per activation type: [n_tokens][row bytes]
  std::vector<float> gate_, up_, part_;
  std::vector<uint8_t> hq_;
  std::vector<Plan> plan_;
  std::vector<const float*> x_rows_;  // [n_tokens]: where each token row's floats are
  std::vector<float*> out_;           // [experts]
  std::vector<uint8_t> row_used_;     // [n_tokens]
  std::vector<int32_t> used_rows_;    // the rows some expert reads, ascending
  std::vector<int32_t> active_;       // experts with tokens, in list order
  std::unique_ptr<std::atomic<int>[]> remaining_;  // gate/up chunks left per expert
  std::unique_ptr<std::atomic<int>[]> ready_;      // per expert: intermediate quantized
  std::unique_ptr<std::atomic<int>[]> chunk_left_;  // per down chunk: accumulating experts left
  size_t expert_capacity_ = 0, ready_capacity_ = 0, chunk_capacity_ = 0;
  alignas(64) std::atomic<int64_t> x_done_{0};  // quantization jobs finished
  std::vector<int32_t> iota_;  // run_expert's token list 0..m-1
  std::vector<float> ones_;    // and its route weights
  std::vector<ExpertAssignment> job_assign_;
  std::vector<int64_t> order_, slice_end_;  // the sliced schedule's job order and slice ends
  std::vector<size_t> gu_last_;             // two-phase balanced lists: each thread's last gate/up span
  std::vector<int32_t> chunk_spans_;        // balanced lists with accumulating experts: their down spans per down chunk
  // One job: rows [r0, r1) of one expert's gate+up (down == 0) or down (1) matrices; next: the
  // job the same thread runs after it (its weights are the next-call prefetch hint), or -1.
  // slice, bg0, bg1 (FfnStreamOptions::down_early, gate/up jobs of two-phase balanced lists): the
  // slice the job belongs to and the down jobs [bg0, bg1) of that slice it pulls toward L2.
  struct Span {
    int32_t expert = 0, down = 0;
    int64_t r0 = 0, r1 = 0, next = -1;
    int32_t slice = -1;
    int64_t bg0 = 0, bg1 = 0;
  };
  std::vector<Span> spans_;
  std::vector<int64_t> plan_key_, plan_key_next_;  // what the balanced spans_ / slice_end_ were built for
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

// Rows of one matrix per pool job: gate+up jobs take `gate_up` rows of one expert, down jobs
// `down` output rows of one expert (the shared schedule, and the sliced schedule with
// FfnSliceOptions::balanced off or, for run()'s accumulating experts, accumulating off; balanced
// slices size their jobs by thread count; an accumulating layer still sums its partials into
// y_accum in chunks of `down` rows). Process-wide, for the benches' A/B runs (--gate-up-rows,
// --down-rows); results do not depend on it (each y element is still summed in expert order)
// as long as the rows are multiples of 4 for Q8_0 / MXFP4 (matvec_tokens runs rows in tiles of
// four from a job's first row, and a tail row through the per-row kernel, whose float sum order
// differs from the tile's).
struct FfnJobRows {
  int64_t gate_up = 32;
  int64_t down = 128;
};
void set_ffn_job_rows(FfnJobRows rows);  // values < 1 become 1
FfnJobRows ffn_job_rows();

// How the layer's jobs reach the threads. Shared: every thread claims the next free job of the
// list, so its consecutive jobs are usually far apart in memory. Sliced (ThreadPool::run_sliced):
// thread w takes the w-th share of the gate/up jobs and then of the down jobs, in order, then
// helps the others: each thread streams a few long runs of consecutive rows (the default; the
// measurements are in expert_ffn.cpp). Process-wide, for the benches' A/B runs (--schedule);
// results do not depend on it.
enum class FfnSchedule { Shared, Sliced };
void set_ffn_schedule(FfnSchedule s);
FfnSchedule ffn_schedule();

// Latency options of the sliced schedule for layers whose experts write their own rows (the
// worker's run_experts forms; run()'s accumulating experts with `accumulating`), process-wide,
// for the benches' A/B runs (--balanced-slices, --wait-prefetch, --balanced-accumulate). Results
// do not depend on them.
// balanced: instead of fixed FfnJobRows chunks dealt out whole (at 2 experts and 15 threads,
// 48 gate/up chunks: some threads get 4, others 3, and every down job waits for the slowest),
// thread w gets the w-th equal share (in runs of 4 rows) of all gate/up rows and then of all
// down rows, cut only where an expert ends: one job per matrix run and thread.
// wait_prefetch: a down job whose expert's intermediate is not ready yet prefetches its own
// weight rows into L2 (prefetcht1) while it waits, instead of only spinning.
// split: balanced slices cut each thread's share of a phase into this many jobs (1: one job).
// Helpers take a slice's jobs from its back (ThreadPool::run_sliced), so with more than one a
// thread that is done early takes over the last rows of a slower one instead of idling until
// it ends (at 1 expert per call every thread's share is ~177 KB of the 2.65 MB expert).
// gate_up_first: the balanced list in two phases (ThreadPool::run_sliced_phases): a thread done
// with its gate/up share takes the last gate/up jobs of slower threads (with split > 1) before
// it starts on its down share, so the experts' intermediates are ready sooner; otherwise it
// goes straight to its own down jobs and waits there for the slowest thread's gate/up rows.
// Defaults split 4, gate_up_first. On the H200 host (clean run C: 15 threads, gap 130 us, Q4_K
// us per call at 1 / 2 / 4 experts, two runs each) a third of the workers took ~1.5x as long
// for their rows (per-worker gate/up 14-18 us, the slow ones 23-26 us at 1 expert) and every
// down job waited for them. main (ad29586: one job per thread and phase, helpers taking a
// slice's next job) 34.3-38.8 / 60.8-71.3 / 101.4-121.3 (means); one job per thread and phase
// with helpers taking from the back 39.1-41.2 / 73.0-73.2 / 131.1-139.7 (p50: the helpers then
// take down jobs that wait); split 4 + gate/up first 35.1-36.3 / 58.2-58.8 / 102.2-104.2, with
// the spread prefetch (matvec.h) 34.2-38.0 / 56.8-57.7 / 98.4-98.9 and every worker's gate/up
// 17-19 us; split 8 35.7-40.4 / 59.2-63.2 / 100.1-108.0 (its short jobs' starts show). Q8_0
// with both: 72.5 / 134.8 / 219.6 (main, means) -> 53.1 / 92.0 / 162.6 us p50.
// accumulating: the balanced list for run()'s accumulating experts too (the kernel bench's table
// form, expert_ffn()): down spans then write per-expert partials of any rows, and the span
// finishing the last partial of a chunk of FfnJobRows::down rows adds that chunk into y_accum
// (each element's sum still in expert order: results bitwise those of the fixed chunks). On the
// H200 host (session 10 run B: moraine-kernel-bench cpu --threads 16, 8 experts per call, 3
// rounds interleaved with main's fixed chunks, GB/s at 1 / 4 tokens and share of each run's DRAM
// probe at 1 token): Q4_K 77-111 / 54-64 (65-84%) -> 108-134 / 72-75 (87-106%), Q8_0 102-122 /
// 82-101 (82-86%) -> 101-129 / 85-101 (81-101%), MXFP4 98-114 / 61-69 (79-83%) -> 110-115 /
// 70-72 (85-91%). Its pattern probe (--pattern-probe: the same calls reading their lines without
// arithmetic) ran at the kernel's speed on both lists (kernel / pattern 91-105%): the fixed
// chunks' loss was their access pattern (each thread hopping between 32-row chunks of
// different experts), not the arithmetic.
// per_expert: the balanced list gives thread w the w-th share of EACH expert's rows (per phase)
// instead of the w-th share of all experts' rows laid end to end. Then which rows of an expert a
// thread reads does not depend on the other experts of the call, so what prefetch_experts pulled
// into a thread's L2 for a guessed set is read by that same thread when the call's set differs
// from the guess (the cpu_expert_worker's next-layer guess is ~84% right per expert, so its set is
// rarely exactly right; laid end to end, one expert more or less moves every later row to
// another thread, whose loads then go to the other core's L2). The share of an expert is cut
// into split / experts jobs (at least one).
struct FfnSliceOptions {
  bool balanced = true;
  bool wait_prefetch = true;
  int split = 4;
  bool gate_up_first = true;
  bool accumulating = true;
  bool per_expert = false;
};
void set_ffn_slice_options(FfnSliceOptions o);
FfnSliceOptions ffn_slice_options();

// How one job walks its rows (process-wide, for the benches' A/B runs: --runs, --down-runs,
// --gate-up-together, --down-early, --down-early-bytes; the worker's --ffn-* flags). Results do
// not depend on them (each matrix run keeps its 4-row tiles counted from the job's first row:
// matvec_tokens_runs). Why: a thread of the 16-core Xeon streams its gate/up rows at ~6.5 GB/s
// against ~8-9 GB/s per thread for the plain read with all cores, and its rows from L2 at 15-20
// GB/s: per-thread memory parallelism is the limit, so these put more independent streams and
// lines in flight per thread.
// runs: each matrix's rows of a job cut (at multiples of 4 rows) into this many runs walked side
// by side, 4-row step by step (1..8). down_runs: the same for down jobs alone (0: runs).
// gate_up_together: a gate/up job walks its gate rows and its up rows side by side (2 x runs
// streams) instead of all gate rows, then all up rows (same type only): 0 never, 1 every type,
// 2 Q4_K only (the default: the one type it was measured faster for).
// down_early: balanced two-phase lists: a thread's own gate/up jobs pull its down share into L2
// (prefetcht1) spread over their steps (the expert is known from the call's start), so its down
// jobs start on L2 hits instead of a cold stream after the gate/up -> down hand-over.
// down_early_bytes: only the first this many bytes of each down job (the start of each down
// stream); 0: the whole share.
// Measured on the H200 host (moraine-kernel-bench cpu --worker-form, 15 threads, 1 token, gap 130
// us; p50 us per call at 1 / 2 / 4 / 8 experts, mean of interleaved rounds; session 9 runs B (2
// rounds) and C (3 rounds)): Q4_K main 39.4 / 62.4 / 113.0 / 210.4 (B), 40.3 / 63.1 / 110.4 /
// 210.9 (C); gate_up_together 34.6 / 57.7 / 101.6 / 186.6 (B), 35.7 / 58.3 / 102.2 / 183.4 (C),
// faster than main in 4 of the 5 rounds at 1-2 experts and all 5 at 8; runs 2 38.0 / 58.0 / 101.2
// / 183.0 (B); down_early whole 38.7 / 64.8 / 115.2 / 213.6, first 4 KB 35.7 / 58.2 / 103.0 /
// 190.8 (B) but 38.6 / 61.3 / 107.0 / 195.3 (C), and with gate_up_together 38.5 / 62.4 / 105.9 /
// 198.6 (C): no gain over gate_up_together alone; four streams per job (together with runs 2, or
// runs 4) 37.5-40.2 / 63-68 / 116-122 / 215-234; per-run prefetcht0 at 1 KB 41.5 / 71.0 / 129.7
// / 251.0 (with gate_up_together). Q8_0 with gate_up_together (+ first 4 KB of down early)
// 60.8 / 108.1 / 212.4 / 392.1 against main's 55.6 / 95.6 / 177.9 / 334.6 (C; its 8.7 KB 4-row
// step is longer than a run's 4 KB prefetch distance); MXFP4 level (38.3 / 59.0 / 106.6 / 198.0
// against 38.9 / 61.0 / 110.6 / 199.8). Hence the default: Q4_K only.
struct FfnStreamOptions {
  int runs = 1;
  int gate_up_together = 2;
  bool down_early = false;
  size_t down_early_bytes = 0;
  int down_runs = 0;
};
void set_ffn_stream_options(FfnStreamOptions o);
FfnStreamOptions ffn_stream_options();

// Where a layer call's time goes, per pool worker, for the benches' --phase-trace (a 1-expert call
// of 2.65 MB took 44.5 us on the 16-core Xeon against ~22 us for its bytes at the DRAM probe's
// rate: the trace says whether the rest is the hand-over, the gate/up -> down wait or uneven
// threads). Times are steady_clock nanoseconds; a worker that ran no job keeps jobs == 0.
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
// Process-wide; nullptr (the default) traces nothing. A trace costs a few clock reads per job.
// The caller owns the object and reads it between calls (one MoeFfn call at a time).
void set_ffn_phase_trace(FfnPhaseTrace* trace);

// One expert over n_tok contiguous tokens: y_accum[t] += route_weight[t] * FFN(x[t]).
// Uses a thread-local MoeFfn for scratch.
void expert_ffn(const ExpertWeights& w, const float* x, int n_tok, const float* route_weight, float* y_accum,
                ThreadPool& pool);

}  // namespace moraine::cpu
