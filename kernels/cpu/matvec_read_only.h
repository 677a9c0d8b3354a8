// The pattern probe's stand-in for the matvec arithmetic (moraine-kernel-bench cpu
// --pattern-probe): matvec_tokens and matvec_tokens_runs, while matvec_math() is not Compute,
// read exactly the weight lines they would read, in the same order, and compute nothing. The
// expert FFN around them (its job list, threads, phases and waits) runs unchanged, so a layer
// call's time in this mode is what its access pattern and synchronisation cost on their own;
// beside the kernel's time it splits the gap to the DRAM probe into (a) pattern + sync and (b)
// the arithmetic's stall on memory.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/cpu/matvec.h"

namespace moraine::cpu {

// Rows [row_begin, row_end) of the matrix at w (wb bytes per row): every 64-byte line they touch
// is loaded once (ReadOnlyPrefetch: with prefetcht0 `distance` bytes ahead, as the packed tiles'
// spread stream), and y[t * y_stride + r] = 0 for each row and the n_tok tokens.
void read_rows_only(MatvecMath mode, const void* w, size_t wb, int64_t row_begin, int64_t row_end, int n_tok, float* y, int64_t y_stride,
                    size_t distance);

// The runs of matvec_tokens_runs the same way: their 4-row steps in turn, as the interleaved tiles walk them.
void read_runs_only(MatvecMath mode, size_t wb, const MatvecRun* runs, int n_runs, int n_tok, int64_t y_stride, size_t distance);

}  // namespace moraine::cpu
