// GgufWriter: serialises metadata and tensor infos, then streams tensor data, each tensor
// padded with zeros to the alignment, through fileio::AtomicFile (temp file, fsync, rename).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <system_error>
#include <unordered_set>

#include "common/fileio/atomic_file.h"
#include "common/gguf/gguf.h"
#include "common/gguf/gguf_parse.h"

namespace moraine::gguf {
namespace {

class ByteBuffer {
 public:
  template <class T>
  void put(T v) {
    const size_t at = bytes_.size();
    bytes_.resize(at + sizeof(T));
    std::memcpy(bytes_.data() + at, &v, sizeof(T));
  }
  void put_string(std::string_view s) {
    put<uint64_t>(s.size());
    bytes_.insert(bytes_.end(), s.begin(), s.end());
  }
  void pad_to(uint64_t alignment) {
    bytes_.resize((bytes_.size() + alignment - 1) & ~(alignment - 1), 0);
  }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
};

void put_value(ByteBuffer& out, const Value& v, const std::string& key) {
  switch (v.type()) {
    case ValueType::UINT8: out.put(static_cast<uint8_t>(*v.as_u64())); return;
    case ValueType::INT8: out.put(static_cast<int8_t>(*v.as_i64())); return;
    case ValueType::UINT16: out.put(static_cast<uint16_t>(*v.as_u64())); return;
    case ValueType::INT16: out.put(static_cast<int16_t>(*v.as_i64())); return;
    case ValueType::UINT32: out.put(static_cast<uint32_t>(*v.as_u64())); return;
    case ValueType::INT32: out.put(static_cast<int32_t>(*v.as_i64())); return;
    case ValueType::UINT64: out.put(*v.as_u64()); return;
    case ValueType::INT64: out.put(*v.as_i64()); return;
    case ValueType::FLOAT32: out.put(static_cast<float>(*v.as_f64())); return;
    case ValueType::FLOAT64: out.put(*v.as_f64()); return;
    case ValueType::BOOL: out.put(static_cast<uint8_t>(*v.as_bool() ? 1 : 0)); return;
    case ValueType::STRING: out.put_string(*v.as_string()); return;
    case ValueType::ARRAY: {
      const Array& a = *v.as_array();
      out.put(static_cast<uint32_t>(a.elem_type));
      out.put<uint64_t>(a.items.size());
      for (size_t i = 0; i < a.items.size(); ++i) {
        if (a.items[i].type() != a.elem_type) {
          throw std::invalid_argument("GGUF metadata '" + key + "': array item " + std::to_string(i) +
                                      " is " + std::string(value_type_name(a.items[i].type())) +
                                      " but the array holds " +
                                      std::string(value_type_name(a.elem_type)));
        }
        put_value(out, a.items[i], key);
      }
      return;
    }
  }
  throw std::invalid_argument("GGUF metadata '" + key + "': unknown value type");
}

}  // namespace

void GgufWriter::set(const std::string& key, Value v) {
  for (auto& [k, old] : metadata_) {
    if (k == key) {
      old = std::move(v);
      return;
    }
  }
  metadata_.emplace_back(key, std::move(v));
}

void GgufWriter::remove(const std::string& key) {
  std::erase_if(metadata_, [&](const auto& kv) { return kv.first == key; });
}

const Value* GgufWriter::find(std::string_view key) const {
  for (const auto& [k, v] : metadata_) {
    if (k == key) return &v;
  }
  return nullptr;
}

uint64_t GgufWriter::alignment() const {
  const Value* v = find("general.alignment");
  if (!v) return detail::kDefaultAlignment;
  const std::optional<uint64_t> a = v->as_u64();
  if (v->type() != ValueType::UINT32 || !a || *a == 0 || !std::has_single_bit(*a)) {
    throw std::invalid_argument("GGUF metadata 'general.alignment' must be a u32 power of two, got " +
                                std::string(value_type_name(v->type())) + " " + v->to_display());
  }
  return *a;
}

void GgufWriter::check_new_tensor(const std::string& name, const std::vector<int64_t>& shape,
                                  TensorType type, uint64_t n_bytes) const {
  auto bad = [&](const std::string& why) {
    throw std::invalid_argument("GGUF tensor '" + name + "': " + why);
  };
  const TypeTraits* traits = find_type_traits(static_cast<uint32_t>(type));
  if (!traits) bad("unknown tensor type id " + std::to_string(static_cast<uint32_t>(type)));
  if (shape.empty() || shape.size() > detail::kMaxDims) {
    bad("has " + std::to_string(shape.size()) + " dimensions; GGUF allows 1.." +
        std::to_string(detail::kMaxDims));
  }
  int64_t n_elements = 1;
  for (int64_t d : shape) {
    if (d <= 0) bad("dimension " + std::to_string(d) + " is not positive");
    if (__builtin_mul_overflow(n_elements, d, &n_elements)) bad("element count overflows int64");
  }
  if (shape[0] % traits->block_elems != 0) {
    bad("first dimension " + std::to_string(shape[0]) + " is not a multiple of the " +
        std::string(traits->name) + " block size " + std::to_string(traits->block_elems));
  }
  uint64_t expected = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(n_elements / traits->block_elems),
                             uint64_t{traits->block_bytes}, &expected)) {
    bad("byte size overflows 64 bits");
  }
  if (n_bytes != expected) {
    bad("given " + std::to_string(n_bytes) + " bytes but its shape and type " +
        std::string(traits->name) + " need " + std::to_string(expected));
  }
  for (const PendingTensor& t : tensors_) {
    if (t.name == name) bad("added twice");
  }
}

void GgufWriter::add_tensor(std::string name, std::vector<int64_t> shape, TensorType type,
                            const void* data, uint64_t n_bytes) {
  check_new_tensor(name, shape, type, n_bytes);
  if (!data && n_bytes > 0) throw std::invalid_argument("GGUF tensor '" + name + "': data is null");
  tensors_.push_back({std::move(name), std::move(shape), type, n_bytes, data, nullptr});
}

void GgufWriter::add_tensor(std::string name, std::vector<int64_t> shape, TensorType type, Fill fill) {
  if (!fill) throw std::invalid_argument("GGUF tensor '" + name + "': fill callback is empty");
  const TypeTraits* traits = find_type_traits(static_cast<uint32_t>(type));
  uint64_t n_bytes = 0;
  if (traits && !shape.empty() && shape[0] > 0 && shape[0] % traits->block_elems == 0) {
    // Compute the size the shape implies; check_new_tensor then validates everything else.
    int64_t n = 1;
    bool overflow = false;
    for (int64_t d : shape) overflow |= d <= 0 || __builtin_mul_overflow(n, d, &n);
    if (!overflow) n_bytes = static_cast<uint64_t>(n / traits->block_elems) * traits->block_bytes;
  }
  check_new_tensor(name, shape, type, n_bytes);
  tensors_.push_back({std::move(name), std::move(shape), type, n_bytes, nullptr, std::move(fill)});
}

void GgufWriter::write(const std::string& path) const {
  const uint64_t align = alignment();
  ByteBuffer head;
  head.put<uint32_t>(0x46554747);  // "GGUF" read as a little-endian u32
  head.put<uint32_t>(3);
  head.put<uint64_t>(tensors_.size());
  head.put<uint64_t>(metadata_.size());
  for (const auto& [key, value] : metadata_) {
    head.put_string(key);
    head.put(static_cast<uint32_t>(value.type()));
    put_value(head, value, key);
  }
  uint64_t offset = 0;
  for (const PendingTensor& t : tensors_) {
    head.put_string(t.name);
    head.put(static_cast<uint32_t>(t.shape.size()));
    for (int64_t d : t.shape) head.put(d);
    head.put(static_cast<uint32_t>(t.type));
    head.put(offset);
    offset += (t.n_bytes + align - 1) & ~(align - 1);
  }
  // A file without tensors ends right after its infos (as llama.cpp's vocab files do), so the
  // data section's padding is written only when there is data.
  if (!tensors_.empty()) head.pad_to(align);

  fileio::AtomicFile out(path);
  out.write(head.bytes().data(), head.bytes().size());
  std::vector<uint8_t> staging;
  for (const PendingTensor& t : tensors_) {
    if (t.bytes) {
      out.write(t.bytes, t.n_bytes);
    } else {
      staging.assign(t.n_bytes, 0);
      t.fill(staging.data(), t.n_bytes);
      out.write(staging.data(), t.n_bytes);
    }
    static constexpr uint8_t kZeros[256] = {};
    for (uint64_t pad = ((t.n_bytes + align - 1) & ~(align - 1)) - t.n_bytes; pad > 0;) {
      const uint64_t k = std::min<uint64_t>(pad, sizeof kZeros);
      out.write(kZeros, k);
      pad -= k;
    }
  }
  out.commit();
}

}  // namespace moraine::gguf
