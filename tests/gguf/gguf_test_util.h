// Helpers shared by the GGUF tests: a scratch directory, a byte-level GGUF builder for crafted
// (often malformed) files, value comparison, and file reading.
#pragma once
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "common/gguf/gguf.h"

namespace moraine::gguf::testing {

// A fresh directory under the system temp dir, removed with everything in it.
class ScratchDir {
 public:
  ScratchDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "moraine-gguf-XXXXXX").string();
    if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

// Appends GGUF fields one by one, so a test can place any value (valid or not) anywhere and
// knows the byte offset of every field it wrote (`size()` before the append).
class RawGguf {
 public:
  size_t size() const { return bytes_.size(); }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

  template <class T>
  size_t put(T v) {
    const size_t at = bytes_.size();
    bytes_.resize(at + sizeof(T));
    std::memcpy(bytes_.data() + at, &v, sizeof(T));
    return at;
  }
  size_t str(std::string_view s) {
    const size_t at = put<uint64_t>(s.size());
    bytes_.insert(bytes_.end(), s.begin(), s.end());
    return at;
  }
  size_t raw(std::string_view s) {
    const size_t at = bytes_.size();
    bytes_.insert(bytes_.end(), s.begin(), s.end());
    return at;
  }
  // Magic, version, counts; returns the offset of the header (always 0).
  size_t header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
    const size_t at = raw("GGUF");
    put<uint32_t>(version);
    put<uint64_t>(n_tensors);
    put<uint64_t>(n_kv);
    return at;
  }
  // A u32 metadata pair; returns the offset of the key.
  size_t kv_u32(std::string_view key, uint32_t v) {
    const size_t at = str(key);
    put<uint32_t>(static_cast<uint32_t>(ValueType::UINT32));
    put<uint32_t>(v);
    return at;
  }
  struct TensorFieldOffsets {
    size_t name, n_dims, dims, type, offset;
  };
  TensorFieldOffsets tensor_info(std::string_view name, const std::vector<int64_t>& dims, uint32_t type,
                                 uint64_t offset) {
    TensorFieldOffsets o{};
    o.name = str(name);
    o.n_dims = put<uint32_t>(static_cast<uint32_t>(dims.size()));
    o.dims = bytes_.size();
    for (int64_t d : dims) put<int64_t>(d);
    o.type = put<uint32_t>(type);
    o.offset = put<uint64_t>(offset);
    return o;
  }
  void pad_to(size_t alignment) { bytes_.resize((bytes_.size() + alignment - 1) / alignment * alignment, 0); }
  void zeros(size_t n) { bytes_.resize(bytes_.size() + n, 0); }

 private:
  std::vector<uint8_t> bytes_;
};

// Same type and same payload (floats compared bit for bit at the width the type stores).
inline ::testing::AssertionResult same_value(const Value& a, const Value& b, const std::string& where = "") {
  if (a.type() != b.type()) {
    return ::testing::AssertionFailure() << where << ": type " << value_type_name(a.type()) << " vs "
                                         << value_type_name(b.type());
  }
  switch (a.type()) {
    case ValueType::FLOAT32: {
      const float x = static_cast<float>(*a.as_f64()), y = static_cast<float>(*b.as_f64());
      if (std::memcmp(&x, &y, sizeof x) != 0) return ::testing::AssertionFailure() << where << ": " << x << " vs " << y;
      return ::testing::AssertionSuccess();
    }
    case ValueType::FLOAT64: {
      const double x = *a.as_f64(), y = *b.as_f64();
      if (std::memcmp(&x, &y, sizeof x) != 0) return ::testing::AssertionFailure() << where << ": " << x << " vs " << y;
      return ::testing::AssertionSuccess();
    }
    case ValueType::BOOL:
      if (*a.as_bool() != *b.as_bool()) return ::testing::AssertionFailure() << where << ": bool differs";
      return ::testing::AssertionSuccess();
    case ValueType::STRING:
      if (*a.as_string() != *b.as_string()) return ::testing::AssertionFailure() << where << ": string differs";
      return ::testing::AssertionSuccess();
    case ValueType::ARRAY: {
      const Array& x = *a.as_array();
      const Array& y = *b.as_array();
      if (x.elem_type != y.elem_type || x.items.size() != y.items.size()) {
        return ::testing::AssertionFailure() << where << ": array " << value_type_name(x.elem_type) << " x "
                                             << x.items.size() << " vs " << value_type_name(y.elem_type) << " x "
                                             << y.items.size();
      }
      for (size_t i = 0; i < x.items.size(); ++i) {
        auto r = same_value(x.items[i], y.items[i], where + "[" + std::to_string(i) + "]");
        if (!r) return r;
      }
      return ::testing::AssertionSuccess();
    }
    default:
      if (a.as_u64() != b.as_u64() || a.as_i64() != b.as_i64()) {
        return ::testing::AssertionFailure() << where << ": integer differs";
      }
      return ::testing::AssertionSuccess();
  }
}

// Path of an llama.cpp vocab file from the oracle cache; fails the test if the cache is missing.
inline std::string vocab_path(const std::string& name) {
  const std::string p = std::string(MORAINE_SOURCE_DIR) + "/.cache/oracle/llama.cpp/models/ggml-vocab-" + name + ".gguf";
  if (!std::filesystem::exists(p)) {
    ADD_FAILURE() << p << " is missing: run tests/oracle/setup to fetch the oracle cache";
  }
  return p;
}

}  // namespace moraine::gguf::testing
