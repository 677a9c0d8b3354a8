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
  // The kernels' tuning (cpu::CpuKernelTuning); < 0 (or 0 where noted): the library default.
  int amx_min_tokens = 0;     // 0: the library default (cpu::kPrefillTokens)
  int prefetch_l1 = -1;       // bytes: cpu::MatvecPrefetch::l1_bytes (0: no software prefetch)
  int prefetch_spread_l1 = -1; // bytes: cpu::MatvecPrefetch::spread_l1_bytes
  int tile_q4k = -1;          // 0/1: cpu::MatvecTiles::q4_k_gfni
  int tile_q8_0 = -1;         // 0/1: cpu::MatvecTiles::q8_0_vbmi
  int tile_mxfp4 = -1;        // 0/1: cpu::MatvecTiles::mxfp4_vbmi
  int slice_split = 0;        // >0: cpu::FfnSlices::split (jobs per thread and phase)
  int slice_per_expert = -1;  // 0/1: cpu::FfnSlices::per_expert
  bool huge_pages = true;     // madvise(MADV_HUGEPAGE) on the expert set and the DRAM probe's buffer
  int probe_chunk_kib = 32;   // second DRAM probe with job-sized chunks; 0: off
  int spin_us = -1;           // pool spin after a list (workers and caller); -1: cpu::kDecodeSpinUs
  bool caller_joins = true;   // the bench's thread runs jobs as worker 0 on the first CPU (as the worker does)
  int gap_us = 0;             // idle time between layer calls (decode: the GPU part of a layer); not timed
  bool smt_probe = false;     // which CPUs slow the first one down when both run the kernel (hidden SMT siblings)
  std::vector<int> experts_per_call{8};  // experts of one layer call, one table row each (8: a token's top-k; the 12 GB worker gets 1-3)
  bool worker_form = false;   // call MoeFfn::run_experts (RowsJob, each expert its own rows) as the worker does, not run()
  int gap_prefetch = 0;       // 1/2/3: MoeFfn::prefetch_experts of the next call's (right guess) / other (wrong guess) experts / the next call's but its first, in each gap
  bool phase_trace = false;   // with gap_us > 0: per-worker phase times of every call (cpu::FfnPhaseTrace), medians printed
};

void add_cpu_subcommand(CLI::App& app, CpuBenchOptions& opt);
int run_cpu_bench(const CpuBenchOptions& opt);

}  // namespace moraine::kernel_bench
