// Dispatch lists of the IQ grid formats' dot kernels (compiled without ISA flags).
#include "common/formats/quant_iq.h"
#include "kernels/cpu/iq_kernels.h"

namespace moraine::cpu {
namespace {

template <typename W, float (*Dot)(const W*, const BlockQ8_K*, int64_t)>
float scalar_blocks(int64_t n, const void* w, const void* a) {
  return Dot(static_cast<const W*>(w), static_cast<const BlockQ8_K*>(a), n / kQK_K);
}

}  // namespace

IqVecDotFn iq_scalar_fn(TensorType t) {
  using namespace formats;
  switch (t) {
    case TensorType::IQ2_XXS: return scalar_blocks<BlockIQ2_XXS, dot_iq2_xxs_q8_k>;
    case TensorType::IQ2_XS: return scalar_blocks<BlockIQ2_XS, dot_iq2_xs_q8_k>;
    case TensorType::IQ2_S: return scalar_blocks<BlockIQ2_S, dot_iq2_s_q8_k>;
    case TensorType::IQ3_XXS: return scalar_blocks<BlockIQ3_XXS, dot_iq3_xxs_q8_k>;
    case TensorType::IQ3_S: return scalar_blocks<BlockIQ3_S, dot_iq3_s_q8_k>;
    case TensorType::IQ1_S: return scalar_blocks<BlockIQ1_S, dot_iq1_s_q8_k>;
    case TensorType::IQ1_M: return scalar_blocks<BlockIQ1_M, dot_iq1_m_q8_k>;
    default: return nullptr;
  }
}

IqVecDotFn iq_avx512_vnni_fn(TensorType t) {
  switch (t) {
    case TensorType::IQ2_XXS: return avx512::dot_iq2_xxs;
    case TensorType::IQ2_XS: return avx512::dot_iq2_xs;
    case TensorType::IQ2_S: return avx512::dot_iq2_s;
    case TensorType::IQ3_XXS: return avx512::dot_iq3_xxs;
    case TensorType::IQ3_S: return avx512::dot_iq3_s;
    case TensorType::IQ1_S: return avx512::dot_iq1_s;
    case TensorType::IQ1_M: return avx512::dot_iq1_m;
    default: return nullptr;
  }
}

IqRows4Fn iq_rows4_fn(TensorType t) {
  switch (t) {
    case TensorType::IQ2_XXS: return avx512::iq2_xxs_rows4;
    case TensorType::IQ2_XS: return avx512::iq2_xs_rows4;
    case TensorType::IQ2_S: return avx512::iq2_s_rows4;
    case TensorType::IQ3_XXS: return avx512::iq3_xxs_rows4;
    case TensorType::IQ3_S: return avx512::iq3_s_rows4;
    case TensorType::IQ1_S: return avx512::iq1_s_rows4;
    case TensorType::IQ1_M: return avx512::iq1_m_rows4;
    default: return nullptr;
  }
}

}  // namespace moraine::cpu
