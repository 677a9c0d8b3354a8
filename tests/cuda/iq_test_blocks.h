// Random blocks of ggml's importance-matrix grid formats (IQ2_XXS .. IQ1_M) for the CUDA kernel
// tests. moraine does not write these types (quantize_row refuses them), but every byte pattern of
// their grid indices, signs, high bits and scale fields is a valid block, so random bytes with a
// finite fp16 block scale cover every codebook entry, sign pattern and scale the kernels decode.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/formats/block_layouts_iq.h"
#include "common/formats/half_float.h"
#include "common/formats/quant.h"
#include "common/formats/quant_iq.h"

namespace moraine::cuda_test {

// nblocks random blocks of IQ type t at dst, each block's scale d = +-10^U(log10 d_lo, log10 d_hi)
// (both signs: ggml's quantizer writes only positive d, the decoders take any).
inline void random_iq_blocks(TensorType t, uint8_t* dst, int64_t nblocks, std::mt19937& rng, float d_lo, float d_hi) {
  const size_t bb = type_traits(t).block_bytes;
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> log_d(std::log10(d_lo), std::log10(d_hi));
  for (int64_t b = 0; b < nblocks; ++b) {
    uint8_t* blk = dst + static_cast<size_t>(b) * bb;
    for (size_t i = 0; i < bb; ++i) blk[i] = static_cast<uint8_t>(byte(rng));
    const float d = std::pow(10.0f, log_d(rng)) * (byte(rng) & 1 ? -1.0f : 1.0f);
    const uint16_t h = half::fp32_to_fp16(d);
    if (t == TensorType::IQ1_M) {  // the fp16 scale in the top nibbles of the four scale halfwords
      for (int k = 0; k < 4; ++k) {
        uint16_t w;
        std::memcpy(&w, blk + offsetof(BlockIQ1_M, scales) + 2 * k, 2);
        w = static_cast<uint16_t>((w & 0x0fffu) | (((h >> (4 * k)) & 0xfu) << 12));
        std::memcpy(blk + offsetof(BlockIQ1_M, scales) + 2 * k, &w, 2);
      }
    } else {  // every other IQ block starts with its fp16 d
      std::memcpy(blk, &h, 2);
    }
  }
}

// rows x n weights of type t: random blocks for the IQ types, else quantize_row of x (rows x n
// values, used only then).
inline std::vector<uint8_t> weight_rows(TensorType t, const std::vector<float>& x, int64_t rows, int64_t n,
                                        std::mt19937& rng, float d_lo = 1e-4f, float d_hi = 1e-1f) {
  const size_t rb = row_bytes(t, n);
  std::vector<uint8_t> out(rb * static_cast<size_t>(rows));
  if (formats::is_iq_grid_type(t)) {
    random_iq_blocks(t, out.data(), rows * (n / type_traits(t).block_elems), rng, d_lo, d_hi);
  } else {
    for (int64_t r = 0; r < rows; ++r) quantize_row(t, x.data() + r * n, out.data() + static_cast<size_t>(r) * rb, n);
  }
  return out;
}

inline const TensorType kIqGridTypes[] = {TensorType::IQ2_XXS, TensorType::IQ2_XS, TensorType::IQ2_S, TensorType::IQ3_XXS,
                                          TensorType::IQ3_S,   TensorType::IQ1_S,  TensorType::IQ1_M};

}  // namespace moraine::cuda_test
