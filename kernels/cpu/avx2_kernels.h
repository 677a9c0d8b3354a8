// AVX2 kernels (internal), the fallback tier for x86 CPUs without AVX-512 VNNI. Compiled with
// -mavx2 -mfma -mf16c in vec_dot_avx2.cpp; callable only when hardware_cpu_isa() >= Avx2.
#pragma once
#include <cstdint>

namespace moraine::cpu::avx2 {

float dot_q4_k(int64_t n, const void* w, const void* a);   // against Q8_K; bitwise = reference
float dot_q8_0(int64_t n, const void* w, const void* a);   // against Q8_0; float order differs
float dot_mxfp4(int64_t n, const void* w, const void* a);  // against Q8_0; float order differs
// vec_dot_avx2_legacy_iq4.cpp, bitwise = reference: Q4_1 / Q5_1 against Q8_1, Q5_0 / IQ4_NL against Q8_0, IQ4_XS against Q8_K.
float dot_q4_1(int64_t n, const void* w, const void* a);
float dot_q5_0(int64_t n, const void* w, const void* a);
float dot_q5_1(int64_t n, const void* w, const void* a);
float dot_iq4_nl(int64_t n, const void* w, const void* a);
float dot_iq4_xs(int64_t n, const void* w, const void* a);

}  // namespace moraine::cpu::avx2
