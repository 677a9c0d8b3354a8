// Type-dispatched entry points of quant.h over the per-format reference routines, plus the
// plain float types (F32, F16, BF16). Arguments are checked here, once, with messages that name
// the type and the offending value.
#include "common/formats/quant.h"

#include <cmath>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/formats/half_float.h"
#include "common/formats/quant_formats.h"
#include "common/formats/quant_iq.h"

namespace moraine {
namespace {

const TypeTraits& checked_traits(TensorType t, int64_t n, const char* what) {
  const TypeTraits& tr = type_traits(t);
  if (!tr.computable) {
    throw std::invalid_argument(std::string(what) + ": tensor type " + std::string(tr.name) +
                                " is not supported by moraine's formats");
  }
  if (n < 0 || n % tr.block_elems != 0) {
    throw std::invalid_argument(std::string(what) + ": row of " + std::to_string(n) + " elements is not a multiple of the " +
                                std::string(tr.name) + " block size " + std::to_string(tr.block_elems));
  }
  return tr;
}

// Quantizers would turn NaN/inf into garbage levels; refuse them and say where.
void require_finite(const float* x, int64_t n, TensorType t) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) {
      throw std::invalid_argument("quantize_row: element " + std::to_string(i) + " is " + std::to_string(x[i]) +
                                  "; " + std::string(type_name(t)) + " can only hold finite values");
    }
  }
}

// A block whose values exceed what its fp16 scale can express gets an infinite scale (e.g.
// q8_0 past |x| = 65504 * 127); refuse the row instead of writing blocks that decode to inf/NaN.
void require_finite_scales(TensorType t, const void* dst, int64_t nb) {
  size_t offsets[2] = {0, 0};
  int count = 1;
  switch (t) {
    case TensorType::Q4_0:
    case TensorType::Q8_0: break;
    case TensorType::Q2_K: offsets[0] = offsetof(BlockQ2_K, d), offsets[1] = offsetof(BlockQ2_K, dmin), count = 2; break;
    case TensorType::Q3_K: offsets[0] = offsetof(BlockQ3_K, d); break;
    case TensorType::Q4_K: offsets[1] = offsetof(BlockQ4_K, dmin), count = 2; break;
    case TensorType::Q5_K: offsets[1] = offsetof(BlockQ5_K, dmin), count = 2; break;
    case TensorType::Q6_K: offsets[0] = offsetof(BlockQ6_K, d); break;
    case TensorType::Q4_1: case TensorType::Q5_1: offsets[1] = 2, count = 2; break;  // d, m
    case TensorType::Q5_0: case TensorType::Q8_1: case TensorType::IQ4_NL: case TensorType::IQ4_XS: break;  // d first (q8_1's s: as ggml, unchecked)
    case TensorType::TQ1_0: offsets[0] = offsetof(BlockTQ1_0, d); break;
    case TensorType::TQ2_0: offsets[0] = offsetof(BlockTQ2_0, d); break;
    default: return;  // MXFP4's exponent and Q8_K's float scale cover every finite input
  }
  const size_t block_bytes = type_traits(t).block_bytes;
  for (int64_t b = 0; b < nb; ++b) {
    for (int k = 0; k < count; ++k) {
      uint16_t h;
      std::memcpy(&h, static_cast<const uint8_t*>(dst) + static_cast<size_t>(b) * block_bytes + offsets[k], 2);
      if ((h & 0x7c00u) == 0x7c00u) {
        throw std::invalid_argument("quantize_row: block " + std::to_string(b) + " of the " + std::string(type_name(t)) +
                                    " row holds values too large for its fp16 block scale (beyond 65504)");
      }
    }
  }
}

}  // namespace

namespace formats {

float dot_f32(const float* w, const float* a, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(w[i]) * static_cast<double>(a[i]);
  return static_cast<float>(acc);
}

float dot_f16(const uint16_t* w, const uint16_t* a, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(half::fp16_to_fp32(w[i]) * half::fp16_to_fp32(a[i]));
  return static_cast<float>(acc);
}

float dot_bf16(const uint16_t* w, const uint16_t* a, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(half::bf16_to_fp32(w[i]) * half::bf16_to_fp32(a[i]));
  return static_cast<float>(acc);
}

}  // namespace formats

void dequantize_row(TensorType t, const void* src, float* dst, int64_t n) {
  const TypeTraits& tr = checked_traits(t, n, "dequantize_row");
  const int64_t nb = n / tr.block_elems;
  using namespace formats;
  switch (t) {
    case TensorType::F32: std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float)); return;
    case TensorType::F16:
      for (int64_t i = 0; i < n; ++i) dst[i] = half::fp16_to_fp32(static_cast<const uint16_t*>(src)[i]);
      return;
    case TensorType::BF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = half::bf16_to_fp32(static_cast<const uint16_t*>(src)[i]);
      return;
    case TensorType::Q4_0: dequantize_q4_0(static_cast<const BlockQ4_0*>(src), dst, nb); return;
    case TensorType::Q8_0: dequantize_q8_0(static_cast<const BlockQ8_0*>(src), dst, nb); return;
    case TensorType::MXFP4: dequantize_mxfp4(static_cast<const BlockMXFP4*>(src), dst, nb); return;
    case TensorType::Q2_K: dequantize_q2_k(static_cast<const BlockQ2_K*>(src), dst, nb); return;
    case TensorType::Q3_K: dequantize_q3_k(static_cast<const BlockQ3_K*>(src), dst, nb); return;
    case TensorType::Q4_K: dequantize_q4_k(static_cast<const BlockQ4_K*>(src), dst, nb); return;
    case TensorType::Q5_K: dequantize_q5_k(static_cast<const BlockQ5_K*>(src), dst, nb); return;
    case TensorType::Q6_K: dequantize_q6_k(static_cast<const BlockQ6_K*>(src), dst, nb); return;
    case TensorType::Q8_K: dequantize_q8_k(static_cast<const BlockQ8_K*>(src), dst, nb); return;
    case TensorType::Q4_1: dequantize_q4_1(static_cast<const BlockQ4_1*>(src), dst, nb); return;
    case TensorType::Q5_0: dequantize_q5_0(static_cast<const BlockQ5_0*>(src), dst, nb); return;
    case TensorType::Q5_1: dequantize_q5_1(static_cast<const BlockQ5_1*>(src), dst, nb); return;
    case TensorType::Q8_1: dequantize_q8_1(static_cast<const BlockQ8_1*>(src), dst, nb); return;
    case TensorType::IQ4_NL: dequantize_iq4_nl(static_cast<const BlockIQ4_NL*>(src), dst, nb); return;
    case TensorType::IQ4_XS: dequantize_iq4_xs(static_cast<const BlockIQ4_XS*>(src), dst, nb); return;
    case TensorType::TQ1_0: dequantize_tq1_0(static_cast<const BlockTQ1_0*>(src), dst, nb); return;
    case TensorType::TQ2_0: dequantize_tq2_0(static_cast<const BlockTQ2_0*>(src), dst, nb); return;
    default: break;
  }
  if (is_iq_grid_type(t)) return dequantize_iq(t, src, dst, nb);
  throw std::logic_error("dequantize_row: computable type " + std::string(tr.name) + " has no decoder");
}

void quantize_row(TensorType t, const float* src, void* dst, int64_t n) {
  const TypeTraits& tr = checked_traits(t, n, "quantize_row");
  const int64_t nb = n / tr.block_elems;
  using namespace formats;
  switch (t) {
    case TensorType::F32: std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float)); return;
    case TensorType::F16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = half::fp32_to_fp16(src[i]);
      return;
    case TensorType::BF16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = half::fp32_to_bf16(src[i]);
      return;
    default: break;
  }
  if (formats::is_iq_grid_type(t)) {
    throw std::invalid_argument("quantize_row: moraine does not write " + std::string(tr.name) +
                                " (it needs an importance matrix and ggml's codebook search); use llama-quantize");
  }
  require_finite(src, n, t);
  switch (t) {
    case TensorType::Q4_0: quantize_q4_0(src, static_cast<BlockQ4_0*>(dst), nb); break;
    case TensorType::Q8_0: quantize_q8_0(src, static_cast<BlockQ8_0*>(dst), nb); break;
    case TensorType::MXFP4: quantize_mxfp4(src, static_cast<BlockMXFP4*>(dst), nb); break;
    case TensorType::Q2_K: quantize_q2_k(src, static_cast<BlockQ2_K*>(dst), nb); break;
    case TensorType::Q3_K: quantize_q3_k(src, static_cast<BlockQ3_K*>(dst), nb); break;
    case TensorType::Q4_K: quantize_q4_k(src, static_cast<BlockQ4_K*>(dst), nb); break;
    case TensorType::Q5_K: quantize_q5_k(src, static_cast<BlockQ5_K*>(dst), nb); break;
    case TensorType::Q6_K: quantize_q6_k(src, static_cast<BlockQ6_K*>(dst), nb); break;
    case TensorType::Q8_K: quantize_q8_k(src, static_cast<BlockQ8_K*>(dst), nb); break;
    case TensorType::Q4_1: quantize_q4_1(src, static_cast<BlockQ4_1*>(dst), nb); break;
    case TensorType::Q5_0: quantize_q5_0(src, static_cast<BlockQ5_0*>(dst), nb); break;
    case TensorType::Q5_1: quantize_q5_1(src, static_cast<BlockQ5_1*>(dst), nb); break;
    case TensorType::Q8_1: quantize_q8_1(src, static_cast<BlockQ8_1*>(dst), nb); break;
    case TensorType::IQ4_NL: quantize_iq4_nl(src, static_cast<BlockIQ4_NL*>(dst), nb); break;
    case TensorType::IQ4_XS: quantize_iq4_xs(src, static_cast<BlockIQ4_XS*>(dst), nb); break;
    case TensorType::TQ1_0: quantize_tq1_0(src, static_cast<BlockTQ1_0*>(dst), nb); break;
    case TensorType::TQ2_0: quantize_tq2_0(src, static_cast<BlockTQ2_0*>(dst), nb); break;
    default: throw std::logic_error("quantize_row: computable type " + std::string(tr.name) + " has no encoder");
  }
  require_finite_scales(t, dst, nb);
}

TensorType dot_activation_type(TensorType weight) {
  switch (weight) {
    case TensorType::F32:
    case TensorType::F16:
    case TensorType::BF16: return weight;
    case TensorType::Q4_0:
    case TensorType::Q8_0:
    case TensorType::MXFP4: return TensorType::Q8_0;
    case TensorType::Q5_0: case TensorType::IQ4_NL: return TensorType::Q8_0;  // ggml's vec_dot_type
    case TensorType::Q4_1: case TensorType::Q5_1: return TensorType::Q8_1;
    case TensorType::IQ4_XS: case TensorType::TQ1_0: case TensorType::TQ2_0: return TensorType::Q8_K;
    case TensorType::Q2_K:
    case TensorType::Q3_K:
    case TensorType::Q4_K:
    case TensorType::Q5_K:
    case TensorType::Q6_K: return TensorType::Q8_K;
    default: break;
  }
  if (formats::is_iq_grid_type(weight)) return TensorType::Q8_K;
  throw std::invalid_argument("dot_activation_type: " + std::string(type_name(weight)) +
                              " is not a weight type moraine can dot");
}

float vec_dot_reference(TensorType weight, int64_t n, const void* w, const void* a) {
  const TensorType act = dot_activation_type(weight);
  const TypeTraits& tr = checked_traits(weight, n, "vec_dot_reference");
  checked_traits(act, n, "vec_dot_reference (activation)");
  const int64_t nb = n / tr.block_elems;
  using namespace formats;
  switch (weight) {
    case TensorType::F32: return dot_f32(static_cast<const float*>(w), static_cast<const float*>(a), n);
    case TensorType::F16: return dot_f16(static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(a), n);
    case TensorType::BF16: return dot_bf16(static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(a), n);
    case TensorType::Q4_0: return dot_q4_0_q8_0(static_cast<const BlockQ4_0*>(w), static_cast<const BlockQ8_0*>(a), nb);
    case TensorType::Q8_0: return dot_q8_0_q8_0(static_cast<const BlockQ8_0*>(w), static_cast<const BlockQ8_0*>(a), nb);
    case TensorType::MXFP4: return dot_mxfp4_q8_0(static_cast<const BlockMXFP4*>(w), static_cast<const BlockQ8_0*>(a), nb);
    case TensorType::Q2_K: return dot_q2_k_q8_k(static_cast<const BlockQ2_K*>(w), static_cast<const BlockQ8_K*>(a), nb);
    case TensorType::Q3_K: return dot_q3_k_q8_k(static_cast<const BlockQ3_K*>(w), static_cast<const BlockQ8_K*>(a), nb);
    case TensorType::Q4_K: return dot_q4_k_q8_k(static_cast<const BlockQ4_K*>(w), static_cast<const BlockQ8_K*>(a), nb);
    case TensorType::Q5_K: return dot_q5_k_q8_k(static_cast<const BlockQ5_K*>(w), static_cast<const BlockQ8_K*>(a), nb);
    case TensorType::Q6_K: return dot_q6_k_q8_k(static_cast<const BlockQ6_K*>(w), static_cast<const BlockQ8_K*>(a), nb);
    case TensorType::Q4_1: return dot_q4_1_q8_1(static_cast<const BlockQ4_1*>(w), static_cast<const BlockQ8_1*>(a), nb);
    case TensorType::Q5_0: return dot_q5_0_q8_0(static_cast<const BlockQ5_0*>(w), static_cast<const BlockQ8_0*>(a), nb);
    case TensorType::Q5_1: return dot_q5_1_q8_1(static_cast<const BlockQ5_1*>(w), static_cast<const BlockQ8_1*>(a), nb);
    case TensorType::IQ4_NL: return dot_iq4_nl_q8_0(static_cast<const BlockIQ4_NL*>(w), static_cast<const BlockQ8_0*>(a), nb);
    case TensorType::IQ4_XS: return dot_iq4_xs_q8_k(static_cast<const BlockIQ4_XS*>(w), static_cast<const BlockQ8_K*>(a), nb);
    case TensorType::TQ1_0: return dot_tq1_0_q8_k(static_cast<const BlockTQ1_0*>(w), static_cast<const BlockQ8_K*>(a), nb);
    case TensorType::TQ2_0: return dot_tq2_0_q8_k(static_cast<const BlockTQ2_0*>(w), static_cast<const BlockQ8_K*>(a), nb);
    default: break;
  }
  if (is_iq_grid_type(weight)) return dot_iq_q8_k(weight, w, static_cast<const BlockQ8_K*>(a), nb);
  throw std::logic_error("vec_dot_reference: no dot for " + std::string(tr.name));
}

float fp16_to_fp32(uint16_t h) { return half::fp16_to_fp32(h); }
uint16_t fp32_to_fp16(float f) { return half::fp32_to_fp16(f); }
float bf16_to_fp32(uint16_t h) { return half::bf16_to_fp32(h); }
uint16_t fp32_to_bf16(float f) { return half::fp32_to_bf16(f); }

}  // namespace moraine
