// The float terms vec_dot_reference adds for one row, for the CUDA tests' reordering bounds
// (2 gamma(count) * abs_sum): one per weight block for most formats, one per 32-element
// sub-block for IQ4_XS (quant_formats_legacy_iq4_tq.h), whose kernels add those terms.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/formats/block_layouts.h"
#include "common/formats/quant.h"

namespace moraine::cuda_test {

struct DotTerms {
  int64_t count = 0;
  double abs_sum = 0.0;  // sum of |term|
};

// An IQ4_XS sub-block's term is vec_dot_reference on its block with every other sub-block's
// activation quants zeroed: the reference then adds exact zeros around it.
inline DotTerms dot_terms(TensorType w_type, const uint8_t* w_row, const uint8_t* act_row, int64_t n) {
  const TensorType a_type = dot_activation_type(w_type);
  const int64_t block = type_traits(w_type).block_elems;
  const size_t wb = type_traits(w_type).block_bytes, ab = row_bytes(a_type, block);
  DotTerms t;
  for (int64_t b = 0; b < n / block; ++b) {
    const uint8_t* w = w_row + static_cast<size_t>(b) * wb;
    const uint8_t* a = act_row + static_cast<size_t>(b) * ab;
    if (w_type != TensorType::IQ4_XS) {
      t.abs_sum += std::fabs(vec_dot_reference(w_type, block, w, a));
      ++t.count;
      continue;
    }
    for (int j = 0; j < kQK_K / 32; ++j) {
      BlockQ8_K one;
      std::memcpy(&one, a, sizeof(one));
      for (int i = 0; i < kQK_K; ++i)
        if (i / 32 != j) one.qs[i] = 0;
      t.abs_sum += std::fabs(vec_dot_reference(w_type, block, w, &one));
      ++t.count;
    }
  }
  return t;
}

}  // namespace moraine::cuda_test
