// AVX-512 dots of F32, F16 and BF16 rows. Products accumulate in four float vectors with FMA;
// the scalar reference sums in double, so results agree to float summation error (tested with
// a bound of n * 2^-24 * sum|w*a|, the classic recursive-summation bound).
#include <immintrin.h>

#include "kernels/cpu/avx512_kernels.h"

namespace moraine::cpu::avx512 {
namespace {

inline __m512 load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load_bf16_tail(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __m512 load_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load_f16_tail(const uint16_t* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }

// Four independent accumulators hide the FMA latency; 64 elements per iteration.
template <typename T, typename Load, typename LoadTail>
float dot_generic(int64_t n, const T* w, const T* a, Load load, LoadTail load_tail) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps(), acc3 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    acc0 = _mm512_fmadd_ps(load(w + i), load(a + i), acc0);
    acc1 = _mm512_fmadd_ps(load(w + i + 16), load(a + i + 16), acc1);
    acc2 = _mm512_fmadd_ps(load(w + i + 32), load(a + i + 32), acc2);
    acc3 = _mm512_fmadd_ps(load(w + i + 48), load(a + i + 48), acc3);
  }
  for (; i + 16 <= n; i += 16) acc0 = _mm512_fmadd_ps(load(w + i), load(a + i), acc0);
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    acc1 = _mm512_fmadd_ps(load_tail(w + i, m), load_tail(a + i, m), acc1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_add_ps(acc2, acc3)));
}

}  // namespace

float dot_f32(int64_t n, const void* w, const void* a) {
  return dot_generic(
      n, static_cast<const float*>(w), static_cast<const float*>(a), [](const float* p) { return _mm512_loadu_ps(p); },
      [](const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); });
}

float dot_f16(int64_t n, const void* w, const void* a) {
  // Lambdas, not function pointers: the template must see the loads to inline them.
  return dot_generic(
      n, static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(a), [](const uint16_t* p) { return load_f16(p); },
      [](const uint16_t* p, __mmask16 m) { return load_f16_tail(p, m); });
}

float dot_bf16(int64_t n, const void* w, const void* a) {
  return dot_generic(
      n, static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(a), [](const uint16_t* p) { return load_bf16(p); },
      [](const uint16_t* p, __mmask16 m) { return load_bf16_tail(p, m); });
}

}  // namespace moraine::cpu::avx512
