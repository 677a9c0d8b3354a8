// CPU dot kernels of the importance-matrix grid formats (internal), kept apart from the other
// formats' dispatch lists so each group of formats is added in its own files.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/formats/tensor_type.h"

namespace moraine::cpu {

using IqVecDotFn = float (*)(int64_t n, const void* w_row, const void* act_row);

// The scalar reference (common/formats/quant_iq.h) per IQ grid type; nullptr for other types.
IqVecDotFn iq_scalar_fn(TensorType t);
// The AVX-512 VNNI kernel (vec_dot_avx512_iq.cpp, also uses BMI2) per IQ grid type; nullptr for
// other types. Only call when the CPU has the Avx512Vnni tier.
IqVecDotFn iq_avx512_vnni_fn(TensorType t);

namespace avx512 {
// Tier Avx512Vnni: vec_dot_avx512_iq.cpp (against Q8_K activations); bitwise the reference.
float dot_iq2_xxs(int64_t n, const void* w, const void* a);
float dot_iq2_xs(int64_t n, const void* w, const void* a);
float dot_iq2_s(int64_t n, const void* w, const void* a);
float dot_iq3_xxs(int64_t n, const void* w, const void* a);
float dot_iq3_s(int64_t n, const void* w, const void* a);
float dot_iq1_s(int64_t n, const void* w, const void* a);
float dot_iq1_m(int64_t n, const void* w, const void* a);
// matvec_tokens' 4-row tiles (avx512_kernels.h's rows4 contract): y[t * y_stride + r] for rows
// r = 0..3 (row_stride bytes apart) and tokens t < n_tok; each step is decoded once per group of
// up to 8 tokens. Bitwise the per-row kernels above.
void iq2_xxs_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride);
void iq2_xs_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride);
void iq2_s_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride);
void iq3_xxs_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride);
void iq3_s_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride);
void iq1_s_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride);
void iq1_m_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride);
}  // namespace avx512

using IqRows4Fn = void (*)(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride);
// The 4-row tile per IQ grid type (Avx512Vnni tier); nullptr for other types.
IqRows4Fn iq_rows4_fn(TensorType t);

}  // namespace moraine::cpu
