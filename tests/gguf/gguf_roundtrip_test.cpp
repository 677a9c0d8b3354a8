// Writer -> reader round trips on fresh random data: every value type, nested and empty arrays,
// tensors of several types under several alignments, streamed tensors, writer errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>

#include <cmath>
#include <limits>
#include <random>

#include "tests/gguf/gguf_test_util.h"

namespace moraine::gguf {
namespace {

using ::testing::HasSubstr;
using testing::read_bytes;
using testing::same_value;
using testing::ScratchDir;

// Whether DIR holds a writer's temp file (NAME.tmp.PID.N) for anything.
bool has_temp_file(const ScratchDir& dir) {
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    if (e.path().filename().string().find(".tmp.") != std::string::npos) return true;
  }
  return false;
}

class RandomValues {
 public:
  explicit RandomValues(uint64_t seed) : rng_(seed) {}

  template <class T>
  T integer() {
    return static_cast<T>(rng_());
  }
  std::string bytes_string(size_t max_len) {
    std::string s(std::uniform_int_distribution<size_t>(0, max_len)(rng_), '\0');
    for (char& c : s) c = static_cast<char>(rng_());  // any byte, NULs and invalid UTF-8 included
    return s;
  }
  float f32() {
    // Mostly random bit patterns (denormals, infinities), but no NaN: NaN payloads are not
    // guaranteed to survive the float -> double -> float widening Value does.
    for (;;) {
      const uint32_t bits = static_cast<uint32_t>(rng_());
      float f;
      std::memcpy(&f, &bits, sizeof f);
      if (!std::isnan(f)) return f;
    }
  }
  double f64() {
    for (;;) {
      const uint64_t bits = rng_();
      double d;
      std::memcpy(&d, &bits, sizeof d);
      if (!std::isnan(d)) return d;
    }
  }
  Value scalar(ValueType t) {
    switch (t) {
      case ValueType::UINT8: return Value::u8(integer<uint8_t>());
      case ValueType::INT8: return Value::i8(integer<int8_t>());
      case ValueType::UINT16: return Value::u16(integer<uint16_t>());
      case ValueType::INT16: return Value::i16(integer<int16_t>());
      case ValueType::UINT32: return Value::u32(integer<uint32_t>());
      case ValueType::INT32: return Value::i32(integer<int32_t>());
      case ValueType::UINT64: return Value::u64(integer<uint64_t>());
      case ValueType::INT64: return Value::i64(integer<int64_t>());
      case ValueType::FLOAT32: return Value::f32(f32());
      case ValueType::FLOAT64: return Value::f64(f64());
      case ValueType::BOOL: return Value::boolean(rng_() & 1);
      case ValueType::STRING: return Value::string(bytes_string(40));
      case ValueType::ARRAY: break;
    }
    throw std::logic_error("not a scalar type");
  }
  Value array(ValueType elem, size_t n) {
    std::vector<Value> items;
    for (size_t i = 0; i < n; ++i) items.push_back(scalar(elem));
    return Value::array(elem, std::move(items));
  }
  std::mt19937_64& rng() { return rng_; }

 private:
  std::mt19937_64 rng_;
};

const ValueType kScalarTypes[] = {ValueType::UINT8,  ValueType::INT8,    ValueType::UINT16, ValueType::INT16,
                                  ValueType::UINT32, ValueType::INT32,   ValueType::UINT64, ValueType::INT64,
                                  ValueType::FLOAT32, ValueType::FLOAT64, ValueType::BOOL,  ValueType::STRING};

TEST(GgufRoundTrip, EveryValueTypeNestedAndEmptyArrays) {
  RandomValues rv(20240601);
  GgufWriter w;
  for (ValueType t : kScalarTypes) {
    const std::string name(value_type_name(t));
    w.set("scalar." + name, rv.scalar(t));
    w.set("array." + name, rv.array(t, 1 + rv.rng()() % 300));
    w.set("empty." + name, Value::array(t, {}));
  }
  // Extremes a random draw rarely hits.
  w.set("edge.u64max", Value::u64(std::numeric_limits<uint64_t>::max()));
  w.set("edge.i64min", Value::i64(std::numeric_limits<int64_t>::min()));
  w.set("edge.i8min", Value::i8(-128));
  w.set("edge.neg_zero", Value::f32(-0.0f));
  w.set("edge.inf", Value::f64(-std::numeric_limits<double>::infinity()));
  w.set("edge.empty_string", Value::string(""));
  // Nesting: arrays of arrays (of every scalar type), an array of empty arrays, three levels.
  std::vector<Value> of_arrays;
  for (ValueType t : kScalarTypes) {
    std::vector<Value> inner;
    for (int i = 0; i < 4; ++i) inner.push_back(rv.array(t, rv.rng()() % 5));
    w.set("nested." + std::string(value_type_name(t)), Value::array(ValueType::ARRAY, inner));
  }
  w.set("nested.of_empty", Value::array(ValueType::ARRAY, {Value::array(ValueType::STRING, {}),
                                                            Value::array(ValueType::STRING, {})}));
  std::vector<Value> level2;
  for (int i = 0; i < 3; ++i) {
    level2.push_back(Value::array(ValueType::ARRAY, {rv.array(ValueType::INT16, 3), rv.array(ValueType::INT16, 0)}));
  }
  w.set("nested.three_levels", Value::array(ValueType::ARRAY, level2));
  w.set("nested.empty_of_arrays", Value::array(ValueType::ARRAY, {}));
  w.set("strings.helper", Value::string_array({"a", "", std::string("\0b", 2)}));

  ScratchDir dir;
  const std::string path = dir.file("values.gguf");
  w.write(path);
  EXPECT_FALSE(has_temp_file(dir));
  const GgufFile f = GgufFile::open(path);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_TRUE(f.tensors().empty());

  // Order, keys and values all survive.
  const Value* expected_first = w.find("scalar.u8");
  ASSERT_NE(expected_first, nullptr);
  ASSERT_EQ(f.metadata().size(), 12u * 3 + 6 + 12 + 3 + 1);
  EXPECT_EQ(f.metadata().front().first, "scalar.u8");
  for (const auto& [key, value] : f.metadata()) {
    const Value* want = w.find(key);
    ASSERT_NE(want, nullptr) << key;
    EXPECT_TRUE(same_value(*want, value, key));
  }
  // Typed getters widen and refuse what does not fit.
  EXPECT_EQ(f.get_u64("edge.u64max"), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(f.get_i64("edge.u64max"), std::nullopt);
  EXPECT_EQ(f.get_i64("edge.i64min"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(f.get_u64("edge.i8min"), std::nullopt);
  EXPECT_EQ(f.get_string("edge.empty_string"), "");
  EXPECT_EQ(f.get_string("scalar.u8"), std::nullopt);
  EXPECT_EQ(f.get_array("strings.helper")->items.size(), 3u);
  EXPECT_EQ(*f.get_array("strings.helper")->items[2].as_string(), std::string("\0b", 2));

  // Writing the read metadata again reproduces the file byte for byte.
  GgufWriter again;
  for (const auto& [key, value] : f.metadata()) again.set(key, value);
  again.write(dir.file("again.gguf"));
  EXPECT_EQ(read_bytes(path), read_bytes(dir.file("again.gguf")));
}

TEST(GgufRoundTrip, WriterSetReplacesAndRemoveDeletes) {
  GgufWriter w;
  w.set("a", Value::u32(1));
  w.set("b", Value::u32(2));
  w.set("a", Value::string("x"));
  w.remove("b");
  ScratchDir dir;
  w.write(dir.file("r.gguf"));
  const GgufFile f = GgufFile::open(dir.file("r.gguf"));
  ASSERT_EQ(f.metadata().size(), 1u);
  EXPECT_EQ(f.get_string("a"), "x");
  EXPECT_EQ(f.find("b"), nullptr);
}

struct TensorCase {
  std::string name;
  std::vector<int64_t> shape;
  TensorType type;
  std::vector<uint8_t> data;
};

std::vector<TensorCase> random_tensors(std::mt19937_64& rng) {
  const std::pair<TensorType, std::vector<int64_t>> shapes[] = {
      {TensorType::F32, {7}},          {TensorType::F16, {33, 3}},     {TensorType::Q4_0, {64, 5}},
      {TensorType::Q4_K, {512, 2, 3}}, {TensorType::Q8_0, {32, 1, 1, 2}}, {TensorType::BF16, {5, 5}},
      {TensorType::I8, {3}},           {TensorType::MXFP4, {96, 4}},   {TensorType::Q6_K, {256, 3}},
  };
  std::vector<TensorCase> out;
  int i = 0;
  for (const auto& [type, shape] : shapes) {
    TensorCase c{"blk." + std::to_string(i % 3) + ".t" + std::to_string(i), shape, type, {}};
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const TypeTraits& tr = type_traits(type);
    c.data.resize(static_cast<size_t>(n / tr.block_elems) * tr.block_bytes);
    for (uint8_t& b : c.data) b = static_cast<uint8_t>(rng());
    out.push_back(std::move(c));
    ++i;
  }
  return out;
}

class GgufTensorAlignment : public ::testing::TestWithParam<uint32_t> {};

TEST_P(GgufTensorAlignment, TensorsOfSeveralTypesRoundTrip) {
  const uint32_t alignment = GetParam();
  std::mt19937_64 rng(alignment * 7919u);
  const std::vector<TensorCase> cases = random_tensors(rng);
  GgufWriter w;
  w.set("general.architecture", Value::string("test"));
  if (alignment != 32) w.set("general.alignment", Value::u32(alignment));
  for (size_t i = 0; i < cases.size(); ++i) {
    const TensorCase& c = cases[i];
    if (i % 2 == 0) {
      w.add_tensor(c.name, c.shape, c.type, c.data.data(), c.data.size());
    } else {
      // Streamed: the callback gets exactly the tensor's byte count.
      w.add_tensor(c.name, c.shape, c.type, [&c](uint8_t* dst, uint64_t n) {
        ASSERT_EQ(n, c.data.size());
        std::memcpy(dst, c.data.data(), n);
      });
    }
  }
  ScratchDir dir;
  const std::string path = dir.file("t.gguf");
  w.write(path);
  const GgufFile f = GgufFile::open(path);
  EXPECT_EQ(f.alignment(), alignment);
  EXPECT_EQ(f.data_offset() % alignment, 0u);
  ASSERT_EQ(f.tensors().size(), cases.size());
  const std::vector<uint8_t> bytes = read_bytes(path);
  uint64_t expected_offset = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const TensorInfo& t = f.tensors()[i];
    const TensorCase& c = cases[i];
    EXPECT_EQ(t.name, c.name);
    EXPECT_EQ(t.shape, c.shape);
    EXPECT_EQ(t.type, c.type);
    EXPECT_EQ(t.n_bytes, c.data.size());
    EXPECT_EQ(t.offset, expected_offset) << "tensors are laid out in add order, each aligned";
    EXPECT_EQ(t.offset % alignment, 0u);
    ASSERT_EQ(std::memcmp(t.data, c.data.data(), c.data.size()), 0) << c.name;
    EXPECT_EQ(f.find_tensor(c.name), &t);
    // Padding between tensors is zeros.
    const uint64_t end = f.data_offset() + t.offset + t.n_bytes;
    const uint64_t padded = f.data_offset() + ((t.offset + t.n_bytes + alignment - 1) / alignment) * alignment;
    for (uint64_t b = end; b < padded; ++b) ASSERT_EQ(bytes[b], 0) << "padding byte " << b;
    expected_offset = padded - f.data_offset();
  }
  EXPECT_EQ(bytes.size(), f.data_offset() + expected_offset) << "the last tensor is padded too";
  EXPECT_EQ(f.find_tensor("missing"), nullptr);
  EXPECT_EQ(f.tensors()[3].n_elements(), 512 * 2 * 3);
  EXPECT_EQ(f.tensors()[3].n_rows(), 6);

  // And written again from the reader's view: identical bytes.
  GgufWriter again;
  for (const auto& [k, v] : f.metadata()) again.set(k, v);
  for (const TensorInfo& t : f.tensors()) again.add_tensor(t.name, t.shape, t.type, t.data, t.n_bytes);
  again.write(dir.file("again.gguf"));
  EXPECT_EQ(bytes, read_bytes(dir.file("again.gguf")));
}

INSTANTIATE_TEST_SUITE_P(Alignments, GgufTensorAlignment, ::testing::Values(1u, 8u, 32u, 64u, 4096u));

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no exception";
}

TEST(GgufWriterErrors, ShapeThatDoesNotMatchBytesIsRejected) {
  GgufWriter w;
  std::vector<uint8_t> data(100);
  EXPECT_THAT(error_of([&] { w.add_tensor("w", {10, 3}, TensorType::F32, data.data(), 100); }),
              HasSubstr("given 100 bytes but its shape and type f32 need 120"));
  EXPECT_THAT(error_of([&] { w.add_tensor("q", {100}, TensorType::Q4_K, data.data(), 100); }),
              HasSubstr("not a multiple of the q4_k block size 256"));
  EXPECT_THAT(error_of([&] { w.add_tensor("z", {4, 0}, TensorType::F32, data.data(), 0); }),
              HasSubstr("dimension 0 is not positive"));
  EXPECT_THAT(error_of([&] { w.add_tensor("d", {1, 1, 1, 1, 1}, TensorType::F32, data.data(), 4); }),
              HasSubstr("5 dimensions"));
  w.add_tensor("ok", {25}, TensorType::F32, data.data(), 100);
  EXPECT_THAT(error_of([&] { w.add_tensor("ok", {25}, TensorType::F32, data.data(), 100); }),
              HasSubstr("added twice"));
  w.set("general.alignment", Value::u32(48));
  ScratchDir dir;
  EXPECT_THAT(error_of([&] { w.write(dir.file("x.gguf")); }), HasSubstr("power of two"));
  EXPECT_FALSE(std::filesystem::exists(dir.file("x.gguf")));
  w.set("k", Value::array(ValueType::INT32, {Value::i32(1), Value::u8(2)}));
  w.set("general.alignment", Value::u32(64));
  EXPECT_THAT(error_of([&] { w.write(dir.file("x.gguf")); }), HasSubstr("array item 1 is u8 but the array holds i32"));
}

TEST(GgufWriterErrors, DiskFullIsAClearErrorAndLeavesNoFile) {
  // RLIMIT_FSIZE makes write() fail with EFBIG past the limit, the same path a full disk takes
  // (ENOSPC), without needing a small filesystem.
  ScratchDir dir;
  const std::string path = dir.file("big.gguf");
  std::vector<uint8_t> data(1 << 20, 0x5a);
  GgufWriter w;
  w.add_tensor("big", {static_cast<int64_t>(data.size())}, TensorType::I8, data.data(), data.size());
  struct rlimit old {};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  auto old_handler = signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 64 * 1024;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string msg = error_of([&] { w.write(path); });
  setrlimit(RLIMIT_FSIZE, &old);
  signal(SIGXFSZ, old_handler);
  EXPECT_THAT(msg, HasSubstr(path + ".tmp"));
  EXPECT_THAT(msg, HasSubstr("cannot write"));
  EXPECT_THAT(msg, HasSubstr("File too large"));
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(has_temp_file(dir));
}

TEST(GgufWriterErrors, UnwritableDirectoryNamesThePath) {
  GgufWriter w;
  const std::string msg = error_of([&] { w.write("/nonexistent-dir-moraine/x.gguf"); });
  EXPECT_THAT(msg, HasSubstr("/nonexistent-dir-moraine/x.gguf.tmp."));
  EXPECT_THAT(msg, HasSubstr(": cannot create"));
}

TEST(GgufWriterErrors, FillThatThrowsLeavesNoFile) {
  ScratchDir dir;
  GgufWriter w;
  w.add_tensor("t", {8}, TensorType::F32, [](uint8_t*, uint64_t) { throw std::runtime_error("source gone"); });
  EXPECT_EQ(error_of([&] { w.write(dir.file("f.gguf")); }), "source gone");
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

}  // namespace
}  // namespace moraine::gguf
