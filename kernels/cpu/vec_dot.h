// CPU dot products of one weight row with one activation row, picked at runtime by ISA.
// The scalar kernels are the reference in common/formats (vec_dot_reference); every SIMD kernel
// is tested against it. The activation row must already be in dot_activation_type(weight).
#pragma once
#include <cstdint>
#include <string_view>

#include "common/formats/tensor_type.h"

namespace moraine::cpu {

// Avx512: F+BW+VL (float kernels). Avx512Vnni adds VNNI, which every quantized AVX-512
// kernel uses (vpdpbusd); CPUs with AVX-512 but without VNNI (Skylake-X) get the scalar
// quantized kernels. Avx2 is a tier reserved for later: it has no kernels yet.
enum class CpuIsa { Scalar, Avx2, Avx512, Avx512Vnni };

CpuIsa detect_cpu_isa();  // best tier this CPU supports (cached)
std::string_view isa_name(CpuIsa isa);

using VecDotFn = float (*)(int64_t n, const void* w_row, const void* act_row);

// nullptr when `isa` has no kernel for `weight` or the CPU cannot run that tier's kernels.
// CpuIsa::Scalar always has one for every computable weight type.
VecDotFn vec_dot_fn(TensorType weight, CpuIsa isa);

// Best available kernel. n must be a multiple of the weight's block size (not checked here:
// this is the hot path; vec_dot_reference checks).
float vec_dot(TensorType weight, int64_t n, const void* w_row, const void* act_row);

// Quantizes (or converts) one activation row to `act_type` (Q8_0, Q8_K, F32, F16 or BF16).
// Bit-identical to moraine::quantize_row, using AVX-512 when the CPU has it. Non-finite inputs
// are not checked here (hot path); quantize_row rejects them.
void quantize_activation_row(TensorType act_type, const float* x, void* dst, int64_t n);

}  // namespace moraine::cpu
