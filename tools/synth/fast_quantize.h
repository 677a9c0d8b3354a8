// Quantizers for random weights, where the reference quantizer's search for the best scales is
// wasted: Q8_0, Q4_K and Q6_K take each (sub-)block's range (min/max, or max |x|) as it is and
// round without libm calls. Measured on this machine, one core, M elements/s: q4_k 6.4 with
// moraine::quantize_row, 225 here; q8_0 81 with quantize_row, 218 here. Blocks decode within
// half a quantization step of the input. The blocks are ggml's,
// so every reader decodes them. Other types go to moraine::quantize_row.
#pragma once
#include <cstdint>

#include "common/formats/tensor_type.h"

namespace moraine::synth {

// n must be a multiple of the type's block size.
void fast_quantize_row(TensorType t, const float* src, void* dst, int64_t n);

}  // namespace moraine::synth
