#include "common/formats/tensor_type.h"

#include <array>
#include <cctype>
#include <stdexcept>
#include <string>

namespace moraine {
namespace {

// Block sizes and byte counts are ggml's (a file-format fact). `computable` marks the types
// moraine converts and dots; the rest are still listed so files holding them can be inspected.
constexpr std::array kTraits = {
    TypeTraits{TensorType::F32, "f32", 1, 4, true},
    TypeTraits{TensorType::F16, "f16", 1, 2, true},
    TypeTraits{TensorType::Q4_0, "q4_0", 32, 18, true},
    TypeTraits{TensorType::Q4_1, "q4_1", 32, 20, true},
    TypeTraits{TensorType::Q5_0, "q5_0", 32, 22, true},
    TypeTraits{TensorType::Q5_1, "q5_1", 32, 24, true},
    TypeTraits{TensorType::Q8_0, "q8_0", 32, 34, true},
    TypeTraits{TensorType::Q8_1, "q8_1", 32, 36, true},
    TypeTraits{TensorType::Q2_K, "q2_k", 256, 84, true},
    TypeTraits{TensorType::Q3_K, "q3_k", 256, 110, true},
    TypeTraits{TensorType::Q4_K, "q4_k", 256, 144, true},
    TypeTraits{TensorType::Q5_K, "q5_k", 256, 176, true},
    TypeTraits{TensorType::Q6_K, "q6_k", 256, 210, true},
    TypeTraits{TensorType::Q8_K, "q8_k", 256, 292, true},
    TypeTraits{TensorType::IQ2_XXS, "iq2_xxs", 256, 66, true},
    TypeTraits{TensorType::IQ2_XS, "iq2_xs", 256, 74, true},
    TypeTraits{TensorType::IQ3_XXS, "iq3_xxs", 256, 98, true},
    TypeTraits{TensorType::IQ1_S, "iq1_s", 256, 50, true},
    TypeTraits{TensorType::IQ4_NL, "iq4_nl", 32, 18, true},
    TypeTraits{TensorType::IQ3_S, "iq3_s", 256, 110, true},
    TypeTraits{TensorType::IQ2_S, "iq2_s", 256, 82, true},
    TypeTraits{TensorType::IQ4_XS, "iq4_xs", 256, 136, true},
    TypeTraits{TensorType::I8, "i8", 1, 1, false},
    TypeTraits{TensorType::I16, "i16", 1, 2, false},
    TypeTraits{TensorType::I32, "i32", 1, 4, false},
    TypeTraits{TensorType::I64, "i64", 1, 8, false},
    TypeTraits{TensorType::F64, "f64", 1, 8, false},
    TypeTraits{TensorType::IQ1_M, "iq1_m", 256, 56, true},
    TypeTraits{TensorType::BF16, "bf16", 1, 2, true},
    TypeTraits{TensorType::TQ1_0, "tq1_0", 256, 54, true},
    TypeTraits{TensorType::TQ2_0, "tq2_0", 256, 66, true},
    TypeTraits{TensorType::MXFP4, "mxfp4", 32, 17, true},
};

}  // namespace

const TypeTraits* find_type_traits(uint32_t raw) {
  for (const TypeTraits& t : kTraits) {
    if (static_cast<uint32_t>(t.type) == raw) return &t;
  }
  return nullptr;
}

const TypeTraits& type_traits(TensorType t) {
  const TypeTraits* tr = find_type_traits(static_cast<uint32_t>(t));
  if (!tr) throw std::invalid_argument("unknown tensor type id " + std::to_string(static_cast<uint32_t>(t)));
  return *tr;
}

std::optional<TensorType> type_from_name(std::string_view name) {
  std::string lower(name);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const TypeTraits& t : kTraits) {
    if (t.name == lower) return t.type;
  }
  return std::nullopt;
}

}  // namespace moraine
