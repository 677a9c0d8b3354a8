// Scalar reference routines of the types in block_layouts_legacy_iq4_tq.h (quant_legacy_extra.cpp,
// quant_iq4_tq.cpp). Counts are in blocks. Every dot sums a block (IQ4_XS: a 32-element
// sub-block) exactly in integers and applies the scales in float with ggml's own expression and
// order (its generic C dots in ggml-cpu/quants.c), one running float sum in block order, so the
// results are bit-identical to ggml's generic path (tests/formats/test_formats_vs_ggml.cpp):
//   q4_1, q5_1 (x q8_1): acc += (fp16(w.d) * fp16(a.d)) * (float)isum + fp16(w.m) * fp16(a.s)
//   q5_0 (x q8_0):       acc += (fp16(w.d) * fp16(a.d)) * (float)isum
//   iq4_nl (x q8_0):     acc += (fp16(a.d) * fp16(w.d)) * (float)isum
//   iq4_xs (x q8_K):     acc += ((fp16(w.d) * a.d) * (float)(ls - 32)) * (float)isum per sub-block
//   tq1_0 (x q8_K):      acc += (float)isum * (fp16(w.d) * a.d)
//   tq2_0 (x q8_K):      acc += (float)isum * (a.d * fp16(w.d))
// Quantizers are ggml's reference rules (same bytes): quantize_row_*_ref for q4_1, q5_0, q5_1,
// q8_1, iq4_nl (its one-pass search), tq1_0, tq2_0; iq4_xs as quantize_iq4_xs without an
// importance matrix (its 15-scale search), which is what its _ref calls.
#pragma once
#include <cstdint>

#include "common/formats/block_layouts.h"

namespace moraine::formats {

void quantize_q4_1(const float* x, BlockQ4_1* y, int64_t nb);
void quantize_q5_0(const float* x, BlockQ5_0* y, int64_t nb);
void quantize_q5_1(const float* x, BlockQ5_1* y, int64_t nb);
void quantize_q8_1(const float* x, BlockQ8_1* y, int64_t nb);
void dequantize_q4_1(const BlockQ4_1* x, float* y, int64_t nb);
void dequantize_q5_0(const BlockQ5_0* x, float* y, int64_t nb);
void dequantize_q5_1(const BlockQ5_1* x, float* y, int64_t nb);
void dequantize_q8_1(const BlockQ8_1* x, float* y, int64_t nb);
float dot_q4_1_q8_1(const BlockQ4_1* w, const BlockQ8_1* a, int64_t nb);
float dot_q5_0_q8_0(const BlockQ5_0* w, const BlockQ8_0* a, int64_t nb);
float dot_q5_1_q8_1(const BlockQ5_1* w, const BlockQ8_1* a, int64_t nb);

void quantize_iq4_nl(const float* x, BlockIQ4_NL* y, int64_t nb);
void quantize_iq4_xs(const float* x, BlockIQ4_XS* y, int64_t nb);
void quantize_tq1_0(const float* x, BlockTQ1_0* y, int64_t nb);
void quantize_tq2_0(const float* x, BlockTQ2_0* y, int64_t nb);
void dequantize_iq4_nl(const BlockIQ4_NL* x, float* y, int64_t nb);
void dequantize_iq4_xs(const BlockIQ4_XS* x, float* y, int64_t nb);
void dequantize_tq1_0(const BlockTQ1_0* x, float* y, int64_t nb);
void dequantize_tq2_0(const BlockTQ2_0* x, float* y, int64_t nb);
float dot_iq4_nl_q8_0(const BlockIQ4_NL* w, const BlockQ8_0* a, int64_t nb);
float dot_iq4_xs_q8_k(const BlockIQ4_XS* w, const BlockQ8_K* a, int64_t nb);
float dot_tq1_0_q8_k(const BlockTQ1_0* w, const BlockQ8_K* a, int64_t nb);
float dot_tq2_0_q8_k(const BlockTQ2_0* w, const BlockQ8_K* a, int64_t nb);

// The 5-bit quants of a Q5_0 / Q5_1 block in element order (0..31), shared by the SIMD kernels'
// tests and the reference.
inline int q5_quant(const uint8_t* qs, uint32_t qh, int j) {
  const int lo = j < 16 ? (qs[j] & 0x0f) : (qs[j - 16] >> 4);
  return lo | static_cast<int>(((qh >> j) & 1u) << 4);
}

}  // namespace moraine::formats
