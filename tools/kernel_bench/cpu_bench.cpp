// moraine-kernel-bench cpu. The expert set is a Qwen3-30B-A3B-shaped layer stack (hidden 2048,
// FFN 768, 8 routed experts per token) with as many distinct experts as fit in --set-mib,
// cycled so that no expert is cache-resident when it is used again: each layer call reads its
// 8 experts from DRAM, as decode on an offloaded model does.
#include "tools/kernel_bench/cpu_bench.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <pthread.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <random>
#include <stdexcept>
#include <thread>

#include "common/formats/quant.h"
#include "common/formats/quant_iq.h"
#include "kernels/cpu/cpu_topology.h"
#include "kernels/cpu/expert_ffn.h"
#include "kernels/cpu/matvec.h"
#include "kernels/cpu/numa_memory.h"
#include "kernels/cpu/stream_read.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cpu/vec_dot.h"

namespace moraine::kernel_bench {
namespace {

constexpr int64_t kHidden = 2048, kFfn = 768;
constexpr int kMaxExpertsPerCall = 64;  // --experts-per-call's bound; the set holds at least two calls' worth
constexpr int kTemplateRows = 64;  // distinct quantized rows, replicated through the set

using Clock = std::chrono::steady_clock;

struct ExpertSet {
  cpu::NodeMemory memory;
  std::vector<cpu::ExpertWeights> experts;
  size_t expert_bytes = 0;
};

// Quantized template rows of one shape, then every matrix of every expert filled with them
// (shifted per expert), so the set holds valid blocks without quantizing a GiB.
ExpertSet make_expert_set(TensorType t, size_t set_bytes, int node, bool huge_pages) {
  std::mt19937 rng(2024);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  auto make_template = [&](int64_t cols) {
    std::vector<uint8_t> rows(row_bytes(t, cols) * kTemplateRows);
    std::vector<float> f(static_cast<size_t>(cols));
    if (formats::is_iq_grid_type(t)) {
      // moraine does not write IQ types: random blocks (any byte is a valid index, sign or
      // scale) with the fp16 block scale (IQ1_M: scale word 3's top nibble) near 2^-9.
      for (uint8_t& b : rows) b = static_cast<uint8_t>(rng());
      const size_t bb = type_traits(t).block_bytes, scale_hi = t == TensorType::IQ1_M ? 55 : 1;
      for (size_t off = 0; off < rows.size(); off += bb) rows[off + scale_hi] = t == TensorType::IQ1_M ? 0x10 : 0x18;
      return rows;
    }
    for (int r = 0; r < kTemplateRows; ++r) {
      for (float& v : f) v = dist(rng);
      quantize_row(t, f.data(), rows.data() + static_cast<size_t>(r) * row_bytes(t, cols), cols);
    }
    return rows;
  };
  const std::vector<uint8_t> wide = make_template(kHidden), narrow = make_template(kFfn);
  const size_t wide_row = row_bytes(t, kHidden), narrow_row = row_bytes(t, kFfn);
  const size_t mat_wide = wide_row * kFfn, mat_narrow = narrow_row * kHidden;
  const size_t expert_bytes = 2 * mat_wide + mat_narrow;
  const size_t n_experts = std::max<size_t>(2 * kMaxExpertsPerCall, set_bytes / expert_bytes);
  ExpertSet set{cpu::NodeMemory(n_experts * expert_bytes, node, huge_pages), {}, expert_bytes};
  auto* base = static_cast<uint8_t*>(set.memory.data());
  for (size_t e = 0; e < n_experts; ++e) {
    uint8_t* p = base + e * expert_bytes;
    cpu::ExpertWeights w;
    w.gate_type = w.up_type = w.down_type = t;
    w.hidden = kHidden;
    w.ffn = kFfn;
    w.gate = p;
    w.up = p + mat_wide;
    w.down = p + 2 * mat_wide;
    for (int m = 0; m < 2; ++m) {
      for (int64_t r = 0; r < kFfn; ++r) {
        std::memcpy(p + m * mat_wide + static_cast<size_t>(r) * wide_row, wide.data() + ((static_cast<size_t>(r) + e * 7 + m) % kTemplateRows) * wide_row, wide_row);
      }
    }
    for (int64_t r = 0; r < kHidden; ++r) {
      std::memcpy(p + 2 * mat_wide + static_cast<size_t>(r) * narrow_row, narrow.data() + ((static_cast<size_t>(r) + e * 5) % kTemplateRows) * narrow_row, narrow_row);
    }
    set.experts.push_back(w);
  }
  return set;
}

// This process's anonymous memory in transparent huge pages (/proc/self/smaps_rollup), bytes;
// 0 when it cannot be read.
size_t anon_huge_bytes() {
  std::FILE* f = std::fopen("/proc/self/smaps_rollup", "r");
  if (!f) return 0;
  char line[256];
  size_t kb = 0;
  while (std::fgets(line, sizeof line, f)) {
    unsigned long v = 0;
    if (std::sscanf(line, "AnonHugePages: %lu kB", &v) == 1) kb = v;
  }
  std::fclose(f);
  return kb * 1024;
}

struct Point {
  std::string format;
  int tokens = 0;
  double gbps = 0.0, seconds = 0.0;
  int64_t layers = 0;
  double sleeps_per_call = 0.0;  // pool futex sleeps (workers and caller) per timed call: each costs a wake-up
  double p50_us = 0.0, p90_us = 0.0;  // per-call time percentiles (gap_us > 0 only: each call timed alone)
  std::string phases;  // --phase-trace: where the calls' time went (phase_report)
};

// Microseconds between two trace stamps.
double trace_us(int64_t from_ns, int64_t to_ns) { return static_cast<double>(to_ns - from_ns) / 1e3; }

double median_of(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// One traced call's phase times, in us from the call's start (cpu::FfnPhaseTrace), and per
// worker its gate/up time (first job to last gate/up end) and down time (from when its down
// could start, the later of its gate/up end and the last expert's ready, to its last job's end).
struct CallPhases {
  double setup = 0, first_max = 0, first_mean = 0, gu_min = 0, gu_med = 0, gu_max = 0, rows_max = 0, ready = 0, wait_mean = 0, end_min = 0,
         end_med = 0, end_max = 0, returned = 0;
  std::vector<double> worker_gu, worker_down;  // per worker, -1 when it ran no such job
};

CallPhases call_phases(const cpu::FfnPhaseTrace& tr) {
  CallPhases c;
  const int64_t t0 = tr.call_start_ns;
  c.setup = trace_us(t0, tr.list_start_ns);
  c.returned = trace_us(t0, tr.call_end_ns);
  std::vector<double> first, gu, ends, waits;
  int64_t ready = 0, rows_done = 0;
  for (const cpu::FfnWorkerPhases& w : tr.workers) {
    ready = std::max(ready, w.ready_set_ns);
    rows_done = std::max(rows_done, w.rows_done_ns);
  }
  c.ready = ready ? trace_us(t0, ready) : 0.0;
  c.rows_max = rows_done ? trace_us(t0, rows_done) : 0.0;
  for (const cpu::FfnWorkerPhases& w : tr.workers) {
    if (w.jobs == 0) {
      c.worker_gu.push_back(-1);
      c.worker_down.push_back(-1);
      continue;
    }
    first.push_back(trace_us(tr.list_start_ns, w.first_start_ns));
    ends.push_back(trace_us(t0, w.last_end_ns));
    waits.push_back(static_cast<double>(w.down_wait_ns) / 1e3);
    if (w.gate_up_end_ns) gu.push_back(trace_us(t0, w.gate_up_end_ns));
    c.worker_gu.push_back(w.gate_up_end_ns ? trace_us(w.first_start_ns, w.gate_up_end_ns) : -1);
    const int64_t down_from = std::max(w.gate_up_end_ns ? w.gate_up_end_ns : w.first_start_ns, ready);
    c.worker_down.push_back(w.last_end_ns > down_from ? trace_us(down_from, w.last_end_ns) : -1);
  }
  auto stats = [](std::vector<double> v, double& lo, double& med, double& hi) {
    if (v.empty()) return;
    std::sort(v.begin(), v.end());
    lo = v.front();
    med = v[v.size() / 2];
    hi = v.back();
  };
  double unused = 0;
  stats(first, unused, unused, c.first_max);
  for (double f : first) c.first_mean += f / static_cast<double>(first.size());
  for (double w : waits) c.wait_mean += w / static_cast<double>(waits.size());
  stats(gu, c.gu_min, c.gu_med, c.gu_max);
  stats(ends, c.end_min, c.end_med, c.end_max);
  return c;
}

// Medians over the traced calls, as two lines for the table.
std::string phase_report(const std::vector<CallPhases>& calls) {
  if (calls.empty()) return {};
  auto med = [&](double CallPhases::*f) {
    std::vector<double> v;
    for (const CallPhases& c : calls) v.push_back(c.*f);
    return median_of(v);
  };
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "    phases, us from the call's start, median of %zu calls: setup %.1f | first job (after the hand-over) mean %.1f max "
                "%.1f | gate/up end min %.1f med %.1f max %.1f | last rows %.1f ready %.1f | down wait mean %.1f | last job end min %.1f med %.1f "
                "max %.1f | returned %.1f\n",
                calls.size(), med(&CallPhases::setup), med(&CallPhases::first_mean), med(&CallPhases::first_max), med(&CallPhases::gu_min),
                med(&CallPhases::gu_med), med(&CallPhases::gu_max), med(&CallPhases::rows_max), med(&CallPhases::ready), med(&CallPhases::wait_mean), med(&CallPhases::end_min),
                med(&CallPhases::end_med), med(&CallPhases::end_max), med(&CallPhases::returned));
  std::string out = buf;
  out += "    per worker, median us gate/up | down:";
  for (size_t w = 0; w < calls.front().worker_gu.size(); ++w) {
    std::vector<double> g, d;
    for (const CallPhases& c : calls) {
      if (c.worker_gu[w] >= 0) g.push_back(c.worker_gu[w]);
      if (c.worker_down[w] >= 0) d.push_back(c.worker_down[w]);
    }
    std::snprintf(buf, sizeof buf, " w%zu %.1f|%.1f", w, median_of(g), median_of(d));
    out += buf;
  }
  return out + "\n";
}

// GB/s of expert bytes consumed: whole sweeps over the set (n_per_call distinct experts per
// layer call) until min_seconds have passed. With gap_us > 0 the bench's thread sleeps that
// long after each layer call, as the worker idles while the GPU runs the rest of a layer; only
// the calls count. worker_form: MoeFfn::run_experts with each expert writing its own rows (the
// cpu_expert_worker's call) instead of run() accumulating into one y.
Point measure(const ExpertSet& set, TensorType t, int n_tok, int n_per_call, bool worker_form, double min_seconds, int gap_us,
              bool phase_trace, int gap_prefetch, const cpu::CpuKernelTuning& tuning, cpu::ThreadPool& pool) {
  const int64_t n_layers = static_cast<int64_t>(set.experts.size()) / n_per_call;
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n_tok * kHidden)), y(x.size(), 0.0f);
  for (float& v : x) v = dist(rng);
  std::vector<int32_t> tokens(static_cast<size_t>(n_tok));
  for (int i = 0; i < n_tok; ++i) tokens[static_cast<size_t>(i)] = i;
  const std::vector<float> route(static_cast<size_t>(n_tok), 1.0f / static_cast<float>(n_per_call));
  std::vector<cpu::ExpertAssignment> assign(static_cast<size_t>(n_per_call));
  std::vector<cpu::MoeFfn::RowsJob> jobs(static_cast<size_t>(n_per_call));
  std::vector<float> y_own(static_cast<size_t>(n_per_call) * x.size());
  cpu::MoeFfn ffn(tuning);
  auto layer = [&](int64_t l) {
    for (int k = 0; k < n_per_call; ++k) {
      const cpu::ExpertWeights* w = &set.experts[static_cast<size_t>(l * n_per_call + k)];
      assign[static_cast<size_t>(k)] = {w, tokens.data(), route.data(), n_tok};
      jobs[static_cast<size_t>(k)] = {w, tokens.data(), n_tok, y_own.data() + static_cast<size_t>(k) * x.size()};
    }
    if (worker_form) ffn.run_experts(std::span<const cpu::MoeFfn::RowsJob>(jobs), x.data(), n_tok, pool);
    else ffn.run(assign, x.data(), y.data(), n_tok, kHidden, pool);
  };
  // --gap-prefetch: during the gap before call l, MoeFfn::prefetch_experts of call l's experts (1: the
  // guess from routing locality was right), of call l + n_layers / 2's (2: wrong) or of call l's
  // but its first expert (3: one missed, so the call's list is not the guessed one), stopped
  // when the gap ends; worker form only.
  std::vector<const cpu::ExpertWeights*> guess;
  guess.reserve(static_cast<size_t>(n_per_call));
  auto gap = [&](int64_t l) {
    const auto end = Clock::now() + std::chrono::microseconds(gap_us);
    if (gap_prefetch > 0 && worker_form) {
      const int64_t g = gap_prefetch == 2 ? (l + n_layers / 2) % n_layers : l;
      const int first = gap_prefetch == 3 ? 1 : 0;
      guess.clear();
      for (int k = first; k < n_per_call; ++k) guess.push_back(&set.experts[static_cast<size_t>(g * n_per_call + k)]);
      if (!guess.empty()) ffn.prefetch_experts(guess, n_tok, pool, [](const void* c) { return Clock::now() >= *static_cast<const Clock::time_point*>(c); }, &end);
    }
    std::this_thread::sleep_until(end);
  };
  layer(n_layers - 1);  // warm-up (scratch sized, threads awake); the sweep starts at layer 0
  const uint64_t sleeps0 = pool.sleeps();
  const auto t0 = Clock::now();
  int64_t done = 0;
  double s = 0.0, busy = 0.0;
  std::vector<double> call_us;
  cpu::FfnPhaseTrace trace;
  std::vector<CallPhases> phases;
  if (phase_trace) ffn.set_phase_trace(&trace);
  do {
    if (gap_us > 0) {
      for (int64_t l = 0; l < n_layers; ++l) {
        gap(l);
        const auto c0 = Clock::now();
        layer(l);
        const double c = std::chrono::duration<double>(Clock::now() - c0).count();
        busy += c;
        call_us.push_back(1e6 * c);
        if (phase_trace) phases.push_back(call_phases(trace));
      }
    } else {
      for (int64_t l = 0; l < n_layers; ++l) layer(l);
    }
    done += n_layers;
    s = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (s < min_seconds);
  if (gap_us > 0) s = busy;
  Point p;
  if (!call_us.empty()) {
    std::sort(call_us.begin(), call_us.end());
    p.p50_us = call_us[call_us.size() / 2];
    p.p90_us = call_us[call_us.size() * 9 / 10];
  }
  p.phases = phase_report(phases);
  p.format = std::string(type_name(t));
  p.tokens = n_tok;
  p.layers = done;
  p.seconds = s;
  p.sleeps_per_call = static_cast<double>(pool.sleeps() - sleeps0) / static_cast<double>(done);
  p.gbps = static_cast<double>(done) * n_per_call * static_cast<double>(set.expert_bytes) / s / 1e9;
  return p;
}

// The kernels' compute ceiling: GB/s of one worker running matvec_tokens over the first
// expert's gate rows [0, kCeilingRows) (at most a few hundred KB: L2-resident after the first
// pass), per CPU second of that worker. Times the thread count, it says whether the cores could
// consume DRAM bandwidth at all: when the layer's GB/s stays far below both this and the DRAM
// figure, the time goes to memory behaviour or the pool, not to the kernels.
constexpr int64_t kCeilingRows = 256;

double core_ceiling(const ExpertSet& set, TensorType t, int n_tok, double min_seconds, const cpu::MatvecTuning& mt, cpu::ThreadPool& pool) {
  const cpu::ExpertWeights& w = set.experts.front();
  const TensorType at = dot_activation_type(t);
  const size_t arb = row_bytes(at, kHidden);
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(kHidden));
  std::vector<uint8_t> acts(arb * static_cast<size_t>(n_tok));
  for (int i = 0; i < n_tok; ++i) {
    for (float& v : x) v = dist(rng);
    cpu::quantize_activation_row(at, x.data(), acts.data() + static_cast<size_t>(i) * arb, kHidden);
  }
  std::vector<float> y(static_cast<size_t>(n_tok * kCeilingRows));
  const double bytes = static_cast<double>(row_bytes(t, kHidden)) * kCeilingRows;
  double gbps = 0.0;
  pool.run(1, [&](int64_t, int) {
    auto cpu_now = [] {
      timespec ts;
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
      return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
    };
    cpu::matvec_tokens(t, kHidden, w.gate, 0, kCeilingRows, acts.data(), arb, nullptr, n_tok, y.data(), kCeilingRows, mt);  // into L2
    const double t0 = cpu_now();
    int64_t reps = 0;
    double s = 0.0;
    do {
      cpu::matvec_tokens(t, kHidden, w.gate, 0, kCeilingRows, acts.data(), arb, nullptr, n_tok, y.data(), kCeilingRows, mt);
      ++reps;
      s = cpu_now() - t0;
    } while (s < min_seconds);
    gbps = bytes * static_cast<double>(reps) / s / 1e9;
  });
  return gbps;
}

// The same L2-resident matvec on every worker at once, for `seconds` of wall time: GB/s of all
// of them together. Against [core L2] x threads it shows what running every CPU costs each one
// (SMT siblings sharing a core, an all-core clock): the kernels' real compute ceiling.
double all_cores_ceiling(const ExpertSet& set, TensorType t, int n_tok, double seconds, const cpu::MatvecTuning& mt, cpu::ThreadPool& pool) {
  const TensorType at = dot_activation_type(t);
  const size_t arb = row_bytes(at, kHidden);
  std::vector<uint8_t> acts(arb * static_cast<size_t>(n_tok), 0);
  std::vector<float> x(static_cast<size_t>(kHidden), 0.5f);
  for (int i = 0; i < n_tok; ++i) cpu::quantize_activation_row(at, x.data(), acts.data() + static_cast<size_t>(i) * arb, kHidden);
  const int n = pool.size();
  std::vector<std::vector<float>> y(static_cast<size_t>(n), std::vector<float>(static_cast<size_t>(n_tok * kCeilingRows)));
  std::vector<int64_t> reps(static_cast<size_t>(n) * 8, 0), ends(static_cast<size_t>(n));
  for (int w = 0; w < n; ++w) ends[static_cast<size_t>(w)] = w + 1;
  const auto until = Clock::now() + std::chrono::duration<double>(seconds);
  const auto t0 = Clock::now();
  pool.run_sliced(ends.data(), [&](int64_t job, int w) {
    const cpu::ExpertWeights& ew = set.experts[static_cast<size_t>(job) % set.experts.size()];
    float* out = y[static_cast<size_t>(w)].data();
    do {
      cpu::matvec_tokens(t, kHidden, ew.gate, 0, kCeilingRows, acts.data(), arb, nullptr, n_tok, out, kCeilingRows, mt);
      ++reps[static_cast<size_t>(job) * 8];
    } while (Clock::now() < until);
  });
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  int64_t total = 0;
  for (int w = 0; w < n; ++w) total += reps[static_cast<size_t>(w) * 8] - 1;  // the first pass fills L2
  return static_cast<double>(row_bytes(t, kHidden)) * kCeilingRows * static_cast<double>(total) / s / 1e9;
}

// The first CPU's kernel rate with each other CPU running the same kernel beside it, as a share
// of its rate alone. A hypervisor may show SMT siblings as separate cores; a sibling halves the
// rate (~0.5-0.65), a separate core leaves it (~0.95-1).
std::vector<double> smt_probe(const ExpertSet& set, TensorType t, const std::vector<int>& cpus, const cpu::MatvecTuning& mt) {
  const TensorType at = dot_activation_type(t);
  const size_t arb = row_bytes(at, kHidden);
  std::vector<uint8_t> acts(arb, 0);
  std::vector<float> x(static_cast<size_t>(kHidden), 0.5f);
  cpu::quantize_activation_row(at, x.data(), acts.data(), kHidden);
  auto spin_on = [&](int cpu, std::atomic<int>& go, std::atomic<int>& stop, double* rate) {
    cpu_set_t cs;
    CPU_ZERO(&cs);
    CPU_SET(cpu, &cs);
    pthread_setaffinity_np(pthread_self(), sizeof cs, &cs);
    std::vector<float> y(kCeilingRows);
    while (!go.load()) {
    }
    const auto t0 = Clock::now();
    int64_t reps = 0;
    while (!stop.load(std::memory_order_relaxed)) {
      cpu::matvec_tokens(t, kHidden, set.experts.front().gate, 0, kCeilingRows, acts.data(), arb, nullptr, 1, y.data(), kCeilingRows, mt);
      ++reps;
    }
    if (rate) *rate = static_cast<double>(reps) / std::chrono::duration<double>(Clock::now() - t0).count();
  };
  auto run_pair = [&](int other) {
    std::atomic<int> go{0}, stop{0};
    double rate = 0.0;
    std::thread a([&] { spin_on(cpus.front(), go, stop, &rate); });
    std::thread b;
    if (other >= 0) b = std::thread([&] { spin_on(other, go, stop, nullptr); });
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    go = 1;
    std::this_thread::sleep_for(std::chrono::milliseconds(40));
    stop = 1;
    a.join();
    if (b.joinable()) b.join();
    return rate;
  };
  const double alone = run_pair(-1);
  std::vector<double> share;
  for (size_t j = 1; j < cpus.size(); ++j) share.push_back(run_pair(cpus[j]) / alone);
  return share;
}

// Microseconds per job list of size() empty jobs: back to back, and each after gap_us of the
// caller sleeping (the decode pattern: do the workers wake in time?).
std::pair<double, double> list_overhead_us(cpu::ThreadPool& pool, int gap_us) {
  std::atomic<int64_t> sink{0};
  auto one = [&] { pool.run(pool.size(), [&](int64_t i, int) { sink.fetch_add(i, std::memory_order_relaxed); }); };
  for (int i = 0; i < 100; ++i) one();
  auto t0 = Clock::now();
  constexpr int kBack = 2000, kGapped = 200;
  for (int i = 0; i < kBack; ++i) one();
  const double back = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / kBack;
  double gapped = 0.0;
  for (int i = 0; i < kGapped; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
    t0 = Clock::now();
    one();
    gapped += std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  }
  return {back, gapped / kGapped};
}

}  // namespace

void add_cpu_subcommand(CLI::App& app, CpuBenchOptions& opt) {
  CLI::App* cpu = app.add_subcommand("cpu", "CPU expert FFN GB/s per format at 1, 4, 16 tokens vs the DRAM read bandwidth");
  cpu->add_flag("--json", opt.json, "print one JSON object instead of the table");
  cpu->add_option("--threads", opt.threads, "worker threads, one per physical core from the first (default: all physical cores)")
      ->check(CLI::PositiveNumber);
  cpu->add_option("--cpus", opt.cpus, "explicit CPU list for the workers, e.g. 0-7 (overrides --threads)");
  cpu->add_option("--isa", opt.isa, "cap the kernel tier")->check(CLI::IsMember({"scalar", "avx2", "avx512", "avx512vnni", "amx"}));
  cpu->add_option("--set-mib", opt.set_mib, "distinct expert bytes per format, MiB (keep it far above the LLC)")
      ->check(CLI::Range(16, 1 << 20));
  cpu->add_option("--formats", opt.formats, "weight formats")->delimiter(',');
  cpu->add_option("--tokens", opt.tokens, "tokens per layer call")->delimiter(',')->check(CLI::Range(1, 4096));
  cpu->add_option("--amx-min-tokens", opt.amx_min_tokens, "token count from which matvec takes the AMX path (AMX CPUs; default 32)")
      ->check(CLI::Range(1, 4096));
  cpu->add_option("--prefetch-l1", opt.prefetch_l1, "matvec prefetcht0 distance in bytes (0: no software prefetch; default: the "
                  "library's)")->check(CLI::Range(0, 1 << 20));
  cpu->add_option("--prefetch-spread-l1", opt.prefetch_spread_l1, "the packed tiles' spread prefetcht0 distance in bytes (default: the "
                  "library's)")->check(CLI::Range(64, 1 << 20));
  cpu->add_option("--probe-chunk-kib", opt.probe_chunk_kib, "also measure the DRAM read in chunks of this many KiB (0: not)")
      ->check(CLI::Range(0, 1 << 20));
  cpu->add_option("--tile-mxfp4", opt.tile_mxfp4, "1: MXFP4 through the VBMI four-block tile (where the CPU has VBMI); 0: the "
                  "block-pair tile (default: the library's)")->check(CLI::Range(0, 1));
  cpu->add_option("--tile-q4k", opt.tile_q4k, "1: Q4_K through the GFNI tile against repacked activations (where the CPU has "
                  "GFNI); 0: the older tile (default: the library's)")->check(CLI::Range(0, 1));
  cpu->add_option("--tile-q8-0", opt.tile_q8_0, "1: Q8_0 through the VBMI four-block tile (where the CPU has VBMI); 0: the "
                  "block-pair tile (default: the library's)")->check(CLI::Range(0, 1));
  // Huge pages by default: the expert arena asks for 2 MiB pages too (common/shm/page_backing.h).
  cpu->add_flag("--huge-pages,!--small-pages", opt.huge_pages,
                "back the expert set and the DRAM probe with transparent huge pages (madvise; the default) or small pages");
  cpu->add_option("--spin-us", opt.spin_us, "how long pool workers and the caller poll after a list before they sleep (default: "
                  "cpu::kDecodeSpinUs, the worker's)")->check(CLI::Range(0, 1000000));
  cpu->add_flag("--caller-joins,!--caller-waits", opt.caller_joins,
                "the bench's thread runs jobs as worker 0 on the first CPU (the default, as the worker does) or only waits");
  cpu->add_option("--gap-us", opt.gap_us, "idle microseconds between layer calls (decode's GPU part; not timed)")->check(CLI::Range(0, 100000));
  cpu->add_flag("--smt-probe", opt.smt_probe, "print the first CPU's kernel rate beside each other CPU (hidden SMT siblings)");
  cpu->add_option("--experts-per-call", opt.experts_per_call, "experts of one token per layer call, a row each (default 8, a token's "
                  "top-k; the 12 GB worker gets 1-3), e.g. 1,2,3,8")->delimiter(',')->check(CLI::Range(1, kMaxExpertsPerCall));
  cpu->add_flag("--worker-form,!--accumulate-form", opt.worker_form, "call run_experts with each expert writing its own rows, as "
                "the cpu_expert_worker does (default: run(), accumulating into one y)");
  cpu->add_option("--slice-split", opt.slice_split, "jobs per thread and phase; idle threads take the last ones of slower threads "
                  "(default: the library's)")->check(CLI::Range(1, 8));
  cpu->add_option("--slice-per-expert", opt.slice_per_expert, "1: each thread gets its share of every expert (rows independent of the "
                  "call's other experts, as the cpu_expert_worker runs it); 0: its share of all experts' rows end to end (default: the library's)")
      ->check(CLI::Range(0, 1));
  cpu->add_flag("--phase-trace", opt.phase_trace, "with --gap-us: print where each row's calls spend their time (per-worker phase "
                "times from the call's start, medians over the calls; a few clock reads per job)");
  cpu->add_option("--gap-prefetch", opt.gap_prefetch, "with --gap-us and --worker-form: during each gap, MoeFfn::prefetch_experts of the "
                  "next call's experts (1: a right guess), of other experts (2: a wrong guess) or of the next call's but its first (3: one "
                  "missed) until the gap ends; 0: none")->check(CLI::Range(0, 3));
  cpu->add_option("--min-seconds", opt.min_seconds, "minimum time per measurement")->check(CLI::Range(0.0, 60.0));
}

namespace {

// The kernels' tuning the options ask for (the library's defaults where they leave it).
cpu::CpuKernelTuning tuning_of(const CpuBenchOptions& opt) {
  cpu::CpuKernelTuning tu;
  if (!opt.isa.empty()) tu.matvec.max_isa = *cpu::parse_isa(opt.isa);
  if (opt.amx_min_tokens > 0) tu.matvec.amx_min_tokens = opt.amx_min_tokens;
  if (opt.prefetch_l1 >= 0) tu.matvec.prefetch.l1_bytes = static_cast<size_t>(opt.prefetch_l1);
  if (opt.prefetch_spread_l1 > 0) tu.matvec.prefetch.spread_l1_bytes = static_cast<size_t>(opt.prefetch_spread_l1);
  if (opt.tile_mxfp4 >= 0) tu.matvec.tiles.mxfp4_vbmi = opt.tile_mxfp4 == 1;
  if (opt.tile_q4k >= 0) tu.matvec.tiles.q4_k_gfni = opt.tile_q4k == 1;
  if (opt.tile_q8_0 >= 0) tu.matvec.tiles.q8_0_vbmi = opt.tile_q8_0 == 1;
  if (opt.slice_split > 0) tu.slices.split = opt.slice_split;
  if (opt.slice_per_expert >= 0) tu.slices.per_expert = opt.slice_per_expert == 1;
  return tu;
}

// The table's header lines: the machine, the tuning and the probes.
void print_header(const CpuBenchOptions& opt, const cpu::CpuKernelTuning& tu, const cpu::ThreadPool& pool, const std::vector<int>& cpus, int node,
                  double dram, double dram_chunked, std::pair<double, double> list_us, int list_gap_us) {
  std::string experts_list;
  for (int n : opt.experts_per_call) experts_list += (experts_list.empty() ? "" : ",") + std::to_string(n);
  const cpu::MatvecTuning& mt = tu.matvec;
  std::printf("moraine-kernel-bench cpu: %d threads on CPUs %s (node %d), isa %s, expert set %d MiB per format, AMX from %d tokens\n",
              pool.size(), cpu::format_cpu_list(cpus).c_str(), node, std::string(cpu::isa_name(cpu::capped_isa(mt.max_isa))).c_str(), opt.set_mib,
              mt.amx_min_tokens);
  std::printf("shape: hidden %lld, ffn %lld, %s experts per layer call (gate+up+down fused, %s); slices split %d per expert %d; prefetch l1 %zu B, "
              "spread %zu B; spin %d us; caller %s; gap %d us; huge pages %s; tiles mxfp4-vbmi %d q4k-gfni %d q8_0-vbmi %d\n",
              static_cast<long long>(kHidden), static_cast<long long>(kFfn), experts_list.c_str(), opt.worker_form ? "worker form" : "accumulating",
              tu.slices.split, tu.slices.per_expert ? 1 : 0, mt.prefetch.l1_bytes, mt.prefetch.spread_l1_bytes, pool.spin_us(),
              opt.caller_joins ? "joins" : "waits", opt.gap_us, opt.huge_pages ? "asked (madvise)" : "no", mt.tiles.mxfp4_vbmi ? 1 : 0,
              mt.tiles.q4_k_gfni ? 1 : 0, mt.tiles.q8_0_vbmi ? 1 : 0);
  if (opt.gap_prefetch > 0)
    std::printf("gap prefetch: %s\n", opt.gap_prefetch == 1   ? "the next call's experts (right guess)"
                                      : opt.gap_prefetch == 2 ? "other experts (wrong guess)"
                                                              : "the next call's experts but its first (one missed)");
  std::printf("DRAM read bandwidth (streaming, same threads): %.1f GB/s\n", dram);
  if (opt.probe_chunk_kib > 0) std::printf("DRAM read in %d KiB chunks (an expert job's stream length): %.1f GB/s\n", opt.probe_chunk_kib, dram_chunked);
  std::printf("pool list of %d empty jobs: %.1f us back to back, %.1f us after %d us idle\n", pool.size(), list_us.first, list_us.second,
              list_gap_us);
  std::printf("[core L2]: one worker's matvec GB/s on %lld L2-resident rows per CPU second; {all}: every worker at once, GB/s "
              "together (the compute ceiling)\n\n",
              static_cast<long long>(kCeilingRows));
  std::printf("%-7s %8s %14s", "format", "exp/call", "bytes/expert");
  for (int t : opt.tokens) std::printf("   %3d tok GB/s (share) us/call [core L2] {all}", t);
  std::printf("\n");
  std::fflush(stdout);
}

}  // namespace

int run_cpu_bench(const CpuBenchOptions& opt) {
  const cpu::CpuKernelTuning tuning = tuning_of(opt);
  std::vector<int> cpus = opt.cpus.empty() ? cpu::physical_core_cpus() : cpu::parse_cpu_list(opt.cpus);
  if (opt.cpus.empty() && opt.threads > 0) {
    if (opt.threads > static_cast<int>(cpus.size())) {
      throw std::invalid_argument("--threads " + std::to_string(opt.threads) + ": this process has " + std::to_string(cpus.size()) +
                                  " physical cores");
    }
    cpus.resize(static_cast<size_t>(opt.threads));
  }
  std::vector<TensorType> types;
  for (const std::string& f : opt.formats) {
    const auto t = type_from_name(f);
    if (!t || !cpu::best_vec_dot_fn(*t) || *t == TensorType::Q8_K) throw std::invalid_argument("--formats: no CPU kernel for '" + f + "'");
    types.push_back(*t);
  }
  cpu::ThreadPool pool(cpus, {opt.spin_us >= 0 ? opt.spin_us : cpu::kDecodeSpinUs, opt.caller_joins});
  if (opt.caller_joins) pool.pin_caller();
  const int node = cpu::numa_node_of_cpu_id(cpus.front());
  const size_t set_bytes = static_cast<size_t>(opt.set_mib) << 20;

  double dram = 0.0, dram_chunked = 0.0;
  {
    cpu::NodeMemory buf(set_bytes, node, opt.huge_pages);
    dram = cpu::measure_read_bandwidth(pool, buf.data(), buf.size(), 3) / 1e9;
    if (opt.probe_chunk_kib > 0) {
      dram_chunked = cpu::measure_read_bandwidth(pool, buf.data(), buf.size(), 3, static_cast<size_t>(opt.probe_chunk_kib) << 10) / 1e9;
    }
  }
  const int list_gap_us = opt.gap_us > 0 ? opt.gap_us : 250;
  const std::pair<double, double> list_us = list_overhead_us(pool, list_gap_us);
  std::vector<double> smt;
  if (!opt.json) print_header(opt, tuning, pool, cpus, node, dram, dram_chunked, list_us, list_gap_us);
  nlohmann::json rows = nlohmann::json::array();
  for (TensorType t : types) {
    const size_t huge_before = anon_huge_bytes();
    const ExpertSet set = make_expert_set(t, set_bytes, node, opt.huge_pages);
    // The share of the set the kernel backed with huge pages (other memory of this process
    // does not change while the set is built).
    const double huge_share = static_cast<double>(anon_huge_bytes() - std::min(anon_huge_bytes(), huge_before)) /
                              static_cast<double>(set.memory.size());
    if (opt.smt_probe && t == types.front()) {
      smt = smt_probe(set, t, cpus, tuning.matvec);
      if (!opt.json) {
        std::printf("smt probe (%s, CPU %d's kernel rate beside each CPU, share of alone):", std::string(type_name(t)).c_str(), cpus.front());
        for (size_t j = 0; j < smt.size(); ++j) std::printf(" %d:%.2f", cpus[j + 1], smt[j]);
        std::printf("\n");
        std::fflush(stdout);
      }
    }
    // The ceilings do not depend on the experts per call: measured once per token count.
    std::vector<std::pair<double, double>> ceilings;
    for (int n_tok : opt.tokens) {
      ceilings.emplace_back(core_ceiling(set, t, n_tok, std::min(opt.min_seconds, 0.1), tuning.matvec, pool),
                            all_cores_ceiling(set, t, n_tok, std::min(opt.min_seconds, 0.1), tuning.matvec, pool));
    }
    std::string phase_lines;
    for (int n_per_call : opt.experts_per_call) {
      if (!opt.json) std::printf("%-7s %8d %14zu", std::string(type_name(t)).c_str(), n_per_call, set.expert_bytes);
      for (size_t ti = 0; ti < opt.tokens.size(); ++ti) {
        const int n_tok = opt.tokens[ti];
        const Point p = measure(set, t, n_tok, n_per_call, opt.worker_form, opt.min_seconds, opt.gap_us, opt.phase_trace, opt.gap_prefetch, tuning, pool);
        const double us_per_call = 1e6 * p.seconds / static_cast<double>(p.layers);
        const auto [ceiling, all] = ceilings[ti];
        if (!opt.json) {
          std::printf("   %13.1f (%5.1f%%) %7.1f [%5.1f] {%5.1f} sleeps/call %.2f", p.gbps, 100.0 * p.gbps / dram, us_per_call, ceiling, all,
                      p.sleeps_per_call);
          if (p.p50_us > 0) std::printf(" p50 %.1f p90 %.1f us", p.p50_us, p.p90_us);
          std::fflush(stdout);
        }
        rows.push_back({{"format", p.format}, {"tokens", p.tokens}, {"experts_per_call", n_per_call}, {"gb_per_s", p.gbps},
                        {"share_of_dram", p.gbps / dram}, {"us_per_call", us_per_call}, {"core_l2_gb_per_s", ceiling},
                        {"all_cores_l2_gb_per_s", all}, {"expert_bytes", set.expert_bytes}, {"distinct_experts", set.experts.size()},
                        {"layer_calls", p.layers}, {"sleeps_per_call", p.sleeps_per_call}, {"huge_page_share", huge_share}, {"seconds", p.seconds},
                        {"p50_us", p.p50_us}, {"p90_us", p.p90_us}, {"phases", p.phases}});
        if (!p.phases.empty()) phase_lines += p.phases;
      }
      if (!opt.json) {
        if (opt.huge_pages) std::printf("   huge pages %3.0f%%", 100.0 * huge_share);
        std::printf("\n%s", phase_lines.c_str());
      }
      phase_lines.clear();
    }
  }
  if (opt.json) {
    const cpu::MatvecTuning& mt = tuning.matvec;
    const nlohmann::json out = {{"threads", pool.size()},
                                {"cpus", cpu::format_cpu_list(cpus)},
                                {"numa_node", node},
                                {"isa", std::string(cpu::isa_name(cpu::capped_isa(mt.max_isa)))},
                                {"hidden", kHidden},
                                {"ffn", kFfn},
                                {"experts_per_call", opt.experts_per_call},
                                {"worker_form", opt.worker_form},
                                {"slice_per_expert", tuning.slices.per_expert},
                                {"slice_split", tuning.slices.split},
                                {"set_mib", opt.set_mib},
                                {"amx_min_tokens", mt.amx_min_tokens},
                                {"prefetch_l1", mt.prefetch.l1_bytes},
                                {"prefetch_spread_l1", mt.prefetch.spread_l1_bytes},
                                {"tile_mxfp4_vbmi", mt.tiles.mxfp4_vbmi},
                                {"tile_q4k_gfni", mt.tiles.q4_k_gfni},
                                {"tile_q8_0_vbmi", mt.tiles.q8_0_vbmi},
                                {"spin_us", pool.spin_us()},
                                {"caller_joins", opt.caller_joins},
                                {"gap_us", opt.gap_us},
                                {"list_us", list_us.first},
                                {"list_after_gap_us", list_us.second},
                                {"smt_probe", smt},
                                {"huge_pages", opt.huge_pages},
                                {"dram_read_gb_per_s", dram},
                                {"dram_read_chunk_kib", opt.probe_chunk_kib},
                                {"dram_read_chunked_gb_per_s", dram_chunked},
                                {"results", rows}};
    std::cout << out.dump(2) << "\n";
  }
  return 0;
}

}  // namespace moraine::kernel_bench
