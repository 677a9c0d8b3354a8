// ISA detection and kernel dispatch. Scalar kernels wrap the reference in common/formats.
#include "kernels/cpu/vec_dot.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <stdexcept>
#include <string>

#include "common/formats/half_float.h"
#include "common/formats/quant.h"
#include "common/formats/quant_formats.h"
#include "kernels/cpu/avx2_kernels.h"
#include "kernels/cpu/avx512_kernels.h"
#include "kernels/cpu/iq_kernels.h"

namespace moraine::cpu {
namespace {

// AMX-TILE and AMX-INT8 (CPUID leaf 7: EDX bits 24 and 25), and the kernel's permission to use
// tile data (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, Linux >= 5.16).
bool amx_int8_permitted() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

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
  if (isa == CpuIsa::Avx512Vnni && amx_int8_permitted()) isa = CpuIsa::Amx;
#endif
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
    case TensorType::Q4_1: return scalar_blocks<BlockQ4_1, BlockQ8_1, dot_q4_1_q8_1, kQK>;
    case TensorType::Q5_0: return scalar_blocks<BlockQ5_0, BlockQ8_0, dot_q5_0_q8_0, kQK>;
    case TensorType::Q5_1: return scalar_blocks<BlockQ5_1, BlockQ8_1, dot_q5_1_q8_1, kQK>;
    case TensorType::IQ4_NL: return scalar_blocks<BlockIQ4_NL, BlockQ8_0, dot_iq4_nl_q8_0, kQK>;
    case TensorType::IQ4_XS: return scalar_blocks<BlockIQ4_XS, BlockQ8_K, dot_iq4_xs_q8_k, kQK_K>;
    case TensorType::TQ1_0: return scalar_blocks<BlockTQ1_0, BlockQ8_K, dot_tq1_0_q8_k, kQK_K>;
    case TensorType::TQ2_0: return scalar_blocks<BlockTQ2_0, BlockQ8_K, dot_tq2_0_q8_k, kQK_K>;
    default: return nullptr;
  }
}

VecDotFn avx2_fn(TensorType t) {
  switch (t) {
    case TensorType::Q4_K: return avx2::dot_q4_k;
    case TensorType::Q8_0: return avx2::dot_q8_0;
    case TensorType::MXFP4: return avx2::dot_mxfp4;
    case TensorType::Q4_1: return avx2::dot_q4_1;
    case TensorType::Q5_0: return avx2::dot_q5_0;
    case TensorType::Q5_1: return avx2::dot_q5_1;
    case TensorType::IQ4_NL: return avx2::dot_iq4_nl;
    case TensorType::IQ4_XS: return avx2::dot_iq4_xs;
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
    case TensorType::Q4_1: return avx512::dot_q4_1;
    case TensorType::Q5_0: return avx512::dot_q5_0;
    case TensorType::Q5_1: return avx512::dot_q5_1;
    case TensorType::IQ4_NL: return avx512::dot_iq4_nl;
    case TensorType::IQ4_XS: return avx512::dot_iq4_xs;
    default: return nullptr;
  }
}

CpuIsa cpu_isa_hardware() {
  static const CpuIsa isa = detect_uncached();
  return isa;
}

}  // namespace

CpuIsa hardware_cpu_isa() { return cpu_isa_hardware(); }

CpuIsa capped_isa(CpuIsa max_isa) {
  const CpuIsa hw = cpu_isa_hardware();
  return static_cast<int>(max_isa) < static_cast<int>(hw) ? max_isa : hw;
}

std::optional<CpuIsa> parse_isa(std::string_view name) {
  for (CpuIsa isa : {CpuIsa::Scalar, CpuIsa::Avx2, CpuIsa::Avx512, CpuIsa::Avx512Vnni, CpuIsa::Amx}) {
    if (isa_name(isa) == name) return isa;
  }
  return std::nullopt;
}

std::string_view isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Scalar: return "scalar";
    case CpuIsa::Avx2: return "avx2";
    case CpuIsa::Avx512: return "avx512";
    case CpuIsa::Avx512Vnni: return "avx512vnni";
    case CpuIsa::Amx: return "amx";
  }
  return "unknown";
}

namespace {

// The kernel of exactly tier `isa` (no fallback); nullptr when the hardware lacks the tier.
VecDotFn kernel_for(TensorType weight, CpuIsa isa) {
  if (static_cast<int>(isa) > static_cast<int>(cpu_isa_hardware())) return nullptr;
  switch (isa) {
    case CpuIsa::Scalar: return scalar_fn(weight) ? scalar_fn(weight) : iq_scalar_fn(weight);
    case CpuIsa::Avx2: return avx2_fn(weight);
    case CpuIsa::Avx512: return avx512_fn(weight, false);
    case CpuIsa::Avx512Vnni:
    case CpuIsa::Amx: return avx512_fn(weight, true) ? avx512_fn(weight, true) : iq_avx512_vnni_fn(weight);
  }
  return nullptr;
}

// Best kernel per type id for every possible cap, resolved once (type ids are < 64); the
// caller's cap picks the row.
struct DispatchTable {
  static constexpr int kTiers = static_cast<int>(CpuIsa::Amx) + 1;
  VecDotFn fn[kTiers][64] = {};
  DispatchTable() {
    const int hw = static_cast<int>(cpu_isa_hardware());
    for (int cap = 0; cap < kTiers; ++cap) {
      for (uint32_t id = 0; id < 64; ++id) {
        const TypeTraits* tr = find_type_traits(id);
        if (!tr || !tr->computable || tr->type == TensorType::Q8_K || tr->type == TensorType::Q8_1) continue;
        for (int isa = cap < hw ? cap : hw; isa >= 0 && !fn[cap][id]; --isa) {
          fn[cap][id] = kernel_for(tr->type, static_cast<CpuIsa>(isa));
        }
      }
    }
  }
};

}  // namespace

VecDotFn vec_dot_fn(TensorType weight, CpuIsa isa) { return kernel_for(weight, isa); }  // nullptr above the CPU's tier

VecDotFn best_vec_dot_fn(TensorType weight, CpuIsa max_isa) {
  static const DispatchTable table;
  const auto id = static_cast<uint32_t>(weight);
  return id < 64 ? table.fn[static_cast<int>(capped_isa(max_isa))][id] : nullptr;
}

float vec_dot(TensorType weight, int64_t n, const void* w_row, const void* act_row) {
  const VecDotFn fn = best_vec_dot_fn(weight);
  if (!fn) throw std::invalid_argument("vec_dot: no kernel for tensor type " + std::to_string(static_cast<uint32_t>(weight)));
  return fn(n, w_row, act_row);
}

void quantize_activation_row(TensorType act_type, const float* x, void* dst, int64_t n, CpuIsa max_isa) {
  const bool avx512 = static_cast<int>(capped_isa(max_isa)) >= static_cast<int>(CpuIsa::Avx512);
  if (avx512 && act_type == TensorType::Q8_0 && n % kQK == 0) return avx512::quantize_q8_0(x, dst, n);
  if (avx512 && act_type == TensorType::Q8_K && n % kQK_K == 0) return avx512::quantize_q8_k(x, dst, n);
  switch (act_type) {
    case TensorType::Q8_0:
    case TensorType::Q8_1:  // scalar: one row per token, small beside the dots it feeds
    case TensorType::Q8_K:
    case TensorType::F32:
    case TensorType::F16:
    case TensorType::BF16: quantize_row(act_type, x, dst, n); return;
    default: break;
  }
  throw std::invalid_argument("quantize_activation_row: " + std::string(type_name(act_type)) +
                              " is not an activation type (expected q8_0, q8_1, q8_k, f32, f16 or bf16)");
}

}  // namespace moraine::cpu
