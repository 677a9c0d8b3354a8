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

// Output rows per chunk of run()'s accumulating form: the job finishing a chunk's last partial
// adds the chunk into y_accum (the fixed job chunks it comes from: docs/perf-log.md, "FfnJobRows").
constexpr int64_t kSumChunkRows = 128;
// Activation rows quantized by the calling thread instead of in the job list (about 1 us each
// at hidden 2048, about what handing them to the pool costs).
constexpr int64_t kInlineQuantizeJobs = 4;
// FfnSlices::split's bound (a thread's share of one expert is ~50 gate/up rows at 15 threads).
constexpr int kMaxSliceSplit = 8;
// Shares are cut in runs of 4 rows: Q8_0 / MXFP4 tiles start at a job's first row, so
// boundaries at multiples of 4 keep every row in the same tile position whatever the cut.
constexpr int64_t kUnit = 4;

// Activation types a layer needs; x is quantized once per type.
constexpr TensorType kActTypes[] = {TensorType::Q8_0, TensorType::Q8_K, TensorType::F32, TensorType::F16, TensorType::BF16, TensorType::Q8_1};
constexpr int kNumActTypes = 6;

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
inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// The gated activation of gate/up rows [r0, r1) of one token, into h: plain SwiGLU, or
// biased_expert's biases and clamp in its order (+ bias, clamp, act), so results stay bitwise.
inline void glu_rows(const ExpertWeights& w, float* h, const float* u, int64_t r0, int64_t r1) {
  if (w.gate_bias == nullptr && w.up_bias == nullptr && !w.clamped_swiglu) {
    for (int64_t j = r0; j < r1; ++j) h[j] = silu(h[j]) * u[j];
    return;
  }
  const float alpha = w.swiglu_alpha, limit = w.swiglu_limit;
  for (int64_t j = r0; j < r1; ++j) {
    float g = h[j] + (w.gate_bias ? w.gate_bias[j] : 0.0f);
    float v = u[j] + (w.up_bias ? w.up_bias[j] : 0.0f);
    if (w.clamped_swiglu) {
      g = std::fmin(g, limit);
      v = std::fmax(-limit, std::fmin(v, limit));
      h[j] = g * sigmoid(alpha * g) * (v + 1.0f);
    } else {
      h[j] = silu(g) * v;
    }
  }
}

// down's bias on output rows [r0, r1) of n_tok rows of width hidden (biased_expert adds it to y
// before the route weight).
inline void add_down_bias(const ExpertWeights& w, float* y, int n_tok, int64_t hidden, int64_t r0, int64_t r1) {
  if (w.down_bias == nullptr) return;
  for (int i = 0; i < n_tok; ++i) {
    float* row = y + static_cast<int64_t>(i) * hidden;
    for (int64_t r = r0; r < r1; ++r) row[r] += w.down_bias[r];
  }
}

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
inline void quantize_act(TensorType t, const float* x, void* dst, int64_t n, CpuIsa max_isa) {
  quantize_activation_row_llama_x86(t, x, dst, n, max_isa);
}

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

int64_t trace_now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// While `ready()` is false, pulls `bytes` from `p` toward L2 (prefetcht1), 8 lines between two
// looks, so the end of the wait is seen within a few hundred ns: the thread's memory traffic
// would otherwise idle while it waits for another job.
template <typename Ready>
void prefetch_while_waiting(Ready&& ready, const uint8_t* p, size_t bytes) {
  for (size_t off = 0; off < bytes && !ready(); off += 512) {
#if defined(__x86_64__) || defined(__i386__)
    for (size_t l = off; l < std::min(bytes, off + 512); l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + l), _MM_HINT_T1);
#endif
  }
}

}  // namespace

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

bool MoeFfn::plan_layer(std::span<const ExpertAssignment> experts, float* y_accum, int n_tokens, int64_t hidden) {
  // Validate and plan: which activation types, and where each expert's scratch goes.
  static_assert(sizeof(ActRows::list) / sizeof(int) == kNumActTypes);
  bool need_act[kNumActTypes] = {};
  plan_.resize(experts.size());
  active_.clear();
  row_used_.assign(static_cast<size_t>(n_tokens), 0);
  int64_t h_total = 0, q_total = 0, y_total = 0;
  n_accumulating_ = 0;
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
        ++n_accumulating_;
      }
    }
  }
  if (active_.empty()) return false;
  act_ = ActRows{};
  size_t xq_total = 0;
  for (int i = 0; i < kNumActTypes; ++i) {
    if (!need_act[i]) continue;
    act_.list[act_.n++] = i;
    act_.offset[i] = xq_total;
    act_.row[i] = row_bytes(kActTypes[i], hidden);
    xq_total += act_.row[i] * static_cast<size_t>(n_tokens);
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
  return true;
}

void MoeFfn::quantize_x(int64_t job, int64_t hidden) {
  const int ai = act_.list[job % act_.n];
  const auto t = static_cast<size_t>(used_rows_[static_cast<size_t>(job / act_.n)]);
  quantize_act(kActTypes[ai], x_rows_[t], xq_.data() + act_.offset[ai] + t * act_.row[ai], hidden, tuning_.matvec.max_isa);
}

void MoeFfn::build_spans(std::span<const ExpertAssignment> experts, int64_t hidden, int n_slices) {
  const int64_t split = std::clamp(tuning_.slices.split, 1, kMaxSliceSplit);
  const bool per_expert = tuning_.slices.per_expert;
  // The list depends only on what plan_key_ holds: a decode loop calling with the same expert
  // slots, row counts and pool reuses the last one instead of building ~120 spans again (the
  // call's setup at 1 expert on the H200 host: 2.3-2.7 -> 0.9-1.2 us).
  plan_key_next_.clear();
  for (const int64_t v : {int64_t{n_slices}, x_jobs_, split, hidden, int64_t{per_expert}}) plan_key_next_.push_back(v);
  for (int32_t e : active_) {
    plan_key_next_.push_back(e);
    plan_key_next_.push_back(experts[static_cast<size_t>(e)].weights->ffn);
    plan_key_next_.push_back(out_[static_cast<size_t>(e)] ? 1 : 0);  // accumulating experts: the chunk counts
  }
  if (plan_key_next_ == plan_key_ && !spans_.empty()) return;  // spans_, slice_end_, chunk_spans_ as the last call left them
  plan_key_.assign(plan_key_next_.begin(), plan_key_next_.end());
  spans_.clear();
  // Thread w's share of the rows of a phase is units [U w / T, U (w + 1) / T), cut where an
  // expert ends (end to end), or the same share of each expert's units (per_expert).
  auto units_of = [&](int64_t rows) { return (rows + kUnit - 1) / kUnit; };
  auto rows_of = [&](int down, int32_t e) { return down ? hidden : experts[static_cast<size_t>(e)].weights->ffn; };
  int64_t gu_units = 0, dn_units = 0;
  for (int32_t e : active_) {
    gu_units += units_of(rows_of(0, e));
    dn_units += units_of(hidden);
  }
  // Emits the spans of units [u0, u1) of one phase (expert by expert in active_ order).
  auto emit = [&](int down, int64_t u0, int64_t u1) {
    int64_t base = 0;
    for (int32_t e : active_) {
      const int64_t rows = rows_of(down, e);
      const int64_t n = units_of(rows);
      const int64_t a = std::max(u0, base), b = std::min(u1, base + n);
      if (a < b) spans_.push_back({e, down, (a - base) * kUnit, std::min((b - base) * kUnit, rows)});
      base += n;
      if (base >= u1) break;
    }
  };
  // Each share cut into `split` jobs (per expert: split / experts per expert, at least one).
  auto emit_share = [&](int down, int64_t units, int w) {
    if (per_expert) {
      const int64_t pieces = std::max<int64_t>(1, split / static_cast<int64_t>(active_.size()));
      for (int32_t e : active_) {
        const int64_t rows = rows_of(down, e);
        const int64_t n = units_of(rows), u0 = n * w / n_slices, u1 = n * (w + 1) / n_slices;
        for (int64_t k = 0; k < pieces; ++k) {
          const int64_t a = u0 + (u1 - u0) * k / pieces, b = u0 + (u1 - u0) * (k + 1) / pieces;
          if (a < b) spans_.push_back({e, down, a * kUnit, std::min(b * kUnit, rows)});
        }
      }
      return;
    }
    const int64_t u0 = units * w / n_slices, u1 = units * (w + 1) / n_slices;
    for (int64_t k = 0; k < split; ++k) emit(down, u0 + (u1 - u0) * k / split, u0 + (u1 - u0) * (k + 1) / split);
  };
  // Two phases (ThreadPool::run_sliced_phases): every thread's gate/up share, then every
  // thread's down share; slice 0 starts with the x jobs.
  slice_end_.resize(2 * static_cast<size_t>(n_slices));
  for (int p = 0; p < 2; ++p) {
    for (int w = 0; w < n_slices; ++w) {
      emit_share(p, p ? dn_units : gu_units, w);
      slice_end_[static_cast<size_t>(p * n_slices + w)] = x_jobs_ + static_cast<int64_t>(spans_.size());
    }
  }
  // Accumulating experts: each chunk of kSumChunkRows output rows is summed into y_accum by the
  // down span that finishes the chunk's last covering span.
  if (n_accumulating_ > 0) {
    chunk_spans_.assign(static_cast<size_t>((hidden + kSumChunkRows - 1) / kSumChunkRows), 0);
    for (const Span& sp : spans_) {
      if (!sp.down || out_[static_cast<size_t>(sp.expert)]) continue;
      for (int64_t c = sp.r0 / kSumChunkRows; c <= (sp.r1 - 1) / kSumChunkRows; ++c) ++chunk_spans_[static_cast<size_t>(c)];
    }
  }
}

const uint8_t* MoeFfn::span_weights(const Span& sp, std::span<const ExpertAssignment> experts, int64_t hidden, size_t& bytes) const {
  const ExpertWeights& w = *experts[static_cast<size_t>(sp.expert)].weights;
  const TensorType t = sp.down ? w.down_type : w.gate_type;
  const size_t rb = row_bytes(t, sp.down ? w.ffn : hidden);
  bytes = static_cast<size_t>(sp.r1 - sp.r0) * rb;
  return static_cast<const uint8_t*>(sp.down ? w.down : w.gate) + static_cast<size_t>(sp.r0) * rb;
}

void MoeFfn::run_gate_up(const Span& sp, std::span<const ExpertAssignment> experts, int64_t hidden, FfnWorkerPhases* ph) {
  const auto e = static_cast<size_t>(sp.expert);
  const ExpertAssignment& a = experts[e];
  const ExpertWeights& w = *a.weights;
  const Plan& p = plan_[e];
  const int64_t r0 = sp.r0, r1 = sp.r1;
  // Gate and up rows [r0, r1) of one expert, all of that expert's tokens, once the rows are quantized.
  if (x_jobs_ && x_done_.load(std::memory_order_acquire) < x_jobs_) {
    size_t bytes = 0;
    const uint8_t* wp = span_weights(sp, experts, hidden, bytes);
    prefetch_while_waiting([&] { return x_done_.load(std::memory_order_acquire) >= x_jobs_; }, wp, bytes);
    spin_until_at_least(x_done_, x_jobs_);
  }
  const MatvecTuning& mt = tuning_.matvec;
  const int gi = act_index(dot_activation_type(w.gate_type)), ui = act_index(dot_activation_type(w.up_type));
  float* const gy = gate_.data() + p.h_offset;
  float* const uy = up_.data() + p.h_offset;
  if (w.gate_type == TensorType::Q4_K && w.up_type == TensorType::Q4_K) {
    // Q4_K: the gate and up rows side by side, two streams per thread (H200 host, p50 at 1
    // expert 39.4 -> 34.6 us; slower for Q8_0, level for MXFP4: docs/perf-log.md, "FfnStreamOptions").
    const MatvecRun runs[2] = {{w.gate, r0, r1, gy}, {w.up, r0, r1, uy}};
    matvec_tokens_runs(w.gate_type, hidden, runs, 2, xq_.data() + act_.offset[gi], act_.row[gi], a.tokens, a.n_tok, w.ffn, mt);
  } else {
    matvec_tokens(w.gate_type, hidden, w.gate, r0, r1, xq_.data() + act_.offset[gi], act_.row[gi], a.tokens, a.n_tok, gy, w.ffn, mt);
    matvec_tokens(w.up_type, hidden, w.up, r0, r1, xq_.data() + act_.offset[ui], act_.row[ui], a.tokens, a.n_tok, uy, w.ffn, mt);
  }
  // SwiGLU of this job's rows, in place into gate_ (elementwise: the same floats whichever job
  // computes them), spread over the jobs instead of on the critical path of the expert's down.
  for (int i = 0; i < a.n_tok; ++i) {
    float* h = gy + static_cast<int64_t>(i) * w.ffn;
    const float* u = uy + static_cast<int64_t>(i) * w.ffn;
    glu_rows(w, h, u, r0, r1);
  }
  // The job finishing an expert's last chunk (acq_rel: the other chunks' rows are visible to
  // it) quantizes the intermediate.
  if (ph) ph->rows_done_ns = trace_now_ns();
  if (remaining_[e].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  const TensorType qt = dot_activation_type(w.down_type);
  for (int i = 0; i < a.n_tok; ++i) {
    quantize_act(qt, gy + static_cast<int64_t>(i) * w.ffn, hq_.data() + p.q_offset + static_cast<size_t>(i) * p.q_row_bytes, w.ffn, mt.max_isa);
  }
  ready_[e].store(1, std::memory_order_release);
  if (ph) ph->ready_set_ns = trace_now_ns();
}

void MoeFfn::run_down(const Span& sp, std::span<const ExpertAssignment> experts, float* y_accum, int64_t hidden, FfnWorkerPhases* ph) {
  const auto e = static_cast<size_t>(sp.expert);
  const ExpertAssignment& a = experts[e];
  const ExpertWeights& w = *a.weights;
  const Plan& p = plan_[e];
  const int64_t r0 = sp.r0, r1 = sp.r1;
  // Output rows [r0, r1) of one expert, once its intermediate is quantized.
  if (ready_[e].load(std::memory_order_acquire) == 0) {
    const int64_t wait_start = ph ? trace_now_ns() : 0;
    size_t bytes = 0;
    const uint8_t* wp = span_weights(sp, experts, hidden, bytes);
    prefetch_while_waiting([&] { return ready_[e].load(std::memory_order_acquire) != 0; }, wp, bytes);
    spin_until_at_least(ready_[e], 1);
    if (ph) ph->down_wait_ns += trace_now_ns() - wait_start;
  }
  const MatvecTuning& mt = tuning_.matvec;
  const uint8_t* hq = hq_.data() + p.q_offset;
  if (float* out = out_[e]) {
    // This expert's own output rows: y = 0 + w * FFN, the accumulate below on a zeroed y.
    matvec_tokens(w.down_type, w.ffn, w.down, r0, r1, hq, p.q_row_bytes, nullptr, a.n_tok, out, hidden, mt);
    add_down_bias(w, out, a.n_tok, hidden, r0, r1);
    for (int i = 0; i < a.n_tok; ++i) {
      float* row = out + static_cast<int64_t>(i) * hidden;
      for (int64_t r = r0; r < r1; ++r) row[r] = 0.0f + a.route_weight[i] * row[r];
    }
    return;
  }
  matvec_tokens(w.down_type, w.ffn, w.down, r0, r1, hq, p.q_row_bytes, nullptr, a.n_tok, part_.data() + p.y_offset, hidden, mt);
  add_down_bias(w, part_.data() + p.y_offset, a.n_tok, hidden, r0, r1);
  // Each chunk of kSumChunkRows rows this span covers.
  for (int64_t c = r0 / kSumChunkRows; c <= (r1 - 1) / kSumChunkRows; ++c) {
    if (chunk_left_[c].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
    // The chunk's last span: add every expert's partial into y_accum in (expert, row, token)
    // order (each y element's sum in expert order, whichever spans wrote the partials).
    const int64_t c0 = c * kSumChunkRows, c1 = std::min(c0 + kSumChunkRows, hidden);
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
}

void MoeFfn::prefetch_slices(std::span<const ExpertAssignment> experts, int64_t hidden, ThreadPool& pool) {
  // Thread w pulls the rows of its own slices (both phases, in list order) toward its L2,
  // polling the stop callback every 1 KB; a helper taking another slice's job skips it (its L2
  // is not where the rows are read).
  const int n_slices = pool.size();
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
    for (int p = 0; p < 2; ++p) {
      const int idx = p * n_slices + worker;
      const int64_t first = idx == 0 ? 0 : slice_end_[static_cast<size_t>(idx - 1)] - x_jobs_, end = slice_end_[static_cast<size_t>(idx)] - x_jobs_;
      for (int64_t k = std::max<int64_t>(first, 0); k < end; ++k) {
        const Span& sp = spans_[static_cast<size_t>(k)];
        size_t bytes = 0;
        const uint8_t* wp = span_weights(sp, experts, hidden, bytes);
        if (!pull(wp, bytes)) return;
        if (!sp.down) {
          const ExpertWeights& w = *experts[static_cast<size_t>(sp.expert)].weights;
          const size_t rb = row_bytes(w.up_type, hidden);
          if (!pull(static_cast<const uint8_t*>(w.up) + static_cast<size_t>(sp.r0) * rb, static_cast<size_t>(sp.r1 - sp.r0) * rb)) return;
        }
      }
    }
  });
}

void MoeFfn::run_layer(std::span<const ExpertAssignment> experts, float* y_accum, int n_tokens, int64_t hidden, ThreadPool& pool) {
  FfnPhaseTrace* const trace = prefetch_ ? nullptr : trace_;
  if (trace) {
    trace->workers.assign(static_cast<size_t>(pool.size()), FfnWorkerPhases{});
    trace->call_start_ns = trace_now_ns();
  }
  if (!plan_layer(experts, y_accum, n_tokens, hidden)) return;
  // The rows' quantization, once per activation type. With the caller joining the pool, a few
  // rows are quantized as the first jobs of its own slice, and the other threads' first gate/up
  // jobs wait for them there (pulling their weight rows into L2 meanwhile) instead of the whole
  // pool waiting for the caller's ~1 us per row (hidden 2048) before the list starts. Otherwise a
  // few rows are quantized right here (less than a list's hand-over), more in a list of their own.
  const int64_t x_jobs_all = static_cast<int64_t>(used_rows_.size()) * act_.n;
  const bool x_in_slice0 = pool.caller_joins() && x_jobs_all <= kInlineQuantizeJobs;
  x_jobs_ = x_in_slice0 ? x_jobs_all : 0;
  if (x_in_slice0 || prefetch_) {
    // quantized in the list (prefetch_experts: not at all)
  } else if (x_jobs_all <= kInlineQuantizeJobs) {
    for (int64_t j = 0; j < x_jobs_all; ++j) quantize_x(j, hidden);
  } else {
    pool.run(x_jobs_all, [&](int64_t j, int) { quantize_x(j, hidden); });
  }

  grow_atomics(remaining_, expert_capacity_, experts.size());
  grow_atomics(ready_, ready_capacity_, experts.size());
  grow_atomics(chunk_left_, chunk_capacity_, static_cast<size_t>((hidden + kSumChunkRows - 1) / kSumChunkRows));
  for (int32_t e : active_) {
    remaining_[e].store(0, std::memory_order_relaxed);
    ready_[e].store(0, std::memory_order_relaxed);
  }
  x_done_.store(0, std::memory_order_relaxed);
  build_spans(experts, hidden, pool.size());
  if (n_accumulating_ > 0) {
    for (size_t c = 0; c < chunk_spans_.size(); ++c) chunk_left_[c].store(chunk_spans_[c], std::memory_order_relaxed);
  }
  // Gate/up jobs per expert (no other thread runs yet: plain loads and stores, no locked adds).
  for (const Span& sp : spans_) {
    if (!sp.down) remaining_[sp.expert].store(remaining_[sp.expert].load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }
  if (prefetch_) return prefetch_slices(experts, hidden, pool);

  auto run_job = [&](int64_t job, FfnWorkerPhases* ph) {
    if (job < x_jobs_) {
      quantize_x(job, hidden);
      x_done_.fetch_add(1, std::memory_order_release);
      return;
    }
    const Span& sp = spans_[static_cast<size_t>(job - x_jobs_)];
    if (sp.down) run_down(sp, experts, y_accum, hidden, ph);
    else run_gate_up(sp, experts, hidden, ph);
  };
  // Every job through here: with a trace, its worker's phase times around it.
  auto job_on = [&](int64_t job, int worker) {
    if (!trace) return run_job(job, nullptr);
    FfnWorkerPhases& ph = trace->workers[static_cast<size_t>(worker)];
    const int64_t t0 = trace_now_ns();
    if (ph.jobs++ == 0) ph.first_start_ns = t0;
    run_job(job, &ph);
    ph.last_end_ns = trace_now_ns();
    if (job >= x_jobs_ && !spans_[static_cast<size_t>(job - x_jobs_)].down) ph.gate_up_end_ns = ph.last_end_ns;
  };
  if (trace) trace->list_start_ns = trace_now_ns();
  // A down job waits only for gate/up jobs, all in the first phase, which a thread leaves only
  // once every gate/up job has been claimed (and those wait only for the x jobs at the front of
  // slice 0, which never wait): no deadlock. (A shared job counter and fixed job chunks lost to
  // these slices: docs/perf-log.md, "FfnSchedule::Shared", "FfnSliceOptions::balanced".)
  pool.run_sliced_phases(slice_end_.data(), 2, job_on);
  if (trace) trace->call_end_ns = trace_now_ns();
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
  // The job table: per thread and phase at most `split` jobs plus one per expert boundary, so
  // 2 x split (256 threads is far more than a pool has).
  spans_.reserve(static_cast<size_t>(4 * 256 * kMaxSliceSplit + 2 * max_experts));
  active_.reserve(static_cast<size_t>(max_experts));
  out_.reserve(static_cast<size_t>(max_experts));
  job_assign_.reserve(static_cast<size_t>(max_experts));
  x_rows_.reserve(rows);
  row_used_.reserve(rows);
  used_rows_.reserve(rows);
  grow_atomics(remaining_, expert_capacity_, static_cast<size_t>(max_experts));
  grow_atomics(ready_, ready_capacity_, static_cast<size_t>(max_experts));
  grow_atomics(chunk_left_, chunk_capacity_, static_cast<size_t>((hidden + kSumChunkRows - 1) / kSumChunkRows));
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

void expert_ffn(const ExpertWeights& w, const float* x, int n_tok, const float* route_weight, float* y_accum, ThreadPool& pool,
                const CpuKernelTuning& tuning) {
  thread_local MoeFfn ffn;
  ffn.set_tuning(tuning);
  thread_local std::vector<int32_t> tokens;
  if (static_cast<int>(tokens.size()) < n_tok) {
    tokens.resize(static_cast<size_t>(n_tok));
    std::iota(tokens.begin(), tokens.end(), 0);
  }
  const ExpertAssignment a{&w, tokens.data(), route_weight, n_tok};
  ffn.run(std::span<const ExpertAssignment>(&a, 1), x, y_accum, n_tok, w.hidden, pool);
}

}  // namespace moraine::cpu
