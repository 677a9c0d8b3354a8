// What a caller of the CPU expert kernels may choose: one value, passed down (MoeFfn holds a copy,
// matvec_tokens takes the matvec part). No setting is process-wide. The defaults are the
// production choices; the measurements behind them are in docs/perf-log.md ("CPU expert kernels").
#pragma once
#include <cstddef>

#include "kernels/cpu/vec_dot.h"

namespace moraine::cpu {

// From this many tokens matvec_tokens takes the AMX tiles on the Amx tier: below it the VNNI
// tiles were faster at every verify size on the one AMX host measured (Q4_K 15 vs 11 GB/s at 16 tokens).
inline constexpr int kPrefillTokens = 32;

// Software prefetch distances ahead of the weight rows (results never depend on them).
struct MatvecPrefetch {
  // prefetcht0 this far ahead, issued before each 4-row step: the per-row kernels and the older
  // tiles (16-core Xeon, Q4_K at 1 token: none 48, 4 KB 65 GB/s). 0: no software prefetch.
  size_t l1_bytes = 4096;
  // The packed tiles (Q4_K GFNI, Q8_0 / MXFP4 VBMI) issue their prefetcht0 lines block by block
  // while they compute, this far ahead (a burst of a whole step's lines stalled the compute:
  // Q4_K p50 at 1 expert 39.1-41.2 -> 29.4-38.3 us). Used when l1_bytes is not 0.
  size_t spread_l1_bytes = 8192;
};

// The newer register tiles; each falls back to the older tile when off or when the CPU lacks
// the instructions (off: to test on a CPU that has them the tiles other CPUs run).
struct MatvecTiles {
  bool mxfp4_vbmi = true;  // MXFP4 four blocks per step, vpermb lookups (AVX-512 VBMI)
  bool q4_k_gfni = true;   // Q4_K nibbles unpacked with gf2p8affineqb (GFNI)
  bool q8_0_vbmi = true;   // Q8_0 four blocks per step (AVX-512 VBMI)
};

struct MatvecTuning {
  // The highest kernel tier the dispatch may pick (the host's tier is the limit anyway):
  // below the host's, to test the fallback tiers or to compare them (the benches' --isa).
  CpuIsa max_isa = CpuIsa::Amx;
  // Token count from which the AMX tiles are used (clamped to >= 1); host-dependent.
  int amx_min_tokens = kPrefillTokens;
  MatvecPrefetch prefetch;
  MatvecTiles tiles;
};

// How the expert FFN cuts a layer's rows into per-thread jobs (results never depend on it).
struct FfnSlices {
  // Jobs per thread and phase (1..8): a thread done early takes the last jobs of slower ones
  // (H200 host, Q4_K at 1 expert: 1 job 39.1-41.2 us, 4 jobs 35.1-36.3, 8 jobs 35.7-40.4).
  int split = 4;
  // Each thread takes its share of every expert (per expert) instead of its share of all the
  // experts' rows end to end: then the rows a thread reads do not depend on the call's other
  // experts, so an idle-time prefetch of a guessed set lands in the L2 that reads it (the
  // cpu_expert_worker sets it: 12G decode 190 vs 170 tok/s with its prefetch, level without).
  bool per_expert = false;
};

struct CpuKernelTuning {
  MatvecTuning matvec;
  FfnSlices slices;
};

}  // namespace moraine::cpu
