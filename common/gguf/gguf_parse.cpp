#include "common/gguf/gguf_parse.h"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string_view>
#include <unordered_set>

namespace moraine::gguf::detail {
namespace {

static_assert(std::endian::native == std::endian::little,
              "GGUF v3 files are little-endian; this reader copies fields as they lie");

constexpr uint32_t kMaxValueType = static_cast<uint32_t>(ValueType::FLOAT64);

// Where a read happens, rendered only when it fails (the parser reads millions of fields for a
// large vocabulary, so building a string per read would dominate load time).
struct Field {
  std::string_view what;         // "header", "metadata", "tensor #3"
  std::string_view subject;      // metadata key or tensor name, when known
  std::string_view part;         // "value type", "n_dims", "dims[1]", ...
  int64_t item = -1;             // array item, when inside an array
};

// Keys and names come from the file, so they may hold any bytes: escape them for a message.
std::string printable(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < 120; ++i) {
    const auto u = static_cast<unsigned char>(s[i]);
    if (u < 0x20 || u >= 0x7f) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[u >> 4];
      out += kHex[u & 15];
    } else {
      out += s[i];
    }
  }
  if (s.size() > 120) out += "...";
  return out;
}

std::string describe(const Field& f) {
  std::string s(f.what);
  if (!f.subject.empty()) s += " '" + printable(f.subject) + "'";
  if (f.item >= 0) s += " item " + std::to_string(f.item);
  if (!f.part.empty()) {
    s += ' ';
    s += f.part;
  }
  return s;
}

// Smallest encoding of one array item of type t: bounds the item count before any allocation.
uint64_t min_encoded_size(ValueType t) {
  switch (t) {
    case ValueType::UINT8: case ValueType::INT8: case ValueType::BOOL: return 1;
    case ValueType::UINT16: case ValueType::INT16: return 2;
    case ValueType::UINT32: case ValueType::INT32: case ValueType::FLOAT32: return 4;
    case ValueType::UINT64: case ValueType::INT64: case ValueType::FLOAT64: return 8;
    case ValueType::STRING: return 8;   // length prefix
    case ValueType::ARRAY: return 12;   // element type + count
  }
  return 1;
}

class Parser {
 public:
  Parser(const uint8_t* bytes, size_t size, const std::string& name)
      : bytes_(bytes), size_(size), name_(name) {}

  size_t pos() const { return pos_; }
  size_t left() const { return size_ - pos_; }

  [[noreturn]] void fail(const Field& f, uint64_t offset, const std::string& problem) const {
    throw GgufError(name_ + ": " + describe(f) + ": " + problem + " (byte offset " +
                    std::to_string(offset) + ")");
  }

  template <class T>
  T read(const Field& f) {
    if (left() < sizeof(T)) {
      fail(f, pos_, "truncated: needs " + std::to_string(sizeof(T)) + " bytes but the file ends after " +
                        std::to_string(left()));
    }
    T v;
    std::memcpy(&v, bytes_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  std::string_view read_string(const Field& f) {
    const size_t at = pos_;
    const auto len = read<uint64_t>(f);
    if (len > left()) {
      fail(f, at, "string length " + std::to_string(len) + " runs past the end of the file (" +
                      std::to_string(left()) + " bytes left)");
    }
    std::string_view s(reinterpret_cast<const char*>(bytes_ + pos_), len);
    pos_ += len;
    return s;
  }

  ValueType read_value_type(const Field& f) {
    const size_t at = pos_;
    const auto raw = read<uint32_t>(f);
    if (raw > kMaxValueType) {
      fail(f, at, "unknown metadata value type " + std::to_string(raw) + " (GGUF v3 defines 0.." +
                      std::to_string(kMaxValueType) + ")");
    }
    return static_cast<ValueType>(raw);
  }

  Value read_value(ValueType t, const Field& f, int depth) {
    switch (t) {
      case ValueType::UINT8: return Value::u8(read<uint8_t>(f));
      case ValueType::INT8: return Value::i8(read<int8_t>(f));
      case ValueType::UINT16: return Value::u16(read<uint16_t>(f));
      case ValueType::INT16: return Value::i16(read<int16_t>(f));
      case ValueType::UINT32: return Value::u32(read<uint32_t>(f));
      case ValueType::INT32: return Value::i32(read<int32_t>(f));
      case ValueType::UINT64: return Value::u64(read<uint64_t>(f));
      case ValueType::INT64: return Value::i64(read<int64_t>(f));
      case ValueType::FLOAT32: return Value::f32(read<float>(f));
      case ValueType::FLOAT64: return Value::f64(read<double>(f));
      case ValueType::BOOL: {
        const size_t at = pos_;
        const auto b = read<uint8_t>(f);
        // Only 0 and 1 round-trip through a bool; anything else is corruption.
        if (b > 1) fail(f, at, "bool value " + std::to_string(b) + " is neither 0 nor 1");
        return Value::boolean(b != 0);
      }
      case ValueType::STRING: return Value::string(std::string(read_string(f)));
      case ValueType::ARRAY: return read_array(f, depth);
    }
    fail(f, pos_, "unknown metadata value type");
  }

 private:
  Value read_array(const Field& f, int depth) {
    const size_t at = pos_;
    if (depth >= kMaxArrayNesting) {
      fail(f, at, "arrays nested deeper than " + std::to_string(kMaxArrayNesting) + " levels");
    }
    const ValueType elem = read_value_type({f.what, f.subject, "array element type", f.item});
    const auto n = read<uint64_t>({f.what, f.subject, "array length", f.item});
    const uint64_t min_size = min_encoded_size(elem);
    if (n > left() / min_size) {
      fail(f, at, "array of " + std::to_string(n) + " " + std::string(value_type_name(elem)) +
                      " items runs past the end of the file (" + std::to_string(left()) +
                      " bytes left)");
    }
    std::vector<Value> items;
    items.reserve(n);
    for (uint64_t i = 0; i < n; ++i) {
      items.push_back(read_value(elem, {f.what, f.subject, "", static_cast<int64_t>(i)}, depth + 1));
    }
    return Value::array(elem, std::move(items));
  }

  const uint8_t* bytes_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& name_;
};

uint64_t align_up(uint64_t x, uint64_t alignment) { return (x + alignment - 1) & ~(alignment - 1); }

void read_header(Parser& p, ParsedShard& out, uint64_t& n_tensors, uint64_t& n_kv,
                 const uint8_t* bytes) {
  const Field magic{"header", "", "magic", -1};
  const auto raw_magic = p.read<uint32_t>(magic);
  if (std::memcmp(&raw_magic, "GGUF", 4) != 0) {
    char found[16];
    std::snprintf(found, sizeof found, "%02x %02x %02x %02x", bytes[0], bytes[1], bytes[2], bytes[3]);
    p.fail(magic, 0, std::string("bad magic: expected \"GGUF\" (47 47 55 46), found ") + found +
                         "; not a GGUF file");
  }
  const Field version{"header", "", "version", -1};
  out.version = p.read<uint32_t>(version);
  if (out.version == 1 || out.version == 2) {
    p.fail(version, 4, "GGUF version " + std::to_string(out.version) +
                           " is not supported; v3 is required (re-convert the model with a current "
                           "llama.cpp)");
  }
  if (out.version != 3) {
    std::string hint = __builtin_bswap32(out.version) == 3 ? " (a big-endian file?)" : "";
    p.fail(version, 4, "unsupported GGUF version " + std::to_string(out.version) + hint +
                           "; v3 is required");
  }
  const Field tc{"header", "", "tensor_count", -1};
  n_tensors = p.read<uint64_t>(tc);
  const Field kc{"header", "", "kv_count", -1};
  n_kv = p.read<uint64_t>(kc);
  // Smallest tensor info: name length, n_dims, type, offset (no name, no dims) = 24 bytes;
  // smallest key-value: key length, value type, one byte of value = 13 bytes.
  if (n_tensors > p.left() / 24) {
    p.fail(tc, 8, "tensor count " + std::to_string(n_tensors) + " cannot fit in the " +
                      std::to_string(p.left()) + " bytes after the header");
  }
  if (n_kv > p.left() / 13) {
    p.fail(kc, 16, "metadata count " + std::to_string(n_kv) + " cannot fit in the " +
                       std::to_string(p.left()) + " bytes after the header");
  }
}

void read_metadata(Parser& p, ParsedShard& out, uint64_t n_kv) {
  out.metadata.reserve(n_kv);
  std::unordered_set<std::string_view> seen;
  size_t alignment_value_at = 0;
  for (uint64_t i = 0; i < n_kv; ++i) {
    const std::string label = "metadata #" + std::to_string(i);
    const size_t key_at = p.pos();
    const std::string_view key = p.read_string({label, "", "key", -1});
    if (!seen.insert(key).second) p.fail({label, key, "key", -1}, key_at, "duplicate key");
    const ValueType t = p.read_value_type({"metadata", key, "value type", -1});
    const size_t value_at = p.pos();
    if (key == "general.alignment") alignment_value_at = value_at;
    out.metadata.emplace_back(std::string(key), p.read_value(t, {"metadata", key, "", -1}, 0));
  }
  for (const auto& [key, value] : out.metadata) {
    if (key != "general.alignment") continue;
    const Field f{"metadata", key, "", -1};
    if (value.type() != ValueType::UINT32) {
      p.fail(f, alignment_value_at,
             "must be of type u32, found " + std::string(value_type_name(value.type())));
    }
    const uint64_t a = *value.as_u64();
    if (a == 0 || !std::has_single_bit(a)) {
      p.fail(f, alignment_value_at, "alignment " + std::to_string(a) + " is not a power of two");
    }
    out.alignment = a;
  }
}

struct TensorWhere {
  size_t offset_field_at;  // where the tensor's data offset field lies, for later errors
  std::string label;
};

void read_tensor_infos(Parser& p, ParsedShard& out, uint64_t n_tensors,
                       std::vector<TensorWhere>& where) {
  out.tensors.reserve(n_tensors);
  where.reserve(n_tensors);
  std::unordered_set<std::string_view> seen;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    TensorInfo t;
    std::string label = "tensor #" + std::to_string(i);
    const size_t name_at = p.pos();
    const std::string_view name = p.read_string({label, "", "name", -1});
    if (!seen.insert(name).second) p.fail({label, name, "name", -1}, name_at, "duplicate tensor name");
    t.name = std::string(name);

    const size_t dims_at = p.pos();
    const auto n_dims = p.read<uint32_t>({label, name, "n_dims", -1});
    if (n_dims == 0 || n_dims > kMaxDims) {
      p.fail({label, name, "n_dims", -1}, dims_at,
             "n_dims " + std::to_string(n_dims) + " is outside 1.." + std::to_string(kMaxDims));
    }
    int64_t n_elements = 1;
    for (uint32_t j = 0; j < n_dims; ++j) {
      const std::string part = "dims[" + std::to_string(j) + "]";
      const size_t at = p.pos();
      const auto d = p.read<int64_t>({label, name, part, -1});
      if (d <= 0) p.fail({label, name, part, -1}, at, "dimension " + std::to_string(d) + " is not positive");
      if (__builtin_mul_overflow(n_elements, d, &n_elements)) {
        p.fail({label, name, part, -1}, at, "element count overflows int64");
      }
      t.shape.push_back(d);
    }

    const size_t type_at = p.pos();
    const auto raw_type = p.read<uint32_t>({label, name, "type", -1});
    const TypeTraits* traits = find_type_traits(raw_type);
    if (!traits) p.fail({label, name, "type", -1}, type_at, "unknown tensor type id " + std::to_string(raw_type));
    t.type = traits->type;
    if (t.shape[0] % traits->block_elems != 0) {
      p.fail({label, name, "dims[0]", -1}, dims_at + 4,
             "first dimension " + std::to_string(t.shape[0]) + " is not a multiple of the " +
                 std::string(traits->name) + " block size " + std::to_string(traits->block_elems));
    }
    const auto n_blocks = static_cast<uint64_t>(n_elements / traits->block_elems);
    if (__builtin_mul_overflow(n_blocks, uint64_t{traits->block_bytes}, &t.n_bytes)) {
      p.fail({label, name, "type", -1}, type_at, "byte size of the tensor overflows 64 bits");
    }

    const size_t offset_at = p.pos();
    t.offset = p.read<uint64_t>({label, name, "offset", -1});
    if (t.offset % out.alignment != 0) {
      p.fail({label, name, "offset", -1}, offset_at,
             "data offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
                 std::to_string(out.alignment));
    }
    out.tensors.push_back(std::move(t));
    where.push_back({offset_at, std::move(label)});
  }
}

void place_tensor_data(Parser& p, ParsedShard& out, const uint8_t* bytes, size_t size,
                       const std::vector<TensorWhere>& where) {
  // With no tensors the data section may be absent: writers stop right after the infos.
  out.data_offset = align_up(p.pos(), out.alignment);
  for (size_t i = 0; i < out.tensors.size(); ++i) {
    TensorInfo& t = out.tensors[i];
    const uint64_t room = out.data_offset <= size ? size - out.data_offset : 0;
    if (t.offset > room || t.n_bytes > room - t.offset) {
      const uint64_t start = out.data_offset + t.offset;
      p.fail({where[i].label, t.name, "offset", -1}, where[i].offset_field_at,
             "data at file bytes [" + std::to_string(start) + ", " + std::to_string(start + t.n_bytes) +
                 ") lies outside the file of " + std::to_string(size) + " bytes (truncated file?)");
    }
    t.data = bytes + out.data_offset + t.offset;
  }
  std::vector<size_t> order(out.tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return out.tensors[a].offset < out.tensors[b].offset; });
  for (size_t k = 1; k < order.size(); ++k) {
    const TensorInfo& prev = out.tensors[order[k - 1]];
    const TensorInfo& cur = out.tensors[order[k]];
    if (cur.offset < prev.offset + prev.n_bytes) {
      p.fail({where[order[k]].label, cur.name, "offset", -1}, where[order[k]].offset_field_at,
             "data [" + std::to_string(cur.offset) + ", " + std::to_string(cur.offset + cur.n_bytes) +
                 ") overlaps tensor '" + printable(prev.name) + "' at [" + std::to_string(prev.offset) +
                 ", " + std::to_string(prev.offset + prev.n_bytes) + ") of the data section");
    }
  }
}

}  // namespace

ParsedShard parse_shard(const uint8_t* bytes, size_t size, const std::string& name) {
  Parser p(bytes, size, name);
  ParsedShard out;
  uint64_t n_tensors = 0;
  uint64_t n_kv = 0;
  read_header(p, out, n_tensors, n_kv, bytes);
  read_metadata(p, out, n_kv);
  std::vector<TensorWhere> where;
  read_tensor_infos(p, out, n_tensors, where);
  place_tensor_data(p, out, bytes, size, where);
  return out;
}

}  // namespace moraine::gguf::detail
