// CPU dot kernels of the importance-matrix grid formats (internal), kept apart from the other
// formats' dispatch lists so each group of formats is added in its own files.
#pragma once
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
}  // namespace avx512

}  // namespace moraine::cpu
