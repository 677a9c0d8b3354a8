// Quantizers for random weights, where the reference quantizer's search for the best scales is
// wasted: Q4_K and Q6_K take each sub-block's range (min/max, or max |x|) as it is, which is
// ~20x faster than moraine::quantize_row (measured on this machine: q4_k 6.4 M elements/s with
// quantize_row) and decodes within half a quantization step of the input. The blocks are ggml's,
// so every reader decodes them. Other types go to moraine::quantize_row.
#pragma once
#include <cstdint>

#include "common/formats/tensor_type.h"

namespace moraine::synth {

// n must be a multiple of the type's block size.
void fast_quantize_row(TensorType t, const float* src, void* dst, int64_t n);

}  // namespace moraine::synth
