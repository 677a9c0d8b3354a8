// Weight-matrix times activations, the way llama.cpp's CPU backend does it: each activation row
// is first converted to the type the weight is dotted against (dot_activation_type: q8_0 for
// q4_0/q8_0/mxfp4, q8_K for the K-quants, itself for f32/f16/bf16), then every output is one
// row-by-row vec_dot. Quantizing activations the same way is what makes logits on a quantized
// file comparable with llama.cpp's; dequantizing weight rows to float instead would be "more
// exact" but systematically different from the engine we are compared with.
#pragma once
#include <cstdint>
#include <vector>

#include "common/model/tensor_binder.h"
#include "common/reference/thread_pool.h"

namespace moraine::reference {

// The float order a dot adds its terms in. 0: the kernel's own (vec_dot, dot_f32), what every
// caller gets by default. Any other value: another order, equally valid, drawn from the seed:
// each block's term (32 elements for the float types) is its own kernel call, and the terms are
// added in a permutation of the blocks picked per weight row from (seed, row, shape) - the
// same for every token, as a GPU kernel's order is. The integer block sums are exact either way,
// so two seeds differ by float rounding only; what that moves downstream (a re-quantized
// activation or a top-k choice on a rounding edge) is how far apart two correct engines may be
// (tests/reference/float_order_bound.h, tools/float_order_gap.cpp).
using DotOrderSeed = uint64_t;
// The seed of no quantized activations: every dot multiplies the weight row dequantized to
// float by the float activations (dot_f32's order), the arithmetic of the CUDA backend's cuBLAS
// prefill before its 16-bit input rounding. The oracle of that path: it moved from the default
// reference by 0.07-0.20 of max |logit| on the quantized goldens, BF16 rounding or not (the F16
// inputs changed it by < 5%: docs/formats.md, session 20).
inline constexpr DotOrderSeed kFloatDots = ~DotOrderSeed{0};

// Activations converted once for one weight type; reused across the matrices of that type.
struct PackedActivations {
  TensorType type = TensorType::F32;
  int64_t n_cols = 0;
  int64_t n_tokens = 0;
  size_t row_bytes = 0;
  std::vector<uint8_t> bytes;
  const float* f32 = nullptr;  // when type is F32: the caller's rows, not copied

  const void* row(int64_t t) const {
    return f32 ? static_cast<const void*>(f32 + t * n_cols)
               : static_cast<const void*>(bytes.data() + static_cast<size_t>(t) * row_bytes);
  }
};

// order kFloatDots: the float rows themselves, whatever the weight type.
PackedActivations pack_activations(TensorType weight_type, const float* x, int64_t n_tokens,
                                   int64_t n_cols, DotOrderSeed order = 0);


// y[t * w.n_rows + r] = dot(w.row(r), x_t) for t < n_tokens.
void matmul(const model::Matrix& w, const float* x, int64_t n_tokens, float* y, ThreadPool& pool,
            DotOrderSeed order = 0);
void matmul(const model::Matrix& w, const PackedActivations& x, float* y, ThreadPool& pool,
            DotOrderSeed order = 0);

// One dot product of a weight row with a packed activation row (float accumulation for f32).
float dot_row(TensorType weight_type, int64_t n, const void* w_row, const void* act_row);
// The same dot with its block terms added in the order `order` picks for weight row `row` of a
// matrix of `n_rows` rows (order 0: dot_row).
float dot_row_in_order(TensorType weight_type, int64_t n, const void* w_row, const void* act_row, DotOrderSeed order,
                       int64_t row, int64_t n_rows);

}  // namespace moraine::reference
