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
// the VNNI tiers Q4_K, Q8_0 and MXFP4 run as register-blocked tiles of 4 rows x up to 4 tokens
// (matvec_avx512.cpp), which unpack each weight block once per token group.
// From amx_min_tokens() (kPrefillTokens) tokens on, on the Amx tier, Q8_0/MXFP4/Q4_K/Q5_K go through AMX int8
// tiles instead (16 rows x 16 tokens per tile product; matmul_amx.cpp). Every path equals the
// per-row kernels' contract (tests/cpu_kernels).
void matvec_tokens(TensorType type, int64_t n_cols, const void* w, int64_t row_begin, int64_t row_end, const void* acts,
                   size_t act_row_bytes, const int32_t* tok, int n_tok, float* y, int64_t y_stride);

inline constexpr int kPrefillTokens = 32;

// Moves the AMX threshold (default kPrefillTokens; clamped to >= 1), process-wide, for A/B runs
// of the decode and verify sizes (4..16 tokens) on AMX machines: the benches' --amx-min-tokens.
// Results are the same either way (every path meets the same contract); only speed changes.
void set_amx_min_tokens(int n_tok);
int amx_min_tokens();

// Whether matvec_tokens takes the AMX path for this type and token count right now.
bool matvec_uses_amx(TensorType type, int n_tok);

}  // namespace moraine::cpu
