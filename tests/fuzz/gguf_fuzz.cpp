// libFuzzer target: GgufFile::from_bytes on arbitrary bytes must either parse or throw
// GgufError - never crash, leak past the file, or throw anything else. A file that parses is
// written back with GgufWriter and re-read; both views must agree (an oracle for the parser
// and the writer together).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "common/gguf/gguf.h"

namespace {

using moraine::gguf::Array;
using moraine::gguf::GgufError;
using moraine::gguf::GgufFile;
using moraine::gguf::GgufWriter;
using moraine::gguf::TensorInfo;
using moraine::gguf::Value;
using moraine::gguf::ValueType;

[[noreturn]] void mismatch(const char* what) {
  std::fprintf(stderr, "gguf_fuzz: round trip mismatch: %s\n", what);
  std::abort();
}

// Reads every part of the value so ASan sees any bad memory behind it.
uint64_t touch(const Value& v) {
  uint64_t h = static_cast<uint64_t>(v.type());
  if (auto u = v.as_u64()) h += *u;
  if (auto i = v.as_i64()) h += static_cast<uint64_t>(*i);
  if (auto d = v.as_f64()) h += static_cast<uint64_t>(*d != *d);
  if (auto b = v.as_bool()) h += *b;
  if (const std::string* s = v.as_string()) {
    for (char c : *s) h = h * 31 + static_cast<unsigned char>(c);
  }
  if (const Array* a = v.as_array()) {
    for (const Value& item : a->items) h += touch(item);
  }
  return h + v.to_display(3).size();
}

bool same(const Value& a, const Value& b) {
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case ValueType::FLOAT32: {
      const float x = static_cast<float>(*a.as_f64()), y = static_cast<float>(*b.as_f64());
      return std::memcmp(&x, &y, sizeof x) == 0;
    }
    case ValueType::FLOAT64: {
      const double x = *a.as_f64(), y = *b.as_f64();
      return std::memcmp(&x, &y, sizeof x) == 0;
    }
    case ValueType::BOOL: return *a.as_bool() == *b.as_bool();
    case ValueType::STRING: return *a.as_string() == *b.as_string();
    case ValueType::ARRAY: {
      const Array& x = *a.as_array();
      const Array& y = *b.as_array();
      if (x.elem_type != y.elem_type || x.items.size() != y.items.size()) return false;
      for (size_t i = 0; i < x.items.size(); ++i) {
        if (!same(x.items[i], y.items[i])) return false;
      }
      return true;
    }
    default: return a.as_u64() == b.as_u64() && a.as_i64() == b.as_i64();
  }
}

const std::string& scratch_path() {
  static const std::string path = [] {
    const char* dir = std::getenv("TMPDIR");
    return std::string(dir ? dir : "/tmp") + "/gguf_fuzz_" + std::to_string(::getpid()) + ".gguf";
  }();
  return path;
}

void round_trip(const GgufFile& f) {
  GgufWriter w;
  for (const auto& [key, value] : f.metadata()) w.set(key, value);
  for (const TensorInfo& t : f.tensors()) w.add_tensor(t.name, t.shape, t.type, t.data, t.n_bytes);
  w.write(scratch_path());  // anything it throws for a file the reader accepted is a bug
  const GgufFile g = GgufFile::open(scratch_path());
  std::filesystem::remove(scratch_path());
  if (g.metadata().size() != f.metadata().size()) mismatch("metadata count");
  for (size_t i = 0; i < f.metadata().size(); ++i) {
    if (g.metadata()[i].first != f.metadata()[i].first) mismatch("key");
    if (!same(g.metadata()[i].second, f.metadata()[i].second)) mismatch("value");
  }
  if (g.tensors().size() != f.tensors().size()) mismatch("tensor count");
  for (size_t i = 0; i < f.tensors().size(); ++i) {
    const TensorInfo& a = f.tensors()[i];
    const TensorInfo& b = g.tensors()[i];
    if (a.name != b.name || a.shape != b.shape || a.type != b.type || a.n_bytes != b.n_bytes) mismatch("tensor info");
    if (std::memcmp(a.data, b.data, a.n_bytes) != 0) mismatch("tensor data");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const GgufFile f = GgufFile::from_bytes(data, size, "fuzz.gguf");
    uint64_t h = f.version() + f.alignment() + f.file_bytes() + f.data_offset();
    for (const auto& [key, value] : f.metadata()) {
      h += key.size() + touch(value);
      if (f.find(key) == nullptr) mismatch("find(key)");
    }
    for (const TensorInfo& t : f.tensors()) {
      h += static_cast<uint64_t>(t.n_elements() + t.n_rows());
      for (uint64_t i = 0; i < t.n_bytes; ++i) h += t.data[i];
      if (f.find_tensor(t.name) != &t) mismatch("find_tensor");
    }
    if (h == 0x5eed) std::fputc(' ', stderr);  // keeps `h` (and the reads) alive
    round_trip(f);
  } catch (const GgufError&) {
    // Rejected with a message: the expected outcome for almost every input.
  }
  return 0;
}
