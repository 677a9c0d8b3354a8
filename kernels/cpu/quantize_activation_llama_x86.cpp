// Activation quantization as llama.cpp's CPU backend does it at run time on x86 (see vec_dot.h).
// Only q8_0 differs from the reference rule: ggml's x86 quantize_row_q8_0 (AVX/AVX2 code, also
// used by its AVX-512 builds) scales by 127/amax instead of 1/(amax/127), a different float for
// 27% of amax values (measured over uniform amax), and rounds in the current mode (nearest, ties
// to even) where the reference uses roundf (ties away from zero). Its q8_K quantizer on x86 is
// the reference one, but for the sign of a zero scale (below). (Its repacked Q4_K/Q2_K matmuls
// quantize 4 tokens at a time with a q8_K variant that differs only where +amax and -amax both
// occur in a block: it takes the positive one. Not reproduced: the executor dots row by row.)
// Checked against node-llama-cpp's own libggml-cpu quantizers on this machine, bit for bit:
// tests/reference/llama_oracle_test.cpp, ActivationQuantizers.
#include <climits>
#include <cmath>
#include <stdexcept>
#include <string>

#include "common/formats/block_layouts.h"
#include "common/formats/half_float.h"
#include "kernels/cpu/avx512_kernels.h"
#include "kernels/cpu/vec_dot.h"

namespace moraine::cpu {
namespace {

// cvtps_epi32 then two saturating packs: nearest-even, out of range and NaN become INT_MIN,
// then clamped to int8. (Only reached for amax below ~7e-37, where 127/amax overflows.)
int8_t to_int8_like_packs(float v) {
  const float r = std::nearbyint(v);
  const int32_t i = (std::isnan(r) || r >= 2147483648.0f || r < -2147483648.0f) ? INT32_MIN : static_cast<int32_t>(r);
  return static_cast<int8_t>(i > 127 ? 127 : (i < -128 ? -128 : i));
}

void quantize_q8_0_llama_x86_scalar(const float* x, void* dst, int64_t n) {
  auto* y = static_cast<BlockQ8_0*>(dst);
  for (int64_t b = 0; b < n / kQK; ++b, x += kQK) {
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    y[b].d = half::fp32_to_fp16(amax / 127.0f);
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    for (int j = 0; j < kQK; ++j) y[b].qs[j] = to_int8_like_packs(x[j] * id);
  }
}

// ggml's q8_K writes d = 1/iscale even when iscale = -127/max overflows (|max| below ~3.7e-37):
// -0.0 for a positive max, where quantize_row writes a +0.0 zero block. Equal as numbers (every
// dot adds a zero either way); the sign is copied so the bytes are too.
void copy_ggml_zero_scale_sign_q8_k(const float* x, void* dst, int64_t n) {
  auto* y = static_cast<BlockQ8_K*>(dst);
  for (int64_t b = 0; b < n / kQK_K; ++b, x += kQK_K) {
    if (y[b].d != 0.0f) continue;
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < kQK_K; ++j) {
      if (std::fabs(x[j]) > amax) amax = std::fabs(x[j]), max = x[j];
    }
    if (max > 0.0f) y[b].d = -0.0f;
  }
}

// ggml's x86 quantize_row_q8_1: q8_0's x86 rule, and s = fp16(d * sum) of the int32 quants
// before the saturating packs (the same values but where 127/amax overflows).
void quantize_q8_1_llama_x86_scalar(const float* x, void* dst, int64_t n) {
  auto* y = static_cast<BlockQ8_1*>(dst);
  for (int64_t b = 0; b < n / kQK; ++b, x += kQK) {
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    y[b].d = half::fp32_to_fp16(d);
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    uint32_t sum = 0;  // wraps as the int32 lanes do
    for (int j = 0; j < kQK; ++j) {
      const float r = std::nearbyint(x[j] * id);
      const int32_t i = (std::isnan(r) || r >= 2147483648.0f || r < -2147483648.0f) ? INT32_MIN : static_cast<int32_t>(r);
      sum += static_cast<uint32_t>(i);
      y[b].qs[j] = static_cast<int8_t>(i > 127 ? 127 : (i < -128 ? -128 : i));
    }
    y[b].s = half::fp32_to_fp16(d * static_cast<float>(static_cast<int32_t>(sum)));
  }
}

}  // namespace

void quantize_activation_row_llama_x86(TensorType act_type, const float* x, void* dst, int64_t n, CpuIsa max_isa) {
  if (act_type == TensorType::Q8_K) {
    quantize_activation_row(act_type, x, dst, n, max_isa);
    return copy_ggml_zero_scale_sign_q8_k(x, dst, n);
  }
  if (act_type != TensorType::Q8_0 && act_type != TensorType::Q8_1) return quantize_activation_row(act_type, x, dst, n, max_isa);
  if (n % kQK != 0) {
    throw std::invalid_argument("quantize_activation_row_llama_x86: " + std::string(type_name(act_type)) + " row of " +
                                std::to_string(n) + " elements is not a multiple of 32");
  }
  if (act_type == TensorType::Q8_1) return quantize_q8_1_llama_x86_scalar(x, dst, n);
  if (static_cast<int>(capped_isa(max_isa)) >= static_cast<int>(CpuIsa::Avx512)) {
    return avx512::quantize_q8_0_llama_x86(x, dst, n);
  }
  quantize_q8_0_llama_x86_scalar(x, dst, n);
}

}  // namespace moraine::cpu
