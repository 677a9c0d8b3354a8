// CPU dot products of one weight row with one activation row, picked at runtime by ISA.
// The scalar kernels are the reference in common/formats (vec_dot_reference); every SIMD kernel
// is tested against it. The activation row must already be in dot_activation_type(weight).
#pragma once
#include <cstdint>
#include <optional>
#include <string_view>

#include "common/formats/tensor_type.h"

namespace moraine::cpu {

// Avx512: F+BW+VL (float kernels). Avx512Vnni adds VNNI, which every quantized AVX-512
// kernel uses (vpdpbusd). Avx2 (+FMA) has kernels for Q4_K, Q8_0 and MXFP4; CPUs with AVX-512
// but without VNNI (Skylake-X) use those, and the scalar kernels for the other formats.
// Amx: Avx512Vnni plus AMX-TILE/AMX-INT8 with the OS's permission for tile data; it adds the
// prefill matmul (matvec.h) and uses the Avx512Vnni kernels for everything else.
enum class CpuIsa { Scalar, Avx2, Avx512, Avx512Vnni, Amx };

// Best tier this CPU supports (detected once; detection asks the kernel for AMX tile-data
// permission, arch_prctl, which is per process).
CpuIsa hardware_cpu_isa();
// The tier the dispatchers below use with a cap: the lower of `max_isa` and the hardware's.
// A cap below the hardware's tests the fallback tiers (the default, Amx, is no cap).
CpuIsa capped_isa(CpuIsa max_isa);
std::string_view isa_name(CpuIsa isa);
std::optional<CpuIsa> parse_isa(std::string_view name);  // the names isa_name gives

using VecDotFn = float (*)(int64_t n, const void* w_row, const void* act_row);

// The kernel of exactly tier `isa`: nullptr when that tier has no kernel for `weight` or the
// CPU cannot run it. CpuIsa::Scalar always has one for every computable weight type.
VecDotFn vec_dot_fn(TensorType weight, CpuIsa isa);

// The best kernel up to capped_isa(max_isa), falling back tier by tier; nullptr for types
// without any kernel.
VecDotFn best_vec_dot_fn(TensorType weight, CpuIsa max_isa = CpuIsa::Amx);

// Best available kernel. n must be a multiple of the weight's block size (not checked here:
// this is the hot path; vec_dot_reference checks).
float vec_dot(TensorType weight, int64_t n, const void* w_row, const void* act_row);

// Quantizes (or converts) one activation row to `act_type` (Q8_0, Q8_1, Q8_K, F32, F16 or BF16).
// Bit-identical to moraine::quantize_row, using AVX-512 when capped_isa(max_isa) has it.
// Non-finite inputs are not checked here (hot path); quantize_row rejects them.
void quantize_activation_row(TensorType act_type, const float* x, void* dst, int64_t n, CpuIsa max_isa = CpuIsa::Amx);

// What llama.cpp's CPU backend computes for activations at run time on x86 (its AVX/AVX2/AVX-512
// builds, the ones node-llama-cpp loads here), so the reference executor's logits on quantized
// files can match llama.cpp's. Differs from quantize_activation_row only for q8_0: scale
// 127/amax (not 1/(amax/127)) and round half to even (not half away from zero); q8_K (up to the
// sign of a zero scale) and the float types are as quantize_activation_row; q8_1 takes q8_0's
// rule plus s = fp16(d * sum(q)) (its AVX code; the sum before the int8 saturation). Weights keep the
// reference rule (quantize_row). max_isa as for quantize_activation_row (the results are the same).
void quantize_activation_row_llama_x86(TensorType act_type, const float* x, void* dst, int64_t n, CpuIsa max_isa = CpuIsa::Amx);

}  // namespace moraine::cpu
