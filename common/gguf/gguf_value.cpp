#include "common/gguf/gguf_value.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>

namespace moraine::gguf {

std::string_view value_type_name(ValueType t) {
  switch (t) {
    case ValueType::UINT8: return "u8";
    case ValueType::INT8: return "i8";
    case ValueType::UINT16: return "u16";
    case ValueType::INT16: return "i16";
    case ValueType::UINT32: return "u32";
    case ValueType::INT32: return "i32";
    case ValueType::FLOAT32: return "f32";
    case ValueType::BOOL: return "bool";
    case ValueType::STRING: return "string";
    case ValueType::ARRAY: return "array";
    case ValueType::UINT64: return "u64";
    case ValueType::INT64: return "i64";
    case ValueType::FLOAT64: return "f64";
  }
  return "unknown";
}

Value Value::string_array(const std::vector<std::string>& items) {
  std::vector<Value> values;
  values.reserve(items.size());
  for (const std::string& s : items) values.push_back(Value::string(s));
  return Value::array(ValueType::STRING, std::move(values));
}

bool Value::is_integer() const {
  return std::holds_alternative<uint64_t>(v_) || std::holds_alternative<int64_t>(v_);
}

std::optional<uint64_t> Value::as_u64() const {
  if (const auto* u = std::get_if<uint64_t>(&v_)) return *u;
  if (const auto* i = std::get_if<int64_t>(&v_)) {
    if (*i < 0) return std::nullopt;
    return static_cast<uint64_t>(*i);
  }
  return std::nullopt;
}

std::optional<int64_t> Value::as_i64() const {
  if (const auto* i = std::get_if<int64_t>(&v_)) return *i;
  if (const auto* u = std::get_if<uint64_t>(&v_)) {
    if (*u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(*u);
  }
  return std::nullopt;
}

std::optional<double> Value::as_f64() const {
  if (const auto* d = std::get_if<double>(&v_)) return *d;
  if (const auto* u = std::get_if<uint64_t>(&v_)) return static_cast<double>(*u);
  if (const auto* i = std::get_if<int64_t>(&v_)) return static_cast<double>(*i);
  return std::nullopt;
}

std::optional<bool> Value::as_bool() const {
  if (const auto* b = std::get_if<bool>(&v_)) return *b;
  return std::nullopt;
}

const std::string* Value::as_string() const { return std::get_if<std::string>(&v_); }

const Array* Value::as_array() const {
  if (const auto* a = std::get_if<std::shared_ptr<const Array>>(&v_)) return a->get();
  return nullptr;
}

namespace {

// Strings are shown quoted with control bytes escaped, so a token like "\n" or a chat template
// stays on one line of moraine-inspect output; long strings are cut to keep a summary a summary.
void append_quoted(std::string& out, const std::string& s, size_t max_chars) {
  out += '"';
  size_t n = 0;
  for (char c : s) {
    if (n++ == max_chars) {
      out += "...";
      break;
    }
    const auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (u < 0x20 || u == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\x%02x", u);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

std::string format_double(double d, ValueType t) {
  char buf[64];
  // f32 needs 9 significant digits to round-trip, f64 17; %g drops trailing zeros.
  std::snprintf(buf, sizeof buf, "%.*g", t == ValueType::FLOAT32 ? 9 : 17, d);
  return buf;
}

void append_display(std::string& out, const Value& v, size_t max_items) {
  switch (v.type()) {
    case ValueType::STRING:
      // SIZE_MAX items means "show everything", strings included.
      append_quoted(out, *v.as_string(), max_items == SIZE_MAX ? SIZE_MAX : 200);
      return;
    case ValueType::BOOL: out += *v.as_bool() ? "true" : "false"; return;
    case ValueType::FLOAT32:
    case ValueType::FLOAT64: out += format_double(*v.as_f64(), v.type()); return;
    case ValueType::ARRAY: {
      const Array& a = *v.as_array();
      out += "[";
      out += value_type_name(a.elem_type);
      out += " x ";
      out += std::to_string(a.items.size());
      out += "]";
      if (a.items.empty()) return;
      out += " [";
      const size_t shown = std::min(max_items, a.items.size());
      for (size_t i = 0; i < shown; ++i) {
        if (i) out += ", ";
        append_display(out, a.items[i], max_items);
      }
      if (shown < a.items.size()) out += ", ...";
      out += "]";
      return;
    }
    default:
      if (auto u = v.as_u64()) {
        out += std::to_string(*u);
      } else {
        out += std::to_string(*v.as_i64());
      }
  }
}

}  // namespace

std::string Value::to_display(size_t max_items) const {
  std::string out;
  append_display(out, *this, max_items);
  return out;
}

}  // namespace moraine::gguf
