// `moraine-kernel-bench cpu`: expert FFN throughput (GB/s of expert weight bytes consumed) per
// format and token count, beside the DRAM read bandwidth measured with the same threads.
#pragma once
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace moraine::kernel_bench {

struct CpuBenchOptions {
  bool json = false;
  int threads = 0;           // 0: one per physical core
  std::string cpus;          // explicit CPU list (overrides threads)
  std::string isa;           // cap; empty = best the CPU has
  int set_mib = 1024;        // distinct expert bytes cycled per format; >> LLC
  std::vector<std::string> formats{"q4_k", "q5_k", "q6_k", "q8_0", "q2_k", "q3_k", "mxfp4"};
  std::vector<int> tokens{1, 4, 16};
  double min_seconds = 0.25;  // per measurement point
  int amx_min_tokens = 0;     // 0: the library default (cpu::kPrefillTokens)
  int prefetch_l1 = -1;       // bytes; -1: the library default (cpu::MatvecPrefetch)
  int prefetch_l2 = -1;
  int prefetch_past_end = -1;  // 0/1; -1: the library default
  int prefetch_spread = -1;    // 0/1: cpu::MatvecPrefetch::spread (the packed tiles' prefetches block by block); -1: the library default
  int prefetch_spread_l1 = -1; // bytes: cpu::MatvecPrefetch::spread_l1_bytes; -1: the library default
  int prefetch_next = -1;      // 0/1/2: the expert FFN's next-call prefetch hints (cpu::MatvecPrefetch); -1: the library default
  int gate_up_rows = 0;       // 0: the library default (cpu::FfnJobRows)
  int down_rows = 0;
  bool huge_pages = true;     // madvise(MADV_HUGEPAGE) on the expert set and the DRAM probe's buffer
  int probe_chunk_kib = 32;   // second DRAM probe with job-sized chunks; 0: off
  int spin_us = -1;           // pool spin after a list (workers and caller); -1: cpu::kDecodeSpinUs
  bool caller_joins = true;   // the bench's thread runs jobs as worker 0 on the first CPU (as the worker does)
  int gap_us = 0;             // idle time between layer calls (decode: the GPU part of a layer); not timed
  bool smt_probe = false;     // which CPUs slow the first one down when both run the kernel (hidden SMT siblings)
  int tile_q4k = -1;          // 0/1: Q4_K's GFNI tile against repacked activations; -1: the library default
  int tile_row_by_row = -1;   // 1: the four-block tiles take their rows one after the other; -1: the library default
  int tile_rows4 = -1;        // 0: no register tiles (per-row kernels only); -1: the library default
  int tile_q8_0 = -1;         // 0/1: Q8_0's VBMI four-block tile; -1: the library default
  int tile_mxfp4 = -1;        // 0/1: MXFP4's VBMI four-block tile (cpu::MatvecTiles); -1: the library default
  std::string schedule;       // shared / sliced; empty: the library default (cpu::FfnSchedule)
  std::vector<int> experts_per_call{8};  // experts of one layer call, one table row each (8: a token's top-k; the 12 GB worker gets 1-3)
  bool worker_form = false;   // call MoeFfn::run_experts (RowsJob, each expert its own rows) as the worker does, not run()
  int balanced_slices = -1;   // 0/1: cpu::FfnSliceOptions::balanced; -1: the library default
  int wait_prefetch = -1;     // 0/1: cpu::FfnSliceOptions::wait_prefetch; -1: the library default
  int slice_split = 0;        // >0: cpu::FfnSliceOptions::split (jobs per thread and phase); 0: the library default
  int balanced_accumulate = -1;  // 0/1: cpu::FfnSliceOptions::accumulating (balanced slices for run()'s accumulating form); -1: the library default
  int slice_per_expert = -1;  // 0/1: cpu::FfnSliceOptions::per_expert; -1: the library default
  int gate_up_first = -1;     // 0/1: cpu::FfnSliceOptions::gate_up_first (the balanced list in two phases); -1: the library default
  int stream_runs = 0;        // >0: cpu::FfnStreamOptions::runs (each matrix's rows of a job as that many side-by-side runs); 0: the library default
  int down_runs = -1;         // >=0: cpu::FfnStreamOptions::down_runs (down jobs' runs; 0: as --runs); -1: the library default
  int gate_up_together = -1;  // 0/1/2: cpu::FfnStreamOptions::gate_up_together (never / always / Q4_K only); -1: the library default
  int down_early = -1;        // 0/1: cpu::FfnStreamOptions::down_early (a thread's down share toward L2 during its gate/up jobs); -1: the library default
  int down_early_bytes = -1;  // bytes of each down job pulled early (0: all); -1: the library default
  int prefetch_runs_l2 = -1;  // bytes: cpu::MatvecPrefetch::runs_l2_bytes (each run's prefetcht1 stream; 0: none); -1: the library default
  int prefetch_runs_l1 = -1;  // bytes: cpu::MatvecPrefetch::runs_l1_bytes (each run's prefetcht0 distance; 0: spread / runs); -1: the library default
  int gap_prefetch = 0;       // 1/2/3: MoeFfn::prefetch_experts of the next call's (right guess) / other (wrong guess) experts / the next call's but its first, in each gap
  std::string matvec_math;    // compute / read-only / read-only-pf (cpu::MatvecMath) for the table's calls; empty: compute
  int pattern_rounds = 0;     // >0: per row, this many interleaved rounds of kernel / pattern probe (cpu::MatvecMath) / plain probe
  bool phase_trace = false;   // with gap_us > 0: per-worker phase times of every call (cpu::FfnPhaseTrace), medians printed
};

void add_cpu_subcommand(CLI::App& app, CpuBenchOptions& opt);
int run_cpu_bench(const CpuBenchOptions& opt);

}  // namespace moraine::kernel_bench
