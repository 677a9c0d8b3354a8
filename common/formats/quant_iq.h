// Scalar reference for ggml's importance-matrix grid formats (quant_iq.cpp): decoding and the
// dots against Q8_K activations. Writing these types needs ggml's codebook search with an
// importance matrix; moraine reads them (hub files come quantized) and does not write them.
#pragma once
#include <cstdint>

#include "common/formats/block_layouts.h"
#include "common/formats/block_layouts_iq.h"
#include "common/formats/tensor_type.h"

namespace moraine::formats {

// IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M.
bool is_iq_grid_type(TensorType t);

// Counts in 256-element blocks. Decoding is bit-identical to ggml's dequantize_row_iq*.
void dequantize_iq2_xxs(const BlockIQ2_XXS* x, float* y, int64_t nb);
void dequantize_iq2_xs(const BlockIQ2_XS* x, float* y, int64_t nb);
void dequantize_iq2_s(const BlockIQ2_S* x, float* y, int64_t nb);
void dequantize_iq3_xxs(const BlockIQ3_XXS* x, float* y, int64_t nb);
void dequantize_iq3_s(const BlockIQ3_S* x, float* y, int64_t nb);
void dequantize_iq1_s(const BlockIQ1_S* x, float* y, int64_t nb);
void dequantize_iq1_m(const BlockIQ1_M* x, float* y, int64_t nb);

// Each dot sums a super-block exactly in integers (isum = sum over sub-blocks of ls * sum(grid *
// sign * a)) and accumulates in float, in block order, as ggml's generic C dots do, so the
// results are bit-identical to ggml_vec_dot_iq*_q8_K_generic:
//   IQ2_*:   acc += (fp16(d) * a.d) * (float)isum;  result 0.125f * acc
//   IQ3_XXS: the same with 0.25f;  IQ3_S: the same with no final factor
//   IQ1_S/M: acc += (fp16(d) * a.d) * ((float)isum + 0.125f * (float)dsum), dsum the deltas'
//            sign * ls * (sum of the activations) over the sub-blocks (halves for IQ1_M).
// The AVX-512 kernels reproduce these exactly.
float dot_iq2_xxs_q8_k(const BlockIQ2_XXS* w, const BlockQ8_K* a, int64_t nb);
float dot_iq2_xs_q8_k(const BlockIQ2_XS* w, const BlockQ8_K* a, int64_t nb);
float dot_iq2_s_q8_k(const BlockIQ2_S* w, const BlockQ8_K* a, int64_t nb);
float dot_iq3_xxs_q8_k(const BlockIQ3_XXS* w, const BlockQ8_K* a, int64_t nb);
float dot_iq3_s_q8_k(const BlockIQ3_S* w, const BlockQ8_K* a, int64_t nb);
float dot_iq1_s_q8_k(const BlockIQ1_S* w, const BlockQ8_K* a, int64_t nb);
float dot_iq1_m_q8_k(const BlockIQ1_M* w, const BlockQ8_K* a, int64_t nb);

// Type-dispatched forms of the above for quant.cpp (t must satisfy is_iq_grid_type).
void dequantize_iq(TensorType t, const void* x, float* y, int64_t nb);
float dot_iq_q8_k(TensorType t, const void* w, const BlockQ8_K* a, int64_t nb);

// IQ1_M keeps its fp16 block scale in the top nibbles of its four scale words.
uint16_t iq1_m_block_scale(const BlockIQ1_M& b);

}  // namespace moraine::formats
