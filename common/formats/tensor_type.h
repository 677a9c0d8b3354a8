// Tensor element types as ggml numbers them in GGUF files. The ids are a file-format fact and
// must never be renumbered: hub files carry them.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace moraine {

enum class TensorType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22,
  IQ4_XS = 23, I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
  TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39,
};

struct TypeTraits {
  TensorType type;
  std::string_view name;   // lower-case, as users type it: "q4_k", "bf16"
  int64_t block_elems;     // elements per block (1 for plain types)
  size_t block_bytes;      // bytes per block
  bool computable;         // moraine can dequantize and dot it (and quantize to it, but the IQ grid types)
};

// nullptr when `raw` is not a type id any known ggml version writes.
const TypeTraits* find_type_traits(uint32_t raw);
const TypeTraits& type_traits(TensorType t);
std::optional<TensorType> type_from_name(std::string_view name);  // case-insensitive
inline std::string_view type_name(TensorType t) { return type_traits(t).name; }

// Bytes of a row of n elements; n must be a multiple of the block size.
inline size_t row_bytes(TensorType t, int64_t n) {
  const TypeTraits& tr = type_traits(t);
  return static_cast<size_t>(n / tr.block_elems) * tr.block_bytes;
}

}  // namespace moraine
