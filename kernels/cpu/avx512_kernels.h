// AVX-512 kernels (internal). Each group lives in its own .cpp compiled with AVX-512 flags;
// nothing here may be called unless hardware_cpu_isa() reports the tier named in the comment.
#pragma once
#include <xmmintrin.h>

#include <cstddef>
#include <cstdint>

namespace moraine::cpu::avx512 {

// The spread prefetch of the packed tiles (MatvecPrefetch::spread): at step k of n a tile asks
// for part k of the `bytes` lines from `pf` (prefetcht0), so a 4-row step's lines go out as
// it computes rather than in one burst before it. pf == nullptr: nothing.
inline void prefetch_part(const uint8_t* pf, size_t bytes, int64_t k, int64_t n) {
  if (!pf) return;
  const auto base = reinterpret_cast<uintptr_t>(pf);
  const uintptr_t to = base + bytes * static_cast<size_t>(k + 1) / static_cast<size_t>(n);
  for (uintptr_t line = (base + bytes * static_cast<size_t>(k) / static_cast<size_t>(n)) & ~uintptr_t{63}; line < to; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
  }
}

// Tier Avx512 (F, BW, VL, F16C, FMA): vec_dot_avx512_float.cpp.
float dot_f32(int64_t n, const void* w, const void* a);
float dot_f16(int64_t n, const void* w, const void* a);
float dot_bf16(int64_t n, const void* w, const void* a);

// Tier Avx512Vnni: vec_dot_avx512_legacy.cpp (against Q8_0 activations).
float dot_q4_0(int64_t n, const void* w, const void* a);
float dot_q8_0(int64_t n, const void* w, const void* a);
float dot_mxfp4(int64_t n, const void* w, const void* a);

// Tier Avx512Vnni: vec_dot_avx512_legacy_iq4.cpp; Q4_1 / Q5_1 against Q8_1, Q5_0 / IQ4_NL
// against Q8_0, IQ4_XS against Q8_K. Bitwise equal to the scalar reference.
float dot_q4_1(int64_t n, const void* w, const void* a);
float dot_q5_0(int64_t n, const void* w, const void* a);
float dot_q5_1(int64_t n, const void* w, const void* a);
float dot_iq4_nl(int64_t n, const void* w, const void* a);
float dot_iq4_xs(int64_t n, const void* w, const void* a);

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

// Tier Avx512Vnni plus AVX-512 VBMI: matvec_avx512_groups4.cpp. MXFP4 and Q8_0 four blocks per
// step: pack_*_acts writes one Q8_0 activation row of n elements (n a multiple of 32) in the
// order those tiles read it (groups4_packed_act_bytes(n) bytes, 64-byte aligned), once per
// matvec_tokens call; *_rows4_packed are mxfp4_rows4 / q8_0_rows4 against such rows (same
// contract). The two formats' packings differ (the bias they take back).
inline constexpr size_t kPackedGroupBytes = 256;  // four blocks
constexpr size_t groups4_packed_act_bytes(int64_t n) { return static_cast<size_t>((n / 32 + 3) / 4) * kPackedGroupBytes; }
void pack_mxfp4_acts(int64_t n, const void* act, void* dst);
// prefetch (or nullptr): prefetcht0 the prefetch_bytes from there, spread over the steps
// (prefetch_part).
void mxfp4_rows4_packed(int64_t n, const void* w, size_t row_stride, const void* const* packed, int n_tok, float* y, int64_t y_stride,
                        const void* prefetch = nullptr, size_t prefetch_bytes = 0);
void pack_q8_0_acts(int64_t n, const void* act, void* dst);
void q8_0_rows4_packed(int64_t n, const void* w, size_t row_stride, const void* const* packed, int n_tok, float* y, int64_t y_stride,
                       const void* prefetch = nullptr, size_t prefetch_bytes = 0);

// Tier Avx512Vnni plus GFNI: matvec_avx512_q4k.cpp. Q4_K against Q8_K activation rows repacked
// once per matvec_tokens call (pack_q4_k_acts: q4_k_packed_act_bytes(n) bytes, 64-byte aligned);
// q4_k_rows4_packed is q4_k_rows4 against such rows (bitwise the same results).
inline constexpr size_t kQ4KPackedBlockBytes = 384;
constexpr size_t q4_k_packed_act_bytes(int64_t n) { return static_cast<size_t>(n / 256) * kQ4KPackedBlockBytes; }
void pack_q4_k_acts(int64_t n, const void* act, void* dst);
// prefetch (or nullptr): prefetcht0 the prefetch_bytes from there, spread over the super-blocks
// (prefetch_part).
void q4_k_rows4_packed(int64_t n, const void* w, size_t row_stride, const void* const* packed, int n_tok, float* y, int64_t y_stride,
                       const void* prefetch = nullptr, size_t prefetch_bytes = 0);

// Tier Avx512: quantize_activation_avx512.cpp; bit-identical to the scalar quantizers.
void quantize_q8_0(const float* x, void* dst, int64_t n);
void quantize_q8_k(const float* x, void* dst, int64_t n);
// Tier Avx512: quantize_activation_avx512.cpp; bit-identical to the scalar llama_x86 rule.
void quantize_q8_0_llama_x86(const float* x, void* dst, int64_t n);

}  // namespace moraine::cpu::avx512
