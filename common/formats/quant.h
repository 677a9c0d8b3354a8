// Scalar reference conversions between float and every computable tensor type. Block layouts
// are ggml's byte for byte (see block_layouts.h), so rows read from hub GGUF files decode here.
#pragma once
#include <cstdint>

#include "common/formats/tensor_type.h"

namespace moraine {

// n must be a multiple of the type's block size. Throws std::invalid_argument otherwise or for
// a type that is not computable. quantize_row also rejects NaN/inf for the quantized types
// (F32/F16/BF16 keep them). Q4_0, Q8_0, MXFP4 and the activation formats Q8_0/Q8_K follow
// ggml's reference quantizer rule exactly (same bytes); the k-quants use moraine's own search
// (RMSE within a few % of llama.cpp's reference, see tests/formats/test_formats_vs_ggml.cpp).
// The IQ grid types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) decode and dot
// bit-identically to ggml (quant_iq.h); quantize_row refuses them (use llama-quantize).
void dequantize_row(TensorType t, const void* src, float* dst, int64_t n);
void quantize_row(TensorType t, const float* src, void* dst, int64_t n);

// The activation format a weight row of type `weight` is dotted against (ggml's pairing):
// Q8_0 for Q4_0, Q8_0 and MXFP4; Q8_K for the K-quants and the IQ grid types; F32, F16, BF16
// for themselves.
TensorType dot_activation_type(TensorType weight);

// Scalar reference dot product of one weight row with one activation row already quantized
// to dot_activation_type(weight). Integer sums are exact; block scales are applied in float,
// one running float sum in block order (F32/F16/BF16: products summed in double). The
// per-format float expressions are documented in quant_formats.h.
float vec_dot_reference(TensorType weight, int64_t n, const void* w_row, const void* act_row);

float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);   // round to nearest even
float bf16_to_fp32(uint16_t h);
uint16_t fp32_to_bf16(float f);   // round to nearest even, NaN kept quiet

}  // namespace moraine
