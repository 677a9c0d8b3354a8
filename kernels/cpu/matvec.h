// A slice of a weight matrix times a few activation rows: the inner step of the expert FFN.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/formats/tensor_type.h"
#include "kernels/cpu/cpu_kernel_tuning.h"

namespace moraine::cpu {

// y[t * y_stride + r] = dot(weight row r, activation row t) for r in [row_begin, row_end) and
// t in [0, n_tok). Weight rows are `row_bytes(type, n_cols)` apart from `w`; activation row t
// is at acts + tok[t] * act_row_bytes (tok == nullptr: t itself), already quantized to
// dot_activation_type(type). Rows are taken outermost and tokens innermost, so a weight row is
// read from DRAM once and the other tokens find it in L1: the bytes moved per call do not grow
// with n_tok (the decode / speculative-verify case). Uses the best kernel up to tuning.max_isa;
// on the VNNI tiers Q2_K..Q6_K, Q8_0 and MXFP4 run as register-blocked tiles of 4 rows x up to
// 4 tokens (matvec_avx512.cpp), which unpack each weight block once per token group.
// From tuning.amx_min_tokens tokens on, on the Amx tier, Q8_0/MXFP4/Q4_K/Q5_K go through AMX
// int8 tiles instead (16 rows x 16 tokens per tile product; matmul_amx.cpp). Every path equals
// the per-row kernels' contract (tests/cpu_kernels); the tuning changes only the speed.
void matvec_tokens(TensorType type, int64_t n_cols, const void* w, int64_t row_begin, int64_t row_end, const void* acts,
                   size_t act_row_bytes, const int32_t* tok, int n_tok, float* y, int64_t y_stride, const MatvecTuning& tuning);

// One run of rows for matvec_tokens_runs: rows [row_begin, row_end) of the matrix at w, results
// to y[t * y_stride + r] as matvec_tokens writes them.
struct MatvecRun {
  const void* w = nullptr;
  int64_t row_begin = 0, row_end = 0;
  float* y = nullptr;
};

// Several runs (at most 16) of one type against the same activations, their 4-row steps taken
// in turn (run 0's step, run 1's, ..., then run 0's next), so one thread keeps that many
// sequential streams going instead of one. Each run's results are bitwise matvec_tokens' on that
// run alone: the same tile for the same 4 rows (counted from the run's first row) and the same
// tail rows. The packed tiles interleave, each run with its own prefetcht0 stream
// (spread_l1_bytes / runs ahead, at least 2 KB); other paths take the runs one after the other.
// The expert FFN walks a Q4_K job's gate and up rows as two runs (faster for Q4_K only; more
// streams lost: docs/perf-log.md, "FfnStreamOptions").
void matvec_tokens_runs(TensorType type, int64_t n_cols, const MatvecRun* runs, int n_runs, const void* acts, size_t act_row_bytes,
                        const int32_t* tok, int n_tok, int64_t y_stride, const MatvecTuning& tuning);

// Whether matvec_tokens takes the AMX path for this type and token count with this tuning.
bool matvec_uses_amx(TensorType type, int n_tok, const MatvecTuning& tuning);

}  // namespace moraine::cpu
