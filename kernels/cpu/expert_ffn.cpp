// Fused routed-expert FFN on the thread pool.
#include "kernels/cpu/expert_ffn.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

#include "common/formats/quant.h"
#include "kernels/cpu/matvec.h"
#include "kernels/cpu/vec_dot.h"

namespace moraine::cpu {
namespace {

// Rows per gate/up job and per down job (the FfnJobRows defaults). A gate+up job of 16 rows of
// a 2048-wide Q4_K expert moves 2 x 16 x 1152 B = 36 KB; a down job of 32 rows runs over every
// expert in the list (8 x 32 rows x 432 B = 110 KB). Small enough for 16 threads to share one
// expert's 768 rows evenly, large enough that the per-job overhead (one atomic increment) is noise.
// A/B on the 16-core Xeon (GB/s Q4_K / Q8_0 / MXFP4 at 1 token; runs differ by ~10%): 16/32 (the
// default) 56-65 / 75-81 / 47-52; 8/32 58 / 81 / 52; 32/32 59 / 74 / 51; 48/32 62 / 86 / 53;
// 16/16 62 / 75 / 48; 16/64 58 / 78 / 46; 32/64 60 / 77 / 52: no setting stands out of the noise.
std::atomic<int64_t> g_gate_up_rows{FfnJobRows{}.gate_up};
std::atomic<int64_t> g_down_rows{FfnJobRows{}.down};
// Activation rows quantized by the calling thread instead of the pool (about 1 us each at
// hidden 2048, less than one wake-up of the pool).
constexpr int64_t kInlineQuantizeJobs = 4;

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

}  // namespace

void set_ffn_job_rows(FfnJobRows rows) {
  g_gate_up_rows.store(std::max<int64_t>(1, rows.gate_up), std::memory_order_relaxed);
  g_down_rows.store(std::max<int64_t>(1, rows.down), std::memory_order_relaxed);
}

FfnJobRows ffn_job_rows() { return {g_gate_up_rows.load(std::memory_order_relaxed), g_down_rows.load(std::memory_order_relaxed)}; }

void MoeFfn::run(std::span<const ExpertAssignment> experts, const float* x, float* y_accum, int n_tokens, int64_t hidden,
                 ThreadPool& pool) {
  if (experts.empty() || n_tokens <= 0) return;
  const FfnJobRows job_rows = ffn_job_rows();
  const int64_t gate_up_rows = job_rows.gate_up, down_rows = job_rows.down;
  // Validate and plan: which activation types, and where each expert's scratch goes.
  bool need_act[kNumActTypes] = {};
  plan_.resize(experts.size());
  int64_t h_total = 0, q_total = 0;
  int gate_up_jobs = 0;
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
    }
    need_act[act_index(dot_activation_type(w.gate_type))] = true;
    need_act[act_index(dot_activation_type(w.up_type))] = true;
    Plan& p = plan_[e];
    p.h_offset = h_total;
    p.q_offset = q_total;
    p.q_row_bytes = row_bytes(dot_activation_type(w.down_type), w.ffn);
    p.first_job = gate_up_jobs;
    h_total += static_cast<int64_t>(a.n_tok) * w.ffn;
    q_total += static_cast<int64_t>(a.n_tok) * static_cast<int64_t>(p.q_row_bytes);
    gate_up_jobs += a.n_tok > 0 ? static_cast<int>((w.ffn + gate_up_rows - 1) / gate_up_rows) : 0;
  }
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

  // Phase 1: each token's x, once per activation type. A few tokens are quantized right here:
  // waking the pool for microseconds of work would cost more than the work.
  int act_list[kNumActTypes], n_act = 0;
  for (int i = 0; i < kNumActTypes; ++i) {
    if (need_act[i]) act_list[n_act++] = i;
  }
  auto quantize_x = [&](int64_t job, int) {
    const int ai = act_list[job % n_act];
    const int64_t t = job / n_act;
    quantize_act(kActTypes[ai], x + t * hidden, xq_.data() + act_offset[ai] + static_cast<size_t>(t) * act_row[ai], hidden);
  };
  const int64_t x_jobs = static_cast<int64_t>(n_tokens) * n_act;
  if (x_jobs <= kInlineQuantizeJobs) {
    for (int64_t j = 0; j < x_jobs; ++j) quantize_x(j, 0);
  } else {
    pool.run(x_jobs, quantize_x);
  }

  // Phase 2: gate and up rows, a chunk of one expert per job, all of that expert's tokens. The
  // job that finishes an expert's last chunk applies SwiGLU and quantizes that expert's
  // intermediate (the acq_rel count makes the other chunks' rows visible to it), so no pool-wide
  // barrier separates the two.
  if (remaining_capacity_ < experts.size()) {
    remaining_ = std::make_unique<std::atomic<int>[]>(experts.size());
    remaining_capacity_ = experts.size();
  }
  for (size_t e = 0; e < experts.size(); ++e) {
    remaining_[e].store(experts[e].n_tok > 0 ? static_cast<int>((experts[e].weights->ffn + gate_up_rows - 1) / gate_up_rows) : 0,
                        std::memory_order_relaxed);
  }
  pool.run(gate_up_jobs, [&](int64_t job, int) {
    // The owner is the last expert whose first job is <= job (an expert without tokens shares
    // its first_job with the next one, so it is never picked).
    const auto it = std::upper_bound(plan_.begin(), plan_.end(), job, [](int64_t j, const Plan& p) { return j < p.first_job; });
    const size_t e = static_cast<size_t>(it - plan_.begin()) - 1;
    const ExpertAssignment& a = experts[e];
    const ExpertWeights& w = *a.weights;
    const Plan& p = plan_[e];
    const int64_t r0 = (job - p.first_job) * gate_up_rows, r1 = std::min(r0 + gate_up_rows, w.ffn);
    const int gi = act_index(dot_activation_type(w.gate_type)), ui = act_index(dot_activation_type(w.up_type));
    matvec_tokens(w.gate_type, hidden, w.gate, r0, r1, xq_.data() + act_offset[gi], act_row[gi], a.tokens, a.n_tok,
                  gate_.data() + p.h_offset, w.ffn);
    matvec_tokens(w.up_type, hidden, w.up, r0, r1, xq_.data() + act_offset[ui], act_row[ui], a.tokens, a.n_tok,
                  up_.data() + p.h_offset, w.ffn);
    if (remaining_[e].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    // SwiGLU (into gate_, in place) and the intermediate's quantization for every token.
    const TensorType qt = dot_activation_type(w.down_type);
    for (int i = 0; i < a.n_tok; ++i) {
      float* h = gate_.data() + p.h_offset + static_cast<int64_t>(i) * w.ffn;
      const float* u = up_.data() + p.h_offset + static_cast<int64_t>(i) * w.ffn;
      for (int64_t j = 0; j < w.ffn; ++j) h[j] = silu(h[j]) * u[j];
      quantize_act(qt, h, hq_.data() + p.q_offset + static_cast<size_t>(i) * p.q_row_bytes, w.ffn);
    }
  });

  // Phase 4: down, by chunks of output rows, each over every expert in list order. Each
  // expert's chunk goes through matvec_tokens (register-blocked tiles, prefetch) into a
  // per-thread [n_tok][down_rows] scratch, then into y_accum in (expert, row, token) order.
  const int64_t down_jobs = (hidden + down_rows - 1) / down_rows;
  pool.run(down_jobs, [&](int64_t job, int) {
    thread_local std::vector<float> part;
    const int64_t r0 = job * down_rows, r1 = std::min(r0 + down_rows, hidden);
    for (size_t e = 0; e < experts.size(); ++e) {
      const ExpertAssignment& a = experts[e];
      if (a.n_tok == 0) continue;
      const ExpertWeights& w = *a.weights;
      const Plan& p = plan_[e];
      const size_t wb = row_bytes(w.down_type, w.ffn);
      if (part.size() < static_cast<size_t>(a.n_tok) * down_rows) part.resize(static_cast<size_t>(a.n_tok) * down_rows);
      matvec_tokens(w.down_type, w.ffn, static_cast<const uint8_t*>(w.down) + static_cast<size_t>(r0) * wb, 0, r1 - r0,
                    hq_.data() + p.q_offset, p.q_row_bytes, nullptr, a.n_tok, part.data(), down_rows);
      for (int64_t r = r0; r < r1; ++r) {
        for (int i = 0; i < a.n_tok; ++i) {
          y_accum[static_cast<int64_t>(a.tokens[i]) * hidden + r] += a.route_weight[i] * part[static_cast<size_t>(i * down_rows + (r - r0))];
        }
      }
    }
  });
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
  if (hq_.size() < rows * hq_row) hq_.resize(rows * hq_row);
  plan_.reserve(static_cast<size_t>(max_experts));
  if (remaining_capacity_ < static_cast<size_t>(max_experts)) {
    remaining_ = std::make_unique<std::atomic<int>[]>(static_cast<size_t>(max_experts));
    remaining_capacity_ = static_cast<size_t>(max_experts);
  }
  if (iota_.size() < tok) {
    iota_.resize(tok);
    std::iota(iota_.begin(), iota_.end(), 0);
    ones_.assign(tok, 1.0f);
  }
}

void MoeFfn::run_expert(const ExpertWeights& w, const float* x, int m, float* y, ThreadPool& pool) {
  if (m <= 0) return;
  if (w.hidden <= 0 || w.ffn <= 0) {
    throw std::invalid_argument("expert FFN: run_expert on an expert with hidden " + std::to_string(w.hidden) + ", ffn " + std::to_string(w.ffn));
  }
  reserve(m, w.hidden, w.ffn);
  // y = 0 + 1 * FFN(x): the down phase's accumulate is exact here (only -0 becomes +0).
  std::fill_n(y, static_cast<size_t>(m) * static_cast<size_t>(w.hidden), 0.0f);
  const ExpertAssignment a{&w, iota_.data(), ones_.data(), m};
  run(std::span<const ExpertAssignment>(&a, 1), x, y, m, w.hidden, pool);
}

void MoeFfn::run_experts(std::span<const ExpertJob> jobs, ThreadPool& pool) {
  int total = 0;
  int64_t hidden = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const ExpertJob& job = jobs[j];
    if (!job.weights || job.m < 0 || (job.m > 0 && (!job.x || !job.y))) {
      throw std::invalid_argument("expert FFN: run_experts job " + std::to_string(j) + " lacks weights, rows or output");
    }
    if (j == 0) hidden = job.weights->hidden;
    if (job.weights->hidden != hidden || hidden <= 0 || job.weights->ffn <= 0) {
      throw std::invalid_argument("expert FFN: run_experts job " + std::to_string(j) + " has hidden " + std::to_string(job.weights->hidden) +
                                  ", ffn " + std::to_string(job.weights->ffn) + " (first job's hidden " + std::to_string(hidden) + ")");
    }
    total += job.m;
  }
  if (total == 0) return;
  int64_t max_ffn = 0;
  for (const ExpertJob& job : jobs) max_ffn = std::max(max_ffn, job.weights->ffn);
  reserve(total, hidden, max_ffn, static_cast<int>(jobs.size()));
  const size_t row = static_cast<size_t>(hidden), rows = static_cast<size_t>(total) * row;
  if (x_all_.size() < rows) {
    x_all_.resize(rows);
    y_all_.resize(rows);
  }
  job_assign_.clear();
  job_assign_.reserve(jobs.size());
  int first = 0;
  for (const ExpertJob& job : jobs) {
    std::copy_n(job.x, static_cast<size_t>(job.m) * row, x_all_.data() + static_cast<size_t>(first) * row);
    // Rows first..first+m-1 of the stack belong to this expert alone, so y_all = 0 + 1 * FFN.
    job_assign_.push_back({job.weights, iota_.data() + first, ones_.data(), job.m});
    first += job.m;
  }
  std::fill_n(y_all_.data(), rows, 0.0f);
  run(job_assign_, x_all_.data(), y_all_.data(), total, hidden, pool);
  first = 0;
  for (const ExpertJob& job : jobs) {
    std::copy_n(y_all_.data() + static_cast<size_t>(first) * row, static_cast<size_t>(job.m) * row, job.y);
    first += job.m;
  }
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
