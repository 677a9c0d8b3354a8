// GGUF metadata values: the thirteen value types of GGUF v3, arrays nested to any depth.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace moraine::gguf {

enum class ValueType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};
std::string_view value_type_name(ValueType t);

class Value;
struct Array {
  ValueType elem_type = ValueType::UINT8;
  std::vector<Value> items;
};

// One metadata value. Integers of every width are held widened (unsigned in u64, signed in
// i64), floats in double; `type` remembers the width the file used so a writer round-trips it.
class Value {
 public:
  Value() = default;
  static Value u8(uint8_t x) { return Value(ValueType::UINT8, uint64_t{x}); }
  static Value i8(int8_t x) { return Value(ValueType::INT8, int64_t{x}); }
  static Value u16(uint16_t x) { return Value(ValueType::UINT16, uint64_t{x}); }
  static Value i16(int16_t x) { return Value(ValueType::INT16, int64_t{x}); }
  static Value u32(uint32_t x) { return Value(ValueType::UINT32, uint64_t{x}); }
  static Value i32(int32_t x) { return Value(ValueType::INT32, int64_t{x}); }
  static Value u64(uint64_t x) { return Value(ValueType::UINT64, x); }
  static Value i64(int64_t x) { return Value(ValueType::INT64, x); }
  static Value f32(float x) { return Value(ValueType::FLOAT32, double{x}); }
  static Value f64(double x) { return Value(ValueType::FLOAT64, x); }
  static Value boolean(bool x) { return Value(ValueType::BOOL, x); }
  static Value string(std::string s) { return Value(ValueType::STRING, std::move(s)); }
  static Value array(ValueType elem_type, std::vector<Value> items) {
    auto a = std::make_shared<Array>();
    a->elem_type = elem_type;
    a->items = std::move(items);
    return Value(ValueType::ARRAY, std::shared_ptr<const Array>(std::move(a)));
  }
  static Value string_array(const std::vector<std::string>& items);

  ValueType type() const { return type_; }
  bool is_integer() const;
  bool is_float() const { return type_ == ValueType::FLOAT32 || type_ == ValueType::FLOAT64; }

  // Typed reads; nullopt when the value is not of a compatible kind or does not fit.
  std::optional<uint64_t> as_u64() const;
  std::optional<int64_t> as_i64() const;
  std::optional<double> as_f64() const;  // any integer or float
  std::optional<bool> as_bool() const;
  const std::string* as_string() const;
  const Array* as_array() const;

  // Short human form for moraine-inspect: arrays show their first max_items items, strings are
  // cut at 200 bytes; max_items == SIZE_MAX shows everything.
  std::string to_display(size_t max_items = 8) const;

 private:
  using Storage = std::variant<uint64_t, int64_t, double, bool, std::string,
                               std::shared_ptr<const Array>>;
  Value(ValueType t, Storage s) : type_(t), v_(std::move(s)) {}
  ValueType type_ = ValueType::UINT8;
  Storage v_ = uint64_t{0};
};

}  // namespace moraine::gguf
