// AVX-512 kernels (internal). Each group lives in its own .cpp compiled with AVX-512 flags;
// nothing here may be called unless detect_cpu_isa() reports the tier named in the comment.
#pragma once
#include <cstddef>
#include <cstdint>

namespace moraine::cpu::avx512 {

// Tier Avx512 (F, BW, VL, F16C, FMA): vec_dot_avx512_float.cpp.
float dot_f32(int64_t n, const void* w, const void* a);
float dot_f16(int64_t n, const void* w, const void* a);
float dot_bf16(int64_t n, const void* w, const void* a);

// Tier Avx512Vnni: vec_dot_avx512_legacy.cpp (against Q8_0 activations).
float dot_q4_0(int64_t n, const void* w, const void* a);
float dot_q8_0(int64_t n, const void* w, const void* a);
float dot_mxfp4(int64_t n, const void* w, const void* a);

// Tier Avx512Vnni: vec_dot_avx512_kquants.cpp (against Q8_K activations).
float dot_q2_k(int64_t n, const void* w, const void* a);
float dot_q3_k(int64_t n, const void* w, const void* a);
float dot_q4_k(int64_t n, const void* w, const void* a);
float dot_q5_k(int64_t n, const void* w, const void* a);
float dot_q6_k(int64_t n, const void* w, const void* a);

// Tier Avx512Vnni: matvec_avx512.cpp. Four consecutive rows (row_stride bytes apart) times
// n_tok activation rows acts[t]: y[t * y_stride + r] for r in 0..3. The k-quants are bitwise
// their per-row kernels; Q8_0 / MXFP4 are within the per-row kernels' summation bound. Used
// by matvec_tokens.
void q4_k_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride);
void q5_k_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride);  // bitwise dot_q5_k
void q2_k_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride);  // bitwise dot_q2_k
void q3_k_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride);  // bitwise dot_q3_k
void q6_k_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride);  // bitwise dot_q6_k
void q8_0_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride);
void mxfp4_rows4(int64_t n, const void* w, size_t row_stride, const void* const* acts, int n_tok, float* y, int64_t y_stride);

// Tier Avx512: quantize_activation_avx512.cpp; bit-identical to the scalar quantizers.
void quantize_q8_0(const float* x, void* dst, int64_t n);
void quantize_q8_k(const float* x, void* dst, int64_t n);
// Tier Avx512: quantize_activation_avx512.cpp; bit-identical to the scalar llama_x86 rule.
void quantize_q8_0_llama_x86(const float* x, void* dst, int64_t n);

}  // namespace moraine::cpu::avx512
