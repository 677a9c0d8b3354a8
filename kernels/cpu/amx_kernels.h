// AMX int8 tile kernels (internal) for the prefill path: many tokens against a weight slice.
// Compiled with -mamx-tile -mamx-int8 in matmul_amx.cpp; callable only when amx_int8_usable()
// (matvec.h) says so. Integer sums are exact (tdpbusd / tdpbssd over one 32-element group per
// tile product) and the float epilogue is the scalar reference's expression per block, in
// block order, so results equal vec_dot_reference bitwise.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/formats/tensor_type.h"

namespace moraine::cpu::amx {

// The formats with 32-element groups on both sides: Q8_0, MXFP4 (against Q8_0), Q4_K, Q5_K
// (32-element sub-blocks against Q8_K).
bool supports(TensorType t);

// Same contract as matvec_tokens (matvec.h).
void matmul_tokens(TensorType type, int64_t n_cols, const void* w, int64_t row_begin, int64_t row_end, const void* acts,
                   size_t act_row_bytes, const int32_t* tok, int n_tok, float* y, int64_t y_stride);

}  // namespace moraine::cpu::amx
