// Fused routed-expert FFN on the thread pool.
#include "kernels/cpu/expert_ffn.h"

#include <sched.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "common/formats/quant.h"
#include "kernels/cpu/matvec.h"
#include "kernels/cpu/vec_dot.h"

namespace moraine::cpu {
namespace {

// Rows per gate/up job and per down job (the FfnJobRows defaults). A gate+up job of 32 rows of
// a 2048-wide Q4_K expert moves 2 x 32 x 1152 B = 74 KB; a down job of 128 rows of one expert
// 128 x 432 B = 55 KB. 16 threads still share one expert's 768 rows (24 gate/up jobs) and the
// 8 experts' down rows (128 jobs) evenly; each job restarts the software prefetch, so longer
// ones stream better. A/B on the 2-core dev box, sliced schedule, huge pages (median of 4 runs,
// GB/s Q4_K / Q8_0 / MXFP4 at 1 token, DRAM probe ~46): 16/64 33.1 / 35.3 / 30.1; 32/64 33.0 /
// 35.7 / 29.3; 32/128 36.2 / 40.1 / 31.7; 48/192 36.5 / 38.4 / 32.1; 64/256 36.5 / 40.8 /
// 32.7; 96/256 36.0 / 39.0 / 32.4; 8/32 27.5 / 30.3 / 25.5. Earlier A/B on the 16-core Xeon with
// the two-phase schedule (down jobs then ran 32 rows of every expert): 16/32 56-65 / 75-81 /
// 47-52; 8/32 58 / 81 / 52; 32/32 59 / 74 / 51; 48/32 62 / 86 / 53; 16/64 58 / 78 / 46;
// 32/64 60 / 77 / 52, within that machine's ~10% noise.
std::atomic<int64_t> g_gate_up_rows{FfnJobRows{}.gate_up};
std::atomic<int64_t> g_down_rows{FfnJobRows{}.down};
// Sliced by default: on the 2-core dev box (EPYC VM) a streaming read in 32 KiB chunks handed
// out from a shared counter gets 40 GB/s against 67 GB/s in 1 MiB chunks, and the layer at 1
// token (median of 8 interleaved runs, the box loaded by other builds) went Q4_K / Q8_0 / MXFP4
// 9.5 / 11.1 / 8.3 GB/s shared -> 12.0 / 11.8 / 10.5 sliced; at 4 and 16 tokens they are level.
// On the 16-core H200 host (session 4, one run each) shared 106 / 115 / 93 against sliced
// 90-105 / 98-122 / 76-105: level within that machine's noise.
std::atomic<FfnSchedule> g_schedule{FfnSchedule::Sliced};
// Activation rows quantized by the calling thread instead of in the job list (about 1 us each
// at hidden 2048, about what handing them to the pool costs).
constexpr int64_t kInlineQuantizeJobs = 4;
// FfnSliceOptions::split's bound (a thread's share of one expert is ~50 gate/up rows at 15 threads).
constexpr int kMaxSliceSplit = 8;
// FfnStreamOptions::runs' bound (with gate_up_together, twice this many streams per call:
// matvec_tokens_runs takes at most 16).
constexpr int kMaxStreamRuns = 8;
// Down jobs one gate/up job pulls toward L2 at most (FfnStreamOptions::down_early; a share is
// `split` jobs plus one per expert boundary).
constexpr int kMaxEarlyRegions = 8;

// Splits the regions r[0, n) at half their bytes (a line boundary): r[0, n) keeps the first half,
// second[0, n_second) gets the rest (at most n regions).
void split_regions(PrefetchRegion* r, int& n, PrefetchRegion* second, int& n_second) {
  size_t total = 0;
  for (int i = 0; i < n; ++i) total += r[i].bytes;
  const size_t half = total / 2 & ~size_t{63};
  size_t acc = 0;
  n_second = 0;
  for (int i = 0; i < n; ++i) {
    if (acc + r[i].bytes <= half) {
      acc += r[i].bytes;
      continue;
    }
    const size_t off = half - acc;
    second[n_second++] = {static_cast<const uint8_t*>(r[i].p) + off, r[i].bytes - off};
    for (int j = i + 1; j < n; ++j) second[n_second++] = r[j];
    r[i].bytes = off;
    n = off > 0 ? i + 1 : i;
    return;
  }
}

// Cuts rows [r0, r1) of the matrix at w into at most k runs whose boundaries are multiples of 4
// rows from r0 (so every row keeps its tile position: results equal one run's), into out.
int cut_runs(const void* w, int64_t r0, int64_t r1, float* y, int k, MatvecRun* out) {
  const int64_t units = (r1 - r0 + 3) / 4;
  int n = 0;
  for (int j = 0; j < k; ++j) {
    const int64_t a = r0 + 4 * (units * j / k), b = std::min(r0 + 4 * (units * (j + 1) / k), r1);
    if (a < b) out[n++] = {w, a, b, y};
  }
  return n;
}

// Activation types a layer needs; x is quantized once per type.
constexpr TensorType kActTypes[] = {TensorType::Q8_0, TensorType::Q8_K, TensorType::F32, TensorType::F16, TensorType::BF16};
constexpr int kNumActTypes = 5;

int act_index(TensorType t) {
  for (int i = 0; i < kNumActTypes; ++i) {
    if (kActTypes[i] == t) return i;
  }
  throw std::invalid_argument("expert FFN: " + std::string(type_name(t)) + " is not an activation type");
}

void check_weight(TensorType t, int64_t cols, const char* what) {
  if (!best_vec_dot_fn(t)) throw std::invalid_argument(std::string("expert FFN: no CPU kernel for ") + what + " type " + std::string(type_name(t)));
  const int64_t block = type_traits(t).block_elems;
  if (cols % block != 0 || cols % type_traits(dot_activation_type(t)).block_elems != 0) {
    throw std::invalid_argument(std::string("expert FFN: ") + what + " row length " + std::to_string(cols) + " is not a multiple of " +
                                std::string(type_name(t)) + "'s block");
  }
}

// reference::silu's expression (common/reference/ops.h), so the k-quant paths stay bitwise.
inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// Activation rounding of the production expert path: llama.cpp's x86 rule (127/amax, ties to
// even, for q8_0; q8_K is the reference rule up to the sign of a zero scale), not ggml's
// reference quantize_row. Decided because (1) the reference executor and the process group's
// reference::swiglu_expert quantize with it (common/reference/matmul.cpp: on qwen3moe Q8_0 the
// worst logit gap to llama.cpp drops from 1.9e-2 to 2.3e-7 of max |logit| with it), so the
// worker switching to this path keeps the group bitwise equal to the reference for k-quant
// experts and within summation order for Q8_0/MXFP4; (2) neither rule is more accurate (both
// round to the nearest code; they differ by one ulp of the scale and on exact ties); (3) it
// costs the same: it has an AVX-512 version bit-identical to its scalar one, and activations
// are quantized once per token and layer (~1 us at hidden 2048).
inline void quantize_act(TensorType t, const float* x, void* dst, int64_t n) { quantize_activation_row_llama_x86(t, x, dst, n); }

// A job's wait for an earlier job of the same list (claimed before it by a running thread, so
// the wait is short: at most the tail of one gate/up chunk or of the intermediate's SwiGLU).
// On an oversubscribed machine the job waited for may be descheduled: every 256 polls (some
// 10-40 us) the waiter offers its CPU to whatever else is runnable there.
template <typename T>
inline void spin_until_at_least(const std::atomic<T>& a, T target) {
  for (unsigned i = 1; a.load(std::memory_order_acquire) < target; ++i) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
    if (i % 256 == 0) sched_yield();
  }
}

}  // namespace

std::atomic<bool> g_balanced{FfnSliceOptions{}.balanced};
std::atomic<bool> g_wait_prefetch{FfnSliceOptions{}.wait_prefetch};
std::atomic<int> g_slice_split{FfnSliceOptions{}.split};
std::atomic<bool> g_gate_up_first{FfnSliceOptions{}.gate_up_first};
std::atomic<bool> g_balanced_accumulating{FfnSliceOptions{}.accumulating};
std::atomic<bool> g_per_expert_slices{FfnSliceOptions{}.per_expert};

void set_ffn_slice_options(FfnSliceOptions o) {
  g_balanced.store(o.balanced, std::memory_order_relaxed);
  g_wait_prefetch.store(o.wait_prefetch, std::memory_order_relaxed);
  g_slice_split.store(std::clamp(o.split, 1, kMaxSliceSplit), std::memory_order_relaxed);
  g_gate_up_first.store(o.gate_up_first, std::memory_order_relaxed);
  g_balanced_accumulating.store(o.accumulating, std::memory_order_relaxed);
  g_per_expert_slices.store(o.per_expert, std::memory_order_relaxed);
}
FfnSliceOptions ffn_slice_options() {
  return {g_balanced.load(std::memory_order_relaxed), g_wait_prefetch.load(std::memory_order_relaxed), g_slice_split.load(std::memory_order_relaxed),
          g_gate_up_first.load(std::memory_order_relaxed), g_balanced_accumulating.load(std::memory_order_relaxed),
          g_per_expert_slices.load(std::memory_order_relaxed)};
}

std::atomic<int> g_stream_runs{FfnStreamOptions{}.runs};
std::atomic<int> g_gate_up_together{FfnStreamOptions{}.gate_up_together};
std::atomic<bool> g_down_early{FfnStreamOptions{}.down_early};
std::atomic<size_t> g_down_early_bytes{FfnStreamOptions{}.down_early_bytes};
std::atomic<int> g_down_runs{FfnStreamOptions{}.down_runs};

void set_ffn_stream_options(FfnStreamOptions o) {
  g_stream_runs.store(std::clamp(o.runs, 1, kMaxStreamRuns), std::memory_order_relaxed);
  g_gate_up_together.store(std::clamp(o.gate_up_together, 0, 2), std::memory_order_relaxed);
  g_down_early.store(o.down_early, std::memory_order_relaxed);
  g_down_early_bytes.store(o.down_early_bytes, std::memory_order_relaxed);
  g_down_runs.store(std::clamp(o.down_runs, 0, kMaxStreamRuns), std::memory_order_relaxed);
}
FfnStreamOptions ffn_stream_options() {
  return {g_stream_runs.load(std::memory_order_relaxed), g_gate_up_together.load(std::memory_order_relaxed), g_down_early.load(std::memory_order_relaxed),
          g_down_early_bytes.load(std::memory_order_relaxed), g_down_runs.load(std::memory_order_relaxed)};
}

std::atomic<FfnPhaseTrace*> g_phase_trace{nullptr};
void set_ffn_phase_trace(FfnPhaseTrace* trace) { g_phase_trace.store(trace, std::memory_order_relaxed); }

namespace {
int64_t trace_now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
}  // namespace

void set_ffn_schedule(FfnSchedule s) { g_schedule.store(s, std::memory_order_relaxed); }
FfnSchedule ffn_schedule() { return g_schedule.load(std::memory_order_relaxed); }

void set_ffn_job_rows(FfnJobRows rows) {
  g_gate_up_rows.store(std::max<int64_t>(1, rows.gate_up), std::memory_order_relaxed);
  g_down_rows.store(std::max<int64_t>(1, rows.down), std::memory_order_relaxed);
}

FfnJobRows ffn_job_rows() { return {g_gate_up_rows.load(std::memory_order_relaxed), g_down_rows.load(std::memory_order_relaxed)}; }

template <typename T>
void MoeFfn::grow_atomics(std::unique_ptr<std::atomic<T>[]>& a, size_t& capacity, size_t n) {
  if (capacity >= n) return;
  a = std::make_unique<std::atomic<T>[]>(n);
  capacity = n;
}

void MoeFfn::run(std::span<const ExpertAssignment> experts, const float* x, float* y_accum, int n_tokens, int64_t hidden,
                 ThreadPool& pool) {
  if (experts.empty() || n_tokens <= 0) return;
  x_rows_.resize(static_cast<size_t>(n_tokens));
  for (int t = 0; t < n_tokens; ++t) x_rows_[static_cast<size_t>(t)] = x + static_cast<int64_t>(t) * hidden;
  out_.assign(experts.size(), nullptr);
  run_layer(experts, y_accum, n_tokens, hidden, pool);
}

void MoeFfn::run_layer(std::span<const ExpertAssignment> experts, float* y_accum, int n_tokens, int64_t hidden, ThreadPool& pool) {
  FfnPhaseTrace* const trace = prefetch_ ? nullptr : g_phase_trace.load(std::memory_order_relaxed);
  if (trace) {
    trace->workers.assign(static_cast<size_t>(pool.size()), FfnWorkerPhases{});
    trace->call_start_ns = trace_now_ns();
  }
  const FfnJobRows job_rows = ffn_job_rows();
  const int64_t gate_up_rows = job_rows.gate_up, down_rows = job_rows.down;
  // Validate and plan: which activation types, and where each expert's scratch goes.
  bool need_act[kNumActTypes] = {};
  plan_.resize(experts.size());
  active_.clear();
  row_used_.assign(static_cast<size_t>(n_tokens), 0);
  int64_t h_total = 0, q_total = 0, y_total = 0;
  int n_accumulating = 0;
  for (size_t e = 0; e < experts.size(); ++e) {
    const ExpertAssignment& a = experts[e];
    if (!a.weights || (a.n_tok > 0 && (!a.tokens || !a.route_weight))) {
      throw std::invalid_argument("expert FFN: assignment " + std::to_string(e) + " lacks weights, tokens or route weights");
    }
    const ExpertWeights& w = *a.weights;
    if (w.hidden != hidden || w.ffn <= 0 || !w.gate || !w.up || !w.down) {
      throw std::invalid_argument("expert FFN: expert " + std::to_string(e) + " has hidden " + std::to_string(w.hidden) + ", ffn " +
                                  std::to_string(w.ffn) + " (layer hidden " + std::to_string(hidden) + ") or missing matrices");
    }
    check_weight(w.gate_type, hidden, "gate");
    check_weight(w.up_type, hidden, "up");
    check_weight(w.down_type, w.ffn, "down");
    for (int i = 0; i < a.n_tok; ++i) {
      if (a.tokens[i] < 0 || a.tokens[i] >= n_tokens) {
        throw std::invalid_argument("expert FFN: expert " + std::to_string(e) + " token " + std::to_string(a.tokens[i]) + " is outside 0.." +
                                    std::to_string(n_tokens - 1));
      }
      row_used_[static_cast<size_t>(a.tokens[i])] = 1;
    }
    if (a.n_tok > 0 && !out_[e] && !y_accum) throw std::invalid_argument("expert FFN: expert " + std::to_string(e) + " has no output");
    need_act[act_index(dot_activation_type(w.gate_type))] = true;
    need_act[act_index(dot_activation_type(w.up_type))] = true;
    Plan& p = plan_[e];
    p.h_offset = h_total;
    p.q_offset = q_total;
    p.y_offset = y_total;
    p.q_row_bytes = row_bytes(dot_activation_type(w.down_type), w.ffn);
    h_total += static_cast<int64_t>(a.n_tok) * w.ffn;
    q_total += static_cast<int64_t>(a.n_tok) * static_cast<int64_t>(p.q_row_bytes);
    if (a.n_tok > 0) {
      active_.push_back(static_cast<int32_t>(e));
      if (!out_[e]) {
        y_total += static_cast<int64_t>(a.n_tok) * hidden;
        ++n_accumulating;
      }
    }
  }
  if (active_.empty()) return;
  size_t act_offset[kNumActTypes] = {}, act_row[kNumActTypes] = {}, xq_total = 0;
  for (int i = 0; i < kNumActTypes; ++i) {
    if (!need_act[i]) continue;
    act_offset[i] = xq_total;
    act_row[i] = row_bytes(kActTypes[i], hidden);
    xq_total += act_row[i] * static_cast<size_t>(n_tokens);
  }
  if (xq_.size() < xq_total) xq_.resize(xq_total);
  if (gate_.size() < static_cast<size_t>(h_total)) {
    gate_.resize(static_cast<size_t>(h_total));
    up_.resize(static_cast<size_t>(h_total));
  }
  if (hq_.size() < static_cast<size_t>(q_total)) hq_.resize(static_cast<size_t>(q_total));
  if (part_.size() < static_cast<size_t>(y_total)) part_.resize(static_cast<size_t>(y_total));
  used_rows_.clear();
  for (int t = 0; t < n_tokens; ++t) {
    if (row_used_[static_cast<size_t>(t)]) used_rows_.push_back(t);
  }

  // The rows' quantization, once per activation type. A few rows are quantized right here
  // (about 1 us each at hidden 2048, less than a job's hand-over); more go first in the list.
  int act_list[kNumActTypes], n_act = 0;
  for (int i = 0; i < kNumActTypes; ++i) {
    if (need_act[i]) act_list[n_act++] = i;
  }
  auto quantize_x = [&](int64_t job) {
    const int ai = act_list[job % n_act];
    const auto t = static_cast<size_t>(used_rows_[static_cast<size_t>(job / n_act)]);
    quantize_act(kActTypes[ai], x_rows_[t], xq_.data() + act_offset[ai] + t * act_row[ai], hidden);
  };
  const int64_t x_jobs_all = static_cast<int64_t>(used_rows_.size()) * n_act;
  const bool sliced = ffn_schedule() == FfnSchedule::Sliced && pool.size() > 1;
  // In the list only on the shared schedule (a slice's gate/up jobs would wait for quantization
  // jobs in other slices); the sliced one quantizes in a list of its own first.
  const FfnSliceOptions slice_opt = ffn_slice_options();
  const FfnStreamOptions stream_opt = ffn_stream_options();
  const bool runs_l2 = matvec_prefetch().runs_l2_bytes > 0;  // its L2 streams exist on the runs path only
  const bool balanced = sliced && slice_opt.balanced && (n_accumulating == 0 || slice_opt.accumulating);
  // Balanced slices with the caller joining: the caller quantizes the few rows as the first jobs
  // of its own slice, and the other threads' first gate/up jobs wait for them there (pulling
  // their weight rows into L2 meanwhile with wait_prefetch), instead of the whole pool waiting
  // for the caller's ~1 us per row (hidden 2048) before the list starts.
  const bool x_in_slice0 = balanced && pool.caller_joins() && x_jobs_all <= kInlineQuantizeJobs;
  const int64_t x_jobs = x_in_slice0 ? x_jobs_all : x_jobs_all <= kInlineQuantizeJobs || sliced ? 0 : x_jobs_all;
  if (prefetch_ && !balanced) return;  // prefetch_experts: only the balanced lists say which thread reads which rows
  if (x_in_slice0 || prefetch_) {
    // quantized in the list
  } else if (x_jobs_all <= kInlineQuantizeJobs) {
    for (int64_t j = 0; j < x_jobs_all; ++j) quantize_x(j);
  } else if (sliced) {
    pool.run(x_jobs_all, [&](int64_t j, int) { quantize_x(j); });
  }

  const int64_t down_chunks = (hidden + down_rows - 1) / down_rows;
  grow_atomics(remaining_, expert_capacity_, experts.size());
  grow_atomics(ready_, ready_capacity_, experts.size());
  grow_atomics(chunk_left_, chunk_capacity_, static_cast<size_t>(down_chunks));
  for (int32_t e : active_) {
    remaining_[e].store(0, std::memory_order_relaxed);
    ready_[e].store(0, std::memory_order_relaxed);
  }
  // Down spans of accumulating experts per chunk: one per expert with the fixed chunks; the
  // balanced list's spans (set below) may cover several chunks or part of one.
  if (!balanced) {
    for (int64_t c = 0; c < down_chunks; ++c) chunk_left_[c].store(n_accumulating, std::memory_order_relaxed);
  }
  x_done_.store(0, std::memory_order_relaxed);

  // The job list (after the x_jobs quantization jobs): spans_. Fixed chunks: every expert's
  // gate/up rows in FfnJobRows::gate_up chunks, then every expert's down rows in chunks of
  // FfnJobRows::down (chunk c of each expert covers the same rows: the accumulating form adds
  // them up per chunk). Balanced (sliced; accumulating experts too with FfnSliceOptions::accumulating):
  // each thread's equal share.
  const int n_slices = pool.size();
  int64_t gate_up_spans = 0;
  // A balanced list depends only on what plan_key_ holds: a decode loop calling with the same
  // expert slots, row counts and pool reuses the last one instead of building ~120 spans (15
  // threads x 2 phases x split 4) again. On the H200 host the call's setup grew with the span
  // count: 1.3 / 2.3 / 3.8 us at split 1 / 4 / 8 (1 expert, 15 threads; cpu1's run C traces);
  // reused, 2.3-2.7 -> 0.9-1.2 us at 1 expert (session 9 runs B and C traces), Q4_K p50 at 1 expert
  // 40.3 -> 37.5 us (run C, 3 rounds).
  bool reuse = false;
  if (balanced) {
    plan_key_next_.clear();
    for (const int64_t v : {int64_t{n_slices}, x_jobs, int64_t{slice_opt.split}, int64_t{slice_opt.gate_up_first}, int64_t{stream_opt.down_early}, hidden,
                            int64_t{slice_opt.per_expert}})
      plan_key_next_.push_back(v);
    for (int32_t e : active_) {
      plan_key_next_.push_back(e);
      plan_key_next_.push_back(experts[static_cast<size_t>(e)].weights->ffn);
      plan_key_next_.push_back(out_[static_cast<size_t>(e)] ? 1 : 0);  // accumulating experts: the chunk counts
    }
    if (n_accumulating > 0) plan_key_next_.push_back(down_rows);
    reuse = plan_key_next_ == plan_key_ && !spans_.empty();
    if (!reuse) plan_key_.assign(plan_key_next_.begin(), plan_key_next_.end());
  } else {
    plan_key_.clear();
  }
  if (!reuse) spans_.clear();
  if (reuse) {
    // spans_ and slice_end_ as the last call left them.
  } else if (!balanced) {
    for (int32_t e : active_) {
      const int64_t ffn = experts[static_cast<size_t>(e)].weights->ffn;
      for (int64_t r0 = 0; r0 < ffn; r0 += gate_up_rows) spans_.push_back({e, 0, r0, std::min(r0 + gate_up_rows, ffn), -1});
    }
    gate_up_spans = static_cast<int64_t>(spans_.size());
    for (int32_t e : active_) {
      for (int64_t r0 = 0; r0 < hidden; r0 += down_rows) spans_.push_back({e, 1, r0, std::min(r0 + down_rows, hidden), -1});
    }
    // Hints (sliced only, as before): the next job of the same phase in list order.
    if (sliced) {
      for (size_t i = 0; i + 1 < spans_.size(); ++i) {
        if (spans_[i].down == spans_[i + 1].down) spans_[i].next = static_cast<int64_t>(i + 1);
      }
    }
  } else {
    // Runs of 4 rows (Q8_0 / MXFP4 tiles start at a job's first row: boundaries at multiples of
    // 4 keep every row in the same tile position as the fixed chunks, so results are bitwise the
    // same). Thread w's share of the rows of a phase is units [U w / T, U (w + 1) / T), cut where
    // an expert ends.
    constexpr int64_t kUnit = 4;
    slice_end_.resize(static_cast<size_t>(n_slices));
    auto units_of = [&](int64_t rows) { return (rows + kUnit - 1) / kUnit; };
    int64_t gu_units = 0, dn_units = 0;
    for (int32_t e : active_) {
      gu_units += units_of(experts[static_cast<size_t>(e)].weights->ffn);
      dn_units += units_of(hidden);
    }
    // Emits the spans of units [u0, u1) of one phase (expert by expert in active_ order).
    auto emit = [&](int down, int64_t u0, int64_t u1) {
      int64_t base = 0;
      for (int32_t e : active_) {
        const int64_t rows = down ? hidden : experts[static_cast<size_t>(e)].weights->ffn;
        const int64_t n = units_of(rows);
        const int64_t a = std::max(u0, base), b = std::min(u1, base + n);
        if (a < b) spans_.push_back({e, down, (a - base) * kUnit, std::min((b - base) * kUnit, rows), -1});
        base += n;
        if (base >= u1) break;
      }
    };
    // Each share cut into `split` jobs (FfnSliceOptions::split).
    const int64_t split = slice_opt.split;
    auto emit_share = [&](int down, int64_t units, int w) {
      if (slice_opt.per_expert) {
        const int64_t pieces = std::max<int64_t>(1, split / static_cast<int64_t>(active_.size()));
        for (int32_t e : active_) {
          const int64_t rows = down ? hidden : experts[static_cast<size_t>(e)].weights->ffn;
          const int64_t n = units_of(rows), u0 = n * w / n_slices, u1 = n * (w + 1) / n_slices;
          for (int64_t k = 0; k < pieces; ++k) {
            const int64_t a = u0 + (u1 - u0) * k / pieces, b = u0 + (u1 - u0) * (k + 1) / pieces;
            if (a < b) spans_.push_back({e, down, a * kUnit, std::min(b * kUnit, rows), -1});
          }
        }
        return;
      }
      const int64_t u0 = units * w / n_slices, u1 = units * (w + 1) / n_slices;
      for (int64_t k = 0; k < split; ++k) emit(down, u0 + (u1 - u0) * k / split, u0 + (u1 - u0) * (k + 1) / split);
    };
    if (!slice_opt.gate_up_first) {
      for (int w = 0; w < n_slices; ++w) {
        const size_t first = spans_.size();
        emit_share(0, gu_units, w);
        emit_share(1, dn_units, w);
        for (size_t i = first; i + 1 < spans_.size(); ++i) spans_[i].next = static_cast<int64_t>(i + 1);
        slice_end_[static_cast<size_t>(w)] = x_jobs + static_cast<int64_t>(spans_.size());  // slice 0 starts with the x jobs
      }
    } else {
      // Two phases (ThreadPool::run_sliced_phases): every thread's gate/up share, then every
      // thread's down share; a thread's last gate/up job hints at its first down job.
      slice_end_.resize(2 * static_cast<size_t>(n_slices));
      std::vector<size_t>& gu_last = gu_last_;
      gu_last.assign(static_cast<size_t>(n_slices), SIZE_MAX);
      for (int p = 0; p < 2; ++p) {
        for (int w = 0; w < n_slices; ++w) {
          const size_t first = spans_.size();
          emit_share(p, p ? dn_units : gu_units, w);
          for (size_t i = first; i + 1 < spans_.size(); ++i) spans_[i].next = static_cast<int64_t>(i + 1);
          if (p == 0 && spans_.size() > first) gu_last[static_cast<size_t>(w)] = spans_.size() - 1;
          if (p == 1 && spans_.size() > first && gu_last[static_cast<size_t>(w)] != SIZE_MAX) {
            spans_[gu_last[static_cast<size_t>(w)]].next = static_cast<int64_t>(first);
          }
          slice_end_[static_cast<size_t>(p * n_slices + w)] = x_jobs + static_cast<int64_t>(spans_.size());
        }
      }
      if (stream_opt.down_early) {
        // Gate/up job k of G in slice w pulls the slice's down jobs [D k / G, D (k + 1) / G).
        auto first_of = [&](int idx) { return idx == 0 ? int64_t{0} : slice_end_[static_cast<size_t>(idx - 1)] - x_jobs; };
        for (int w = 0; w < n_slices; ++w) {
          const int64_t gf = first_of(w), ge = slice_end_[static_cast<size_t>(w)] - x_jobs;
          const int64_t df = first_of(n_slices + w), de = slice_end_[static_cast<size_t>(n_slices + w)] - x_jobs;
          const int64_t g = ge - gf, d = de - df;
          for (int64_t k = 0; k < g; ++k) {
            Span& sp = spans_[static_cast<size_t>(gf + k)];
            sp.slice = w;
            sp.bg0 = df + d * k / g;
            sp.bg1 = df + d * (k + 1) / g;
          }
        }
      }
    }
  }
  if (balanced && n_accumulating > 0) {
    // Accumulating experts on the balanced list: each chunk of FfnJobRows::down output rows is
    // summed into y_accum by the down span that finishes the chunk's last covering span.
    if (!reuse) {
      chunk_spans_.assign(static_cast<size_t>(down_chunks), 0);
      for (const Span& sp : spans_) {
        if (!sp.down || out_[static_cast<size_t>(sp.expert)]) continue;
        for (int64_t c = sp.r0 / down_rows; c <= (sp.r1 - 1) / down_rows; ++c) ++chunk_spans_[static_cast<size_t>(c)];
      }
    }
    for (int64_t c = 0; c < down_chunks; ++c) chunk_left_[c].store(chunk_spans_[static_cast<size_t>(c)], std::memory_order_relaxed);
  }
  // Gate/up jobs per expert (no other thread runs yet: plain loads and stores, no locked adds).
  for (const Span& sp : spans_) {
    if (!sp.down) remaining_[sp.expert].store(remaining_[sp.expert].load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }

  // While `ready()` is false, pulls `bytes` from `p` toward L2 (prefetcht1), 8 lines between two
  // looks, so the end of the wait is seen within a few hundred ns: the thread's memory traffic
  // would otherwise idle while it waits for another job.
  auto prefetch_while_waiting = [&](auto&& ready, const uint8_t* p, size_t bytes) {
    if (!slice_opt.wait_prefetch) return;
    for (size_t off = 0; off < bytes && !ready(); off += 512) {
#if defined(__x86_64__) || defined(__i386__)
      for (size_t l = off; l < std::min(bytes, off + 512); l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + l), _MM_HINT_T1);
#endif
    }
  };
  // Where job i's first matrix rows start, and how many bytes (the next-call hint).
  auto span_weights = [&](const Span& sp, size_t& bytes) -> const uint8_t* {
    const ExpertWeights& w = *experts[static_cast<size_t>(sp.expert)].weights;
    const TensorType t = sp.down ? w.down_type : w.gate_type;
    const size_t rb = row_bytes(t, sp.down ? w.ffn : hidden);
    bytes = static_cast<size_t>(sp.r1 - sp.r0) * rb;
    return static_cast<const uint8_t*>(sp.down ? w.down : w.gate) + static_cast<size_t>(sp.r0) * rb;
  };

  const int64_t n_jobs = x_jobs + static_cast<int64_t>(spans_.size());
  auto run_job = [&](int64_t job, int worker, FfnWorkerPhases* ph) {
    if (job < x_jobs) {
      quantize_x(job);
      x_done_.fetch_add(1, std::memory_order_release);
      return;
    }
    const Span& sp = spans_[static_cast<size_t>(job - x_jobs)];
    const auto e = static_cast<size_t>(sp.expert);
    const ExpertAssignment& a = experts[e];
    const ExpertWeights& w = *a.weights;
    const Plan& p = plan_[e];
    const int64_t r0 = sp.r0, r1 = sp.r1;
    const uint8_t* after = nullptr;
    size_t after_bytes = 0;
    if (sp.next >= 0) after = span_weights(spans_[static_cast<size_t>(sp.next)], after_bytes);
    if (!sp.down) {
      // Gate and up rows [r0, r1) of one expert, all of that expert's tokens.
      if (x_jobs) {
        if (x_done_.load(std::memory_order_acquire) < x_jobs) {
          size_t bytes = 0;
          const uint8_t* wp = span_weights(sp, bytes);
          prefetch_while_waiting([&] { return x_done_.load(std::memory_order_acquire) >= x_jobs; }, wp, bytes);
        }
        spin_until_at_least(x_done_, x_jobs);
      }
      const int gi = act_index(dot_activation_type(w.gate_type)), ui = act_index(dot_activation_type(w.up_type));
      // Next-call prefetch hints: the gate rows lead into the up rows of the same job, the up
      // rows into the thread's next job.
      // FfnStreamOptions: this slice's down rows toward L2 (only on the thread that owns the
      // slice: a helper's L2 is not where they will be read).
      PrefetchRegion early[kMaxEarlyRegions];
      int n_early = 0;
      if (stream_opt.down_early && sp.slice == worker) {
        for (int64_t d = sp.bg0; d < sp.bg1 && n_early < kMaxEarlyRegions; ++d) {
          size_t bytes = 0;
          const uint8_t* dp = span_weights(spans_[static_cast<size_t>(d)], bytes);
          if (stream_opt.down_early_bytes) bytes = std::min(bytes, stream_opt.down_early_bytes);
          early[n_early++] = {dp, bytes};
        }
      }
      // FfnStreamOptions::gate_up_together (2: Q4_K only, the type it was measured faster for).
      const bool together = w.gate_type == w.up_type &&
                            (stream_opt.gate_up_together == 1 || (stream_opt.gate_up_together == 2 && w.gate_type == TensorType::Q4_K));
      if (stream_opt.runs > 1 || together || n_early > 0 || runs_l2) {
        MatvecRun runs[2 * kMaxStreamRuns];
        float* const gy = gate_.data() + p.h_offset;
        float* const uy = up_.data() + p.h_offset;
        if (together) {
          // gate run j, then up run j, side by side (gi == ui: one activation type).
          MatvecRun g[kMaxStreamRuns], u[kMaxStreamRuns];
          const int ng = cut_runs(w.gate, r0, r1, gy, stream_opt.runs, g);
          cut_runs(w.up, r0, r1, uy, stream_opt.runs, u);
          for (int j = 0; j < ng; ++j) {
            runs[2 * j] = g[j];
            runs[2 * j + 1] = u[j];
          }
          matvec_tokens_runs(w.gate_type, hidden, runs, 2 * ng, xq_.data() + act_offset[gi], act_row[gi], a.tokens, a.n_tok, w.ffn,
                             {early, n_early, after, after_bytes});
        } else {
          // The gate rows' next-call hint: the up rows of this job; the up rows': the next job.
          // The early down lines: the first half over the gate rows, the rest over the up rows.
          PrefetchRegion second[kMaxEarlyRegions];
          int n_second = 0;
          split_regions(early, n_early, second, n_second);
          const size_t up_rb = row_bytes(w.up_type, hidden);
          int n = cut_runs(w.gate, r0, r1, gy, stream_opt.runs, runs);
          matvec_tokens_runs(w.gate_type, hidden, runs, n, xq_.data() + act_offset[gi], act_row[gi], a.tokens, a.n_tok, w.ffn,
                             {early, n_early, static_cast<const uint8_t*>(w.up) + static_cast<size_t>(r0) * up_rb, static_cast<size_t>(r1 - r0) * up_rb});
          n = cut_runs(w.up, r0, r1, uy, stream_opt.runs, runs);
          matvec_tokens_runs(w.up_type, hidden, runs, n, xq_.data() + act_offset[ui], act_row[ui], a.tokens, a.n_tok, w.ffn,
                             {second, n_second, after, after_bytes});
        }
      } else {
        const size_t up_rb = row_bytes(w.up_type, hidden);
        const uint8_t* up_start = static_cast<const uint8_t*>(w.up) + static_cast<size_t>(r0) * up_rb;
        matvec_tokens(w.gate_type, hidden, w.gate, r0, r1, xq_.data() + act_offset[gi], act_row[gi], a.tokens, a.n_tok,
                      gate_.data() + p.h_offset, w.ffn, sliced ? up_start : nullptr, static_cast<size_t>(r1 - r0) * up_rb);
        matvec_tokens(w.up_type, hidden, w.up, r0, r1, xq_.data() + act_offset[ui], act_row[ui], a.tokens, a.n_tok,
                      up_.data() + p.h_offset, w.ffn, after, after_bytes);
      }
      // SwiGLU of this job's rows, in place into gate_ (elementwise: the same floats whichever
      // job computes them). It used to run over the whole expert in the job finishing its last
      // chunk, while the expert's down jobs on other threads waited: ffn scalar exps (768 take
      // 2.6 us on a Zen 5 core, ~1.5% of a 1-token layer on 16 Xeon cores) on the critical path
      // of every expert; spread over the chunks they run in parallel.
      for (int i = 0; i < a.n_tok; ++i) {
        float* h = gate_.data() + p.h_offset + static_cast<int64_t>(i) * w.ffn;
        const float* u = up_.data() + p.h_offset + static_cast<int64_t>(i) * w.ffn;
        for (int64_t j = r0; j < r1; ++j) h[j] = silu(h[j]) * u[j];
      }
      // The job finishing an expert's last chunk (acq_rel: the other chunks' rows are visible
      // to it) quantizes the intermediate.
      if (ph) ph->rows_done_ns = trace_now_ns();
      if (remaining_[e].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
      const TensorType qt = dot_activation_type(w.down_type);
      for (int i = 0; i < a.n_tok; ++i) {
        const float* h = gate_.data() + p.h_offset + static_cast<int64_t>(i) * w.ffn;
        quantize_act(qt, h, hq_.data() + p.q_offset + static_cast<size_t>(i) * p.q_row_bytes, w.ffn);
      }
      ready_[e].store(1, std::memory_order_release);
      if (ph) ph->ready_set_ns = trace_now_ns();
      return;
    }
    // Down: output rows [r0, r1) of one expert, through matvec_tokens (register-blocked tiles,
    // prefetch). Experts are taken in list order, so the first experts' down work runs while
    // the last ones' gate/up chunks finish.
    if (ready_[e].load(std::memory_order_acquire) == 0) {
      const int64_t wait_start = ph ? trace_now_ns() : 0;
      size_t bytes = 0;
      const uint8_t* wp = span_weights(sp, bytes);
      prefetch_while_waiting([&] { return ready_[e].load(std::memory_order_acquire) != 0; }, wp, bytes);
      spin_until_at_least(ready_[e], 1);
      if (ph) ph->down_wait_ns += trace_now_ns() - wait_start;
    }
    // Down rows through matvec_tokens, or as FfnStreamOptions::runs runs side by side.
    auto down_rows_into = [&](float* y) {
      const int k = stream_opt.down_runs > 0 ? stream_opt.down_runs : stream_opt.runs;
      if (k > 1 || runs_l2) {
        MatvecRun runs[kMaxStreamRuns];
        const int n = cut_runs(w.down, r0, r1, y, k, runs);
        matvec_tokens_runs(w.down_type, w.ffn, runs, n, hq_.data() + p.q_offset, p.q_row_bytes, nullptr, a.n_tok, hidden,
                           {nullptr, 0, after, after_bytes});
        return;
      }
      matvec_tokens(w.down_type, w.ffn, w.down, r0, r1, hq_.data() + p.q_offset, p.q_row_bytes, nullptr, a.n_tok, y, hidden, after, after_bytes);
    };
    if (float* out = out_[e]) {
      // This expert's own output rows: y = 0 + w * FFN, the accumulate below on a zeroed y.
      down_rows_into(out);
      for (int i = 0; i < a.n_tok; ++i) {
        float* row = out + static_cast<int64_t>(i) * hidden;
        for (int64_t r = r0; r < r1; ++r) row[r] = 0.0f + a.route_weight[i] * row[r];
      }
      return;
    }
    down_rows_into(part_.data() + p.y_offset);
    // Each chunk of FfnJobRows::down rows this span covers (fixed chunks: exactly one, the span).
    for (int64_t c = r0 / down_rows; c <= (r1 - 1) / down_rows; ++c) {
      if (chunk_left_[c].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
      // The chunk's last span: add every expert's partial into y_accum in (expert, row, token)
      // order, the order of the two-barrier version (each y element's sum in expert order,
      // whichever spans wrote the partials).
      const int64_t c0 = c * down_rows, c1 = std::min(c0 + down_rows, hidden);
      for (int32_t ex : active_) {
        if (out_[static_cast<size_t>(ex)]) continue;
        const ExpertAssignment& ax = experts[static_cast<size_t>(ex)];
        const float* part = part_.data() + plan_[static_cast<size_t>(ex)].y_offset;
        for (int64_t r = c0; r < c1; ++r) {
          for (int i = 0; i < ax.n_tok; ++i) {
            y_accum[static_cast<int64_t>(ax.tokens[i]) * hidden + r] += ax.route_weight[i] * part[static_cast<int64_t>(i) * hidden + r];
          }
        }
      }
    }
  };
  // Every job through here: with a trace, its worker's phase times around it.
  auto job_on = [&](int64_t job, int worker) {
    if (!trace) return run_job(job, worker, nullptr);
    FfnWorkerPhases& ph = trace->workers[static_cast<size_t>(worker)];
    const int64_t t0 = trace_now_ns();
    if (ph.jobs++ == 0) ph.first_start_ns = t0;
    run_job(job, worker, &ph);
    ph.last_end_ns = trace_now_ns();
    if (job >= x_jobs && !spans_[static_cast<size_t>(job - x_jobs)].down) ph.gate_up_end_ns = ph.last_end_ns;
  };
  struct EndTrace {  // the call's end, on every return below
    FfnPhaseTrace* t;
    ~EndTrace() {
      if (t) t->call_end_ns = trace_now_ns();
    }
  } end_trace{trace};
  if (prefetch_) {
    // prefetch_experts: thread w pulls the rows of its own slices (both phases, in list order)
    // toward its L2, polling the stop callback every 1 KB; a helper taking another slice's job
    // skips it (its L2 is not where the rows are read).
    const int n_phases = slice_opt.gate_up_first ? 2 : 1;
    prefetch_ends_.resize(static_cast<size_t>(n_slices));
    for (int w = 0; w < n_slices; ++w) prefetch_ends_[static_cast<size_t>(w)] = w + 1;
    const Prefetch pf = *prefetch_;
    pool.run_sliced(prefetch_ends_.data(), [&](int64_t i, int worker) {
      if (i != worker) return;
      auto pull = [&](const uint8_t* p, size_t bytes) {
        for (size_t off = 0; off < bytes; off += 64) {
          if ((off & 1023) == 0 && pf.stop && pf.stop(pf.ctx)) {
            prefetch_cut_.store(true, std::memory_order_relaxed);
            return false;
          }
#if defined(__x86_64__) || defined(__i386__)
          _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T1);
#endif
        }
        return true;
      };
      for (int p = 0; p < n_phases; ++p) {
        const int idx = p * n_slices + worker;
        const int64_t first = idx == 0 ? 0 : slice_end_[static_cast<size_t>(idx - 1)] - x_jobs, end = slice_end_[static_cast<size_t>(idx)] - x_jobs;
        for (int64_t k = std::max<int64_t>(first, 0); k < end; ++k) {
          const Span& sp = spans_[static_cast<size_t>(k)];
          size_t bytes = 0;
          const uint8_t* wp = span_weights(sp, bytes);
          if (!pull(wp, bytes)) return;
          if (!sp.down) {
            const ExpertWeights& w = *experts[static_cast<size_t>(sp.expert)].weights;
            const size_t rb = row_bytes(w.up_type, hidden);
            if (!pull(static_cast<const uint8_t*>(w.up) + static_cast<size_t>(sp.r0) * rb, static_cast<size_t>(sp.r1 - sp.r0) * rb)) return;
          }
        }
      }
    });
    return;
  }
  if (trace) trace->list_start_ns = trace_now_ns();
  if (!sliced) {
    pool.run(n_jobs, [&](int64_t job, int w) { job_on(job, w); });
    return;
  }
  if (balanced) {
    // The x jobs (if any) and then spans_ are already in slice order. Two phases: a down job
    // waits only for gate/up jobs, all in the first phase, which a thread leaves only once
    // every gate/up job has been claimed (and those wait only for the x jobs at the front of
    // slice 0, which never wait): no deadlock.
    pool.run_sliced_phases(slice_end_.data(), slice_opt.gate_up_first ? 2 : 1, [&](int64_t i, int w) { job_on(i, w); });
    return;
  }
  // Slice w: the w-th share of the gate/up jobs, then the w-th share of the down jobs (both in
  // list order, so consecutive jobs of a slice are consecutive rows of one matrix). A slice's
  // down jobs wait only for gate/up jobs, which never wait and sit before every down job of
  // their own slice, so each waited-for job is either running or will be claimed by a thread
  // that is not waiting: no deadlock (the balanced list has the same shape). At one token the
  // experts are equal, so the gate/up shares end together and the down jobs find their experts
  // ready.
  const int64_t down_jobs = static_cast<int64_t>(spans_.size()) - gate_up_spans;
  order_.resize(static_cast<size_t>(n_jobs));
  slice_end_.resize(static_cast<size_t>(n_slices));
  size_t k = 0;
  for (int w = 0; w < n_slices; ++w) {
    for (int64_t j = gate_up_spans * w / n_slices; j < gate_up_spans * (w + 1) / n_slices; ++j) order_[k++] = j;
    for (int64_t j = down_jobs * w / n_slices; j < down_jobs * (w + 1) / n_slices; ++j) order_[k++] = gate_up_spans + j;
    slice_end_[static_cast<size_t>(w)] = static_cast<int64_t>(k);
  }
  pool.run_sliced(slice_end_.data(), [&](int64_t i, int w) { job_on(order_[static_cast<size_t>(i)], w); });
}

void MoeFfn::reserve(int max_tokens, int64_t hidden, int64_t ffn, int max_experts) {
  if (max_tokens <= 0 || hidden <= 0 || ffn <= 0 || max_experts <= 0) return;
  const auto tok = static_cast<size_t>(max_tokens), rows = tok * static_cast<size_t>(max_experts);
  size_t xq = 0, hq_row = 0;
  for (TensorType t : kActTypes) {
    xq += row_bytes(t, hidden) * tok;
    hq_row = std::max(hq_row, row_bytes(t, ffn));
  }
  if (xq_.size() < xq) xq_.resize(xq);
  if (gate_.size() < rows * static_cast<size_t>(ffn)) {
    gate_.resize(rows * static_cast<size_t>(ffn));
    up_.resize(rows * static_cast<size_t>(ffn));
  }
  // part_ (down partials of accumulating layers, run()) is left to the first such run: the
  // worker's forms write their own outputs and never use it.
  if (hq_.size() < rows * hq_row) hq_.resize(rows * hq_row);
  plan_.reserve(static_cast<size_t>(max_experts));
  plan_key_.reserve(8 + 3 * static_cast<size_t>(max_experts));
  plan_key_next_.reserve(8 + 3 * static_cast<size_t>(max_experts));
  {
    // The job table: fixed chunks, or balanced slices (per thread and phase at most `split`
    // jobs plus one per expert boundary, so 2 x split; 256 threads is far more than a pool has).
    const FfnJobRows jr = ffn_job_rows();
    const int64_t fixed = max_experts * ((ffn + jr.gate_up - 1) / jr.gate_up + (hidden + jr.down - 1) / jr.down);
    spans_.reserve(static_cast<size_t>(std::max<int64_t>(fixed, 4 * 256 * kMaxSliceSplit + 2 * max_experts)));
  }
  active_.reserve(static_cast<size_t>(max_experts));
  out_.reserve(static_cast<size_t>(max_experts));
  job_assign_.reserve(static_cast<size_t>(max_experts));
  x_rows_.reserve(rows);
  row_used_.reserve(rows);
  used_rows_.reserve(rows);
  grow_atomics(remaining_, expert_capacity_, static_cast<size_t>(max_experts));
  grow_atomics(ready_, ready_capacity_, static_cast<size_t>(max_experts));
  grow_atomics(chunk_left_, chunk_capacity_, static_cast<size_t>(hidden));  // enough for down jobs of 1 row
  if (iota_.size() < rows) {
    iota_.resize(rows);
    std::iota(iota_.begin(), iota_.end(), 0);
    ones_.assign(rows, 1.0f);
  }
}

void MoeFfn::run_expert(const ExpertWeights& w, const float* x, int m, float* y, ThreadPool& pool) {
  if (m <= 0) return;
  if (w.hidden <= 0 || w.ffn <= 0) {
    throw std::invalid_argument("expert FFN: run_expert on an expert with hidden " + std::to_string(w.hidden) + ", ffn " + std::to_string(w.ffn));
  }
  if (!x || !y) throw std::invalid_argument("expert FFN: run_expert without rows or output");
  reserve(m, w.hidden, w.ffn);
  x_rows_.resize(static_cast<size_t>(m));
  for (int t = 0; t < m; ++t) x_rows_[static_cast<size_t>(t)] = x + static_cast<int64_t>(t) * w.hidden;
  out_.assign(1, y);
  const ExpertAssignment a{&w, iota_.data(), ones_.data(), m};
  run_layer(std::span<const ExpertAssignment>(&a, 1), nullptr, m, w.hidden, pool);
}

bool MoeFfn::prefetch_experts(std::span<const ExpertWeights* const> experts, int m, ThreadPool& pool, bool (*stop)(const void* ctx),
                              const void* ctx) {
  if (experts.empty() || m <= 0) return true;
  int64_t hidden = 0, max_ffn = 0;
  for (size_t j = 0; j < experts.size(); ++j) {
    const ExpertWeights* w = experts[j];
    if (!w || w->hidden <= 0 || w->ffn <= 0 || (j > 0 && w->hidden != hidden)) {
      throw std::invalid_argument("expert FFN: prefetch_experts expert " + std::to_string(j) + " is missing or has another hidden size");
    }
    hidden = w->hidden;
    max_ffn = std::max(max_ffn, w->ffn);
  }
  const int n = static_cast<int>(experts.size());
  reserve(m, hidden, max_ffn, n);
  // The same layer as run_experts(jobs of m rows each) plans; rows and outputs are never touched.
  x_rows_.assign(static_cast<size_t>(m), nullptr);
  out_.clear();
  job_assign_.clear();
  for (const ExpertWeights* w : experts) {
    job_assign_.push_back({w, iota_.data(), ones_.data(), m});
    out_.push_back(&prefetch_sink_);
  }
  Prefetch pf{stop, ctx};
  prefetch_ = &pf;
  struct Reset {
    const Prefetch*& p;
    ~Reset() { p = nullptr; }
  } reset{prefetch_};
  prefetch_cut_.store(false, std::memory_order_relaxed);
  run_layer(job_assign_, nullptr, m, hidden, pool);
  return !prefetch_cut_.load(std::memory_order_relaxed);
}

namespace {

// Shared checks of the run_experts forms; returns the layer's hidden size and the largest ffn.
template <typename Job>
std::pair<int64_t, int64_t> check_jobs(std::span<const Job> jobs) {
  int64_t hidden = 0, max_ffn = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Job& job = jobs[j];
    const void* rows = nullptr;
    if constexpr (std::is_same_v<Job, MoeFfn::RowsJob>) rows = job.rows;
    else rows = job.x;
    if (!job.weights || job.m < 0 || (job.m > 0 && (!rows || !job.y))) {
      throw std::invalid_argument("expert FFN: run_experts job " + std::to_string(j) + " lacks weights, rows or output");
    }
    if (j == 0) hidden = job.weights->hidden;
    if (job.weights->hidden != hidden || hidden <= 0 || job.weights->ffn <= 0) {
      throw std::invalid_argument("expert FFN: run_experts job " + std::to_string(j) + " has hidden " + std::to_string(job.weights->hidden) +
                                  ", ffn " + std::to_string(job.weights->ffn) + " (first job's hidden " + std::to_string(hidden) + ")");
    }
    max_ffn = std::max(max_ffn, job.weights->ffn);
  }
  return {hidden, max_ffn};
}

}  // namespace

void MoeFfn::run_experts(std::span<const ExpertJob> jobs, ThreadPool& pool) {
  const auto [hidden, max_ffn] = check_jobs(jobs);
  int total = 0;
  for (const ExpertJob& job : jobs) total += job.m;
  if (total == 0) return;
  reserve(total, hidden, max_ffn, static_cast<int>(jobs.size()));
  // Token t of the layer is row t of the jobs' rows taken in order; each job's rows belong to
  // it alone, and its results go straight to its y.
  x_rows_.clear();
  out_.clear();
  job_assign_.clear();
  for (const ExpertJob& job : jobs) {
    const int first = static_cast<int>(x_rows_.size());
    for (int i = 0; i < job.m; ++i) x_rows_.push_back(job.x + static_cast<int64_t>(i) * hidden);
    job_assign_.push_back({job.weights, iota_.data() + first, ones_.data(), job.m});
    out_.push_back(job.y);
  }
  run_layer(job_assign_, nullptr, total, hidden, pool);
}

void MoeFfn::run_experts(std::span<const RowsJob> jobs, const float* x, int n_rows, ThreadPool& pool) {
  const auto [hidden, max_ffn] = check_jobs(jobs);
  int total = 0;
  for (const RowsJob& job : jobs) total += job.m;
  if (total == 0) return;
  if (!x || n_rows <= 0) throw std::invalid_argument("expert FFN: run_experts without activation rows");
  reserve(std::max(total, n_rows), hidden, max_ffn, static_cast<int>(jobs.size()));
  x_rows_.resize(static_cast<size_t>(n_rows));
  for (int t = 0; t < n_rows; ++t) x_rows_[static_cast<size_t>(t)] = x + static_cast<int64_t>(t) * hidden;
  out_.clear();
  job_assign_.clear();
  for (const RowsJob& job : jobs) {
    job_assign_.push_back({job.weights, job.rows, ones_.data(), job.m});
    out_.push_back(job.y);
  }
  run_layer(job_assign_, nullptr, n_rows, hidden, pool);
}

void expert_ffn(const ExpertWeights& w, const float* x, int n_tok, const float* route_weight, float* y_accum, ThreadPool& pool) {
  thread_local MoeFfn ffn;
  thread_local std::vector<int32_t> tokens;
  if (static_cast<int>(tokens.size()) < n_tok) {
    tokens.resize(static_cast<size_t>(n_tok));
    std::iota(tokens.begin(), tokens.end(), 0);
  }
  const ExpertAssignment a{&w, tokens.data(), route_weight, n_tok};
  ffn.run(std::span<const ExpertAssignment>(&a, 1), x, y_accum, n_tok, w.hidden, pool);
}

}  // namespace moraine::cpu
