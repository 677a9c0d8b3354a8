// ISA detection and kernel dispatch. Scalar kernels wrap the reference in common/formats.
#include "kernels/cpu/vec_dot.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "common/formats/half_float.h"
#include "common/formats/quant.h"
#include "common/formats/quant_formats.h"
#include "kernels/cpu/avx512_kernels.h"

namespace moraine::cpu {
namespace {

CpuIsa detect_uncached() {
  CpuIsa isa = CpuIsa::Scalar;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isa = CpuIsa::Avx2;
  // __builtin_cpu_supports also checks that the OS saves the AVX-512 state (XCR0).
  if (isa == CpuIsa::Avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    isa = CpuIsa::Avx512;
    if (__builtin_cpu_supports("avx512vnni")) isa = CpuIsa::Avx512Vnni;
  }
#endif
  // MORAINE_CPU_ISA caps the tier (for A/B runs and for testing the fallbacks).
  if (const char* cap = std::getenv("MORAINE_CPU_ISA")) {
    const std::string s(cap);
    CpuIsa limit = isa;
    if (s == "scalar") limit = CpuIsa::Scalar;
    else if (s == "avx2") limit = CpuIsa::Avx2;
    else if (s == "avx512") limit = CpuIsa::Avx512;
    else if (s == "avx512vnni") limit = CpuIsa::Avx512Vnni;
    else throw std::invalid_argument("MORAINE_CPU_ISA=" + s + ": expected scalar, avx2, avx512 or avx512vnni");
    if (static_cast<int>(limit) < static_cast<int>(isa)) isa = limit;
  }
  return isa;
}

template <typename W, typename A, float (*Dot)(const W*, const A*, int64_t), int64_t kBlock>
float scalar_blocks(int64_t n, const void* w, const void* a) {
  return Dot(static_cast<const W*>(w), static_cast<const A*>(a), n / kBlock);
}

VecDotFn scalar_fn(TensorType t) {
  using namespace formats;
  switch (t) {
    case TensorType::F32: return scalar_blocks<float, float, dot_f32, 1>;
    case TensorType::F16: return scalar_blocks<uint16_t, uint16_t, dot_f16, 1>;
    case TensorType::BF16: return scalar_blocks<uint16_t, uint16_t, dot_bf16, 1>;
    case TensorType::Q4_0: return scalar_blocks<BlockQ4_0, BlockQ8_0, dot_q4_0_q8_0, kQK>;
    case TensorType::Q8_0: return scalar_blocks<BlockQ8_0, BlockQ8_0, dot_q8_0_q8_0, kQK>;
    case TensorType::MXFP4: return scalar_blocks<BlockMXFP4, BlockQ8_0, dot_mxfp4_q8_0, kQK>;
    case TensorType::Q2_K: return scalar_blocks<BlockQ2_K, BlockQ8_K, dot_q2_k_q8_k, kQK_K>;
    case TensorType::Q3_K: return scalar_blocks<BlockQ3_K, BlockQ8_K, dot_q3_k_q8_k, kQK_K>;
    case TensorType::Q4_K: return scalar_blocks<BlockQ4_K, BlockQ8_K, dot_q4_k_q8_k, kQK_K>;
    case TensorType::Q5_K: return scalar_blocks<BlockQ5_K, BlockQ8_K, dot_q5_k_q8_k, kQK_K>;
    case TensorType::Q6_K: return scalar_blocks<BlockQ6_K, BlockQ8_K, dot_q6_k_q8_k, kQK_K>;
    default: return nullptr;
  }
}

VecDotFn avx512_fn(TensorType t, bool vnni) {
  switch (t) {
    case TensorType::F32: return avx512::dot_f32;
    case TensorType::F16: return avx512::dot_f16;
    case TensorType::BF16: return avx512::dot_bf16;
    default: break;
  }
  if (!vnni) return nullptr;
  switch (t) {
    case TensorType::Q4_0: return avx512::dot_q4_0;
    case TensorType::Q8_0: return avx512::dot_q8_0;
    case TensorType::MXFP4: return avx512::dot_mxfp4;
    case TensorType::Q2_K: return avx512::dot_q2_k;
    case TensorType::Q3_K: return avx512::dot_q3_k;
    case TensorType::Q4_K: return avx512::dot_q4_k;
    case TensorType::Q5_K: return avx512::dot_q5_k;
    case TensorType::Q6_K: return avx512::dot_q6_k;
    default: return nullptr;
  }
}

}  // namespace

CpuIsa detect_cpu_isa() {
  static const CpuIsa isa = detect_uncached();
  return isa;
}

std::string_view isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Scalar: return "scalar";
    case CpuIsa::Avx2: return "avx2";
    case CpuIsa::Avx512: return "avx512";
    case CpuIsa::Avx512Vnni: return "avx512vnni";
  }
  return "unknown";
}

VecDotFn vec_dot_fn(TensorType weight, CpuIsa isa) {
  if (static_cast<int>(isa) > static_cast<int>(detect_cpu_isa())) return nullptr;  // CPU cannot run it
  switch (isa) {
    case CpuIsa::Scalar: return scalar_fn(weight);
    case CpuIsa::Avx2: return nullptr;
    case CpuIsa::Avx512: return avx512_fn(weight, false);
    case CpuIsa::Avx512Vnni: return avx512_fn(weight, true);
  }
  return nullptr;
}

namespace {

// Best kernel per type id, resolved once (type ids are < 64).
struct DispatchTable {
  VecDotFn fn[64] = {};
  DispatchTable() {
    for (uint32_t id = 0; id < 64; ++id) {
      const TypeTraits* tr = find_type_traits(id);
      if (!tr || !tr->computable || tr->type == TensorType::Q8_K) continue;
      for (int isa = static_cast<int>(detect_cpu_isa()); isa >= 0 && !fn[id]; --isa) {
        fn[id] = vec_dot_fn(tr->type, static_cast<CpuIsa>(isa));
      }
    }
  }
};

}  // namespace

float vec_dot(TensorType weight, int64_t n, const void* w_row, const void* act_row) {
  static const DispatchTable table;
  const auto id = static_cast<uint32_t>(weight);
  const VecDotFn fn = id < 64 ? table.fn[id] : nullptr;
  if (!fn) throw std::invalid_argument("vec_dot: no kernel for tensor type " + std::to_string(id));
  return fn(n, w_row, act_row);
}

void quantize_activation_row(TensorType act_type, const float* x, void* dst, int64_t n) {
  const bool avx512 = static_cast<int>(detect_cpu_isa()) >= static_cast<int>(CpuIsa::Avx512);
  if (avx512 && act_type == TensorType::Q8_0 && n % kQK == 0) return avx512::quantize_q8_0(x, dst, n);
  if (avx512 && act_type == TensorType::Q8_K && n % kQK_K == 0) return avx512::quantize_q8_k(x, dst, n);
  switch (act_type) {
    case TensorType::Q8_0:
    case TensorType::Q8_K:
    case TensorType::F32:
    case TensorType::F16:
    case TensorType::BF16: quantize_row(act_type, x, dst, n); return;
    default: break;
  }
  throw std::invalid_argument("quantize_activation_row: " + std::string(type_name(act_type)) +
                              " is not an activation type (expected q8_0, q8_k, f32, f16 or bf16)");
}

}  // namespace moraine::cpu
