// A slice of a weight matrix times a few activation rows: the inner step of the expert FFN.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/formats/tensor_type.h"

namespace moraine::cpu {

// y[t * y_stride + r] = dot(weight row r, activation row t) for r in [row_begin, row_end) and
// t in [0, n_tok). Weight rows are `row_bytes(type, n_cols)` apart from `w`; activation row t
// is at acts + tok[t] * act_row_bytes (tok == nullptr: t itself), already quantized to
// dot_activation_type(type). Rows are taken outermost and tokens innermost, so a weight row is
// read from DRAM once and the other tokens find it in L1: the bytes moved per call do not grow
// with n_tok (the decode / speculative-verify case). Uses the best kernel up to the ISA cap; on
// the VNNI tiers Q2_K..Q6_K, Q8_0 and MXFP4 run as register-blocked tiles of 4 rows x up to 4
// tokens (matvec_avx512.cpp), which unpack each weight block once per token group.
// From amx_min_tokens() (kPrefillTokens) tokens on, on the Amx tier, Q8_0/MXFP4/Q4_K/Q5_K go
// through AMX int8 tiles instead (16 rows x 16 tokens per tile product; matmul_amx.cpp). Every path equals the
// per-row kernels' contract (tests/cpu_kernels).
void matvec_tokens(TensorType type, int64_t n_cols, const void* w, int64_t row_begin, int64_t row_end, const void* acts,
                   size_t act_row_bytes, const int32_t* tok, int n_tok, float* y, int64_t y_stride);

// The same, told where the caller's next matvec_tokens call will start reading (next_bytes
// bytes from `next`): with matvec_prefetch().next_call the software prefetch stream runs on
// from this call's last rows into that region (instead of stopping at row_end), so the next
// call does not begin with a run of demand misses. A hint only: results do not depend on it.
void matvec_tokens(TensorType type, int64_t n_cols, const void* w, int64_t row_begin, int64_t row_end, const void* acts,
                   size_t act_row_bytes, const int32_t* tok, int n_tok, float* y, int64_t y_stride, const void* next, size_t next_bytes);

// One run of rows for matvec_tokens_runs: rows [row_begin, row_end) of the matrix at w, results
// to y[t * y_stride + r] as matvec_tokens writes them.
struct MatvecRun {
  const void* w = nullptr;
  int64_t row_begin = 0, row_end = 0;
  float* y = nullptr;
};
// Bytes matvec_tokens_runs pulls toward L2 (prefetcht1) while it computes, spread evenly over its
// 4-row steps (the expert FFN: a thread's down rows during its gate/up rows).
struct PrefetchRegion {
  const void* p = nullptr;
  size_t bytes = 0;
};

// What matvec_tokens_runs prefetches beyond its runs' own streams. background: pulled toward L2
// (prefetcht1), spread evenly over the 4-row steps. next / next_bytes: where the caller's next
// call starts reading; with matvec_prefetch().next_call 1 the prefetcht0 streams run on into it
// as they reach their ends (up to the per-run distance: no drained pipeline between two calls),
// with 2 its first bytes go to L2 at the start; 0 ignores it.
struct RunsPrefetch {
  const PrefetchRegion* background = nullptr;
  int n_background = 0;
  const void* next = nullptr;
  size_t next_bytes = 0;
};

// Several runs of one type against the same activations, their 4-row steps taken in turn (run
// 0's step, run 1's, ..., then run 0's next), so one thread keeps that many sequential streams
// going instead of one (more lines in flight, one hardware-prefetcher stream per run). Each
// run's results are bitwise matvec_tokens' on that run alone: the same tile for the same 4 rows
// (counted from the run's first row) and the same tail rows. The packed tiles with the spread
// prefetch (matvec_prefetch().spread) interleave, each run with its own prefetcht0 stream
// runs_l1_bytes ahead (and runs_l2_bytes of prefetcht1 further on); other paths take the runs
// one after the other. `extra.background` is pulled into L2 over the steps either way; the
// next-call hint is followed on the interleaved path only. l1_bytes, l2_bytes and past_end are
// not used. The expert FFN takes it through FfnStreamOptions (measurements in expert_ffn.h: the
// gate and up rows of a job as two streams win for Q4_K; four streams, or 1 KB per run, lose).
void matvec_tokens_runs(TensorType type, int64_t n_cols, const MatvecRun* runs, int n_runs, const void* acts, size_t act_row_bytes,
                        const int32_t* tok, int n_tok, int64_t y_stride, const RunsPrefetch& extra = {});

// Measured on the 16-core Xeon (moraine-kernel-bench cpu, expert FFN GB/s at 2 / 4 / 8 / 16
// tokens, VNNI tiles vs the AMX path forced from 2 tokens): Q4_K 53 / 43 / 27 / 15 vs 16 / 14 /
// 12 / 11; Q8_0 68 / 56 / 35 / 20 vs 33 / 31 / 23 / 17; MXFP4 44 / 33 / 18 / 10 vs 16 / 12 /
// 10 / 8. AMX loses at every verify size, so the threshold stays at 32.
inline constexpr int kPrefillTokens = 32;

// Moves the AMX threshold (default kPrefillTokens; clamped to >= 1), process-wide, for A/B runs
// of the decode and verify sizes (4..16 tokens) on AMX machines: the benches' --amx-min-tokens.
// Results are the same either way (every path meets the same contract); only speed changes.
void set_amx_min_tokens(int n_tok);
int amx_min_tokens();

// Software prefetch ahead of the weight rows matvec_tokens streams: prefetcht0 `l1_bytes`
// ahead and prefetcht1 (into L2) `l2_bytes` ahead (0: off). Process-wide, for the benches'
// A/B runs (--prefetch-l1/--prefetch-l2); results do not depend on it. The defaults and the
// measurements that chose them are in matvec.cpp.
// past_end: keep prefetching up to the distance beyond row_end, into the rows that follow. On
// the sliced schedule a thread's next job is usually those rows (the next chunk of the same
// matrix), so its first lines are in flight when it starts instead of a demand miss per call;
// on the shared one the lines usually go to waste.
// next_call: what to do with the next-call hint (the overload above) where the caller gives one
// (the expert FFN does on the sliced schedule, expert_ffn.cpp): 0 ignore it; 1 run the prefetch
// streams on into that region over this call's last rows; 2 prefetch its first max(l1, l2)
// bytes into L2 (prefetcht1) when this call starts, so they have a whole call to arrive.
// spread: the packed tiles (Q4_K GFNI, Q8_0 / MXFP4 VBMI) issue a 4-row step's prefetcht0 lines
// block by block as they compute (Q4_K: 9 lines per super-block) instead of all of them (Q4_K
// 72, Q8_0 136 at 2048 columns) before the step: software prefetches that miss
// wait for one of the core's few L1 fill buffers, and a burst of them stalls the compute behind
// it; spread, they interleave with it, and run 8 KB ahead (spread_l1_bytes; at 4 KB, less than
// a Q4_K 4-row step of 4.6 KB or a Q8_0 one of 8.7 KB, part of a step's lines were asked for
// only just before use). Per-thread memory parallelism was the limit: 4 threads of the 16-core
// Xeon got 5.3-6.5 GB/s each against 12.4 for the plain streaming read and ~21 for the tile on
// L2-resident rows. Measured there (clean run C, worker form, gap 130 us, us per call p50 at
// 1 / 2 / 4 Q4_K experts, two runs each, one job per thread and phase): 15 threads 39.1-41.2 /
// 73.0-73.2 / 131.1-139.7 -> 29.4-38.3 / 50.7-62.3 / 96.8-115.0; 4 threads at 4 experts 307 ->
// 286. Other tiles keep l1_bytes and their burst.
struct MatvecPrefetch {
  size_t l1_bytes = 4096;
  size_t l2_bytes = 0;
  bool past_end = false;
  int next_call = 0;
  bool spread = true;
  size_t spread_l1_bytes = 8192;  // the spread path's prefetcht0 distance (it replaces l1_bytes there)
  size_t runs_l1_bytes = 0;       // matvec_tokens_runs: each run's prefetcht0 distance (0: spread_l1_bytes / runs, >= 2 KB)
  // matvec_tokens_runs: each run's prefetcht1 (L2) stream this far ahead (0: none), ramped up at
  // most two steps' lines per step (no burst at a run's start); the expert FFN takes the runs
  // path whenever it is set. H200 host, Q4_K, 15 threads, p50 us at 1 / 2 / 4 / 8 experts (run
  // B, 2 rounds): 16 KB 37.2 / 61.5 / 108.1 / 199.7, 32 KB with 2 KB prefetcht0 37.7 / 63.0 /
  // 115.5 / 208.1, against 39.4 / 62.4 / 113.0 / 210.4 without: within the noise, so off. With
  // the 12G group's short gap (37 us, so the gap prefetch is cut short and the call's later rows
  // are cold; session 16 run L, --gap-us 37 --gap-prefetch 1 --cpus 1-15, p50 us at 3 / 4 experts,
  // two rounds): none 64.0 / 84.3 and 66.1 / 88.4, 16 KB 84.6 / 110.8 and 70.6 / 93.3, 64 KB 77.5 /
  // 105.7 and 77.9 / 102.2, 256 KB 76.6 / 105.1 and 74.9 / 102.8; in the 12G group (interleaved)
  // 158.5 / 162.8 tok/s without, 153.3 / 136.6 at 64 KB, 131.9 / 148.5 at 256 KB: still off.
  size_t runs_l2_bytes = 0;
};
void set_matvec_prefetch(MatvecPrefetch p);
MatvecPrefetch matvec_prefetch();

// The newer register tiles matvec_tokens may take, process-wide, for the benches' A/B runs
// (--tile-*); each falls back to the older tile when off or when the CPU lacks what it needs.
// Results meet the same contract either way. mxfp4_vbmi / q8_0_vbmi: MXFP4 (vpermb lookups) and
// Q8_0 four blocks per step against activations repacked per call (matvec_avx512_groups4.cpp;
// AVX-512 VBMI).
// q4_k_gfni: Q4_K with gf2p8affineqb nibble unpacking against activations repacked per call
// (matvec_avx512_q4k.cpp; GFNI). Both are on by default: one Zen 5 core, matvec_tokens over 256
// L2-resident rows of 2048 (moraine-kernel-bench cpu --threads 1, [core L2] GB/s per CPU second,
// median of 3, older -> newer tile at 1 / 4 / 16 tokens): Q4_K 39.4 -> 49.5 / 17.8 -> 20.7 /
// 4.8 -> 5.5; MXFP4 30.0 -> 49.3 / 12.7 -> 22.6 / 3.3 -> 5.9. The 16-core Xeon numbers are in
// the files' headers.
// rows4: the register tiles at all (off: every row through the per-row kernel, one row's bytes
// after the other: an A/B of the tiles' four interleaved row streams against the hardware
// prefetchers). row_by_row: the four-block tiles (MXFP4, Q8_0) take a tile's four rows one
// after the other instead of side by side (the same arithmetic; each row's bytes in order).
struct MatvecTiles {
  bool mxfp4_vbmi = true;
  bool q4_k_gfni = true;
  bool q8_0_vbmi = true;
  bool rows4 = true;
  bool row_by_row = false;
};
void set_matvec_tiles(MatvecTiles t);
MatvecTiles matvec_tiles();

// What matvec_tokens / matvec_tokens_runs do with the rows, process-wide: Compute (the default),
// or for the benches' pattern probe (--pattern-probe, matvec_read_only.h) only read the lines
// they would read and write zeros: ReadOnly with plain loads, ReadOnlyPrefetch with the packed
// tiles' prefetcht0 stream (MatvecPrefetch::spread_l1_bytes ahead) as well.
enum class MatvecMath { Compute, ReadOnly, ReadOnlyPrefetch };
void set_matvec_math(MatvecMath m);
MatvecMath matvec_math();

// Whether matvec_tokens takes the AMX path for this type and token count right now.
bool matvec_uses_amx(TensorType type, int n_tok);

}  // namespace moraine::cpu
