// Per-format scalar reference routines behind the type-dispatched API in quant.h. Kernels and
// tests call these directly when they already know the format. Counts are in blocks (nb) for
// block formats and in elements (n) for plain ones; callers have validated them.
#pragma once
#include <cstdint>

#include "common/formats/block_layouts.h"

namespace moraine::formats {

// Legacy 32-element blocks (quant_legacy.cpp).
void quantize_q4_0(const float* x, BlockQ4_0* y, int64_t nb);
void quantize_q8_0(const float* x, BlockQ8_0* y, int64_t nb);
void quantize_mxfp4(const float* x, BlockMXFP4* y, int64_t nb);
void dequantize_q4_0(const BlockQ4_0* x, float* y, int64_t nb);
void dequantize_q8_0(const BlockQ8_0* x, float* y, int64_t nb);
void dequantize_mxfp4(const BlockMXFP4* x, float* y, int64_t nb);
float dot_q4_0_q8_0(const BlockQ4_0* w, const BlockQ8_0* a, int64_t nb);
float dot_q8_0_q8_0(const BlockQ8_0* w, const BlockQ8_0* a, int64_t nb);
float dot_mxfp4_q8_0(const BlockMXFP4* w, const BlockQ8_0* a, int64_t nb);
// Q4_1, Q5_0, Q5_1, Q8_1, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0: quant_formats_legacy_iq4_tq.h (included below).

// K-quants (kquant_quantize.cpp, kquant_reference.cpp).
void quantize_q2_k(const float* x, BlockQ2_K* y, int64_t nb);
void quantize_q3_k(const float* x, BlockQ3_K* y, int64_t nb);
void quantize_q4_k(const float* x, BlockQ4_K* y, int64_t nb);
void quantize_q5_k(const float* x, BlockQ5_K* y, int64_t nb);
void quantize_q6_k(const float* x, BlockQ6_K* y, int64_t nb);
void quantize_q8_k(const float* x, BlockQ8_K* y, int64_t nb);
void dequantize_q2_k(const BlockQ2_K* x, float* y, int64_t nb);
void dequantize_q3_k(const BlockQ3_K* x, float* y, int64_t nb);
void dequantize_q4_k(const BlockQ4_K* x, float* y, int64_t nb);
void dequantize_q5_k(const BlockQ5_K* x, float* y, int64_t nb);
void dequantize_q6_k(const BlockQ6_K* x, float* y, int64_t nb);
void dequantize_q8_k(const BlockQ8_K* x, float* y, int64_t nb);
// Each k-quant dot sums per super-block exactly in integers: isum = sum over sub-blocks of
// scale * sum(q * a) and msum = sum of min * bsums, then accumulates in float, in block order,
//   acc += (fp16(w.d) * a.d) * (float)isum - (fp16(w.dmin) * a.d) * (float)msum
// (the second term only for the formats with mins). The AVX-512 kernels reproduce this exactly.
float dot_q2_k_q8_k(const BlockQ2_K* w, const BlockQ8_K* a, int64_t nb);
float dot_q3_k_q8_k(const BlockQ3_K* w, const BlockQ8_K* a, int64_t nb);
float dot_q4_k_q8_k(const BlockQ4_K* w, const BlockQ8_K* a, int64_t nb);
float dot_q5_k_q8_k(const BlockQ5_K* w, const BlockQ8_K* a, int64_t nb);
float dot_q6_k_q8_k(const BlockQ6_K* w, const BlockQ8_K* a, int64_t nb);

// Plain types (quant.cpp): products summed in double, as ggml's scalar path does.
float dot_f32(const float* w, const float* a, int64_t n);
float dot_f16(const uint16_t* w, const uint16_t* a, int64_t n);
float dot_bf16(const uint16_t* w, const uint16_t* a, int64_t n);

}  // namespace moraine::formats

#include "common/formats/quant_formats_legacy_iq4_tq.h"
