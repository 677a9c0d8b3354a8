// One crafted file per malformed case: each must be a GgufError whose message names the file,
// the field and the byte offset where the problem lies.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "tests/gguf/gguf_test_util.h"

namespace moraine::gguf {
namespace {

using ::testing::HasSubstr;
using testing::RawGguf;

constexpr uint32_t kF32 = 0;
constexpr uint32_t kF64 = 28;
constexpr uint32_t kQ4K = 12;

// Parses the crafted bytes and returns the GgufError message (failing the test if none).
std::string error_of(const RawGguf& raw, const std::string& name = "crafted.gguf") {
  try {
    GgufFile::from_bytes(raw.bytes().data(), raw.size(), name);
  } catch (const GgufError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no GgufError for " << name;
  return "";
}

std::string at(size_t offset) { return "(byte offset " + std::to_string(offset) + ")"; }

TEST(GgufMalformed, BadMagic) {
  RawGguf r;
  r.raw("GGML");
  r.put<uint32_t>(3);
  r.zeros(16);
  const std::string msg = error_of(r);
  EXPECT_THAT(msg, HasSubstr("crafted.gguf: header magic: bad magic"));
  EXPECT_THAT(msg, HasSubstr("found 47 47 4d 4c"));
  EXPECT_THAT(msg, HasSubstr(at(0)));
}

TEST(GgufMalformed, OldVersionsSayV3IsRequired) {
  for (uint32_t v : {1u, 2u}) {
    RawGguf r;
    r.header(0, 0, v);
    const std::string msg = error_of(r);
    EXPECT_THAT(msg, HasSubstr("header version: GGUF version " + std::to_string(v) + " is not supported; v3 is required"));
    EXPECT_THAT(msg, HasSubstr(at(4)));
  }
  RawGguf big_endian;
  big_endian.header(0, 0, 0x03000000u);
  EXPECT_THAT(error_of(big_endian), HasSubstr("big-endian"));
}

TEST(GgufMalformed, TruncatedHeader) {
  RawGguf r;
  r.raw("GGUF");
  r.put<uint32_t>(3);
  r.put<uint32_t>(0);  // half of tensor_count
  const std::string msg = error_of(r);
  EXPECT_THAT(msg, HasSubstr("header tensor_count: truncated: needs 8 bytes but the file ends after 4"));
  EXPECT_THAT(msg, HasSubstr(at(8)));
  EXPECT_THAT(error_of(RawGguf{}), HasSubstr("header magic: truncated"));
}

TEST(GgufMalformed, KeyLengthPastEndOfFile) {
  RawGguf r;
  r.header(0, 1);
  const size_t key = r.put<uint64_t>(1000);
  r.raw("abc");
  r.zeros(10);
  const std::string msg = error_of(r);
  EXPECT_THAT(msg, HasSubstr("metadata #0 key: string length 1000 runs past the end of the file (13 bytes left)"));
  EXPECT_THAT(msg, HasSubstr(at(key)));
}

TEST(GgufMalformed, StringValueLengthPastEndOfFile) {
  RawGguf r;
  r.header(0, 1);
  r.str("general.name");
  r.put<uint32_t>(static_cast<uint32_t>(ValueType::STRING));
  const size_t value = r.put<uint64_t>(uint64_t{1} << 62);
  r.zeros(16);
  const std::string msg = error_of(r);
  EXPECT_THAT(msg, HasSubstr("metadata 'general.name': string length 4611686018427387904 runs past the end"));
  EXPECT_THAT(msg, HasSubstr(at(value)));
}

TEST(GgufMalformed, ArrayLengthPastEndOfFile) {
  RawGguf r;
  r.header(0, 1);
  r.str("tokenizer.ggml.scores");
  r.put<uint32_t>(static_cast<uint32_t>(ValueType::ARRAY));
  const size_t array = r.put<uint32_t>(static_cast<uint32_t>(ValueType::FLOAT32));
  r.put<uint64_t>(1000);
  r.zeros(40);
  const std::string msg = error_of(r);
  EXPECT_THAT(msg, HasSubstr("metadata 'tokenizer.ggml.scores': array of 1000 f32 items runs past the end of the file (40 bytes left)"));
  EXPECT_THAT(msg, HasSubstr(at(array)));
}

TEST(GgufMalformed, StringItemInsideArrayPastEndOfFile) {
  RawGguf r;
  r.header(0, 1);
  r.str("tokenizer.ggml.tokens");
  r.put<uint32_t>(static_cast<uint32_t>(ValueType::ARRAY));
  r.put<uint32_t>(static_cast<uint32_t>(ValueType::STRING));
  r.put<uint64_t>(3);
  r.str("a");
  r.str("b");
  const size_t third = r.put<uint64_t>(77);
  r.raw("short");
  const std::string msg = error_of(r);
  EXPECT_THAT(msg, HasSubstr("metadata 'tokenizer.ggml.tokens' item 2: string length 77 runs past"));
  EXPECT_THAT(msg, HasSubstr(at(third)));
}

TEST(GgufMalformed, UnknownValueType) {
  RawGguf r;
  r.header(0, 1);
  r.str("k");
  const size_t type = r.put<uint32_t>(13);
  r.zeros(8);
  std::string msg = error_of(r);
  EXPECT_THAT(msg, HasSubstr("metadata 'k' value type: unknown metadata value type 13"));
  EXPECT_THAT(msg, HasSubstr(at(type)));

  RawGguf arr;
  arr.header(0, 1);
  arr.str("k");
  arr.put<uint32_t>(static_cast<uint32_t>(ValueType::ARRAY));
  const size_t elem = arr.put<uint32_t>(4242);
  arr.put<uint64_t>(0);
  msg = error_of(arr);
  EXPECT_THAT(msg, HasSubstr("metadata 'k' array element type: unknown metadata value type 4242"));
  EXPECT_THAT(msg, HasSubstr(at(elem)));
}

TEST(GgufMalformed, BoolThatIsNeitherZeroNorOne) {
  RawGguf r;
  r.header(0, 1);
  r.str("flag");
  r.put<uint32_t>(static_cast<uint32_t>(ValueType::BOOL));
  const size_t value = r.put<uint8_t>(2);
  r.zeros(12);
  const std::string msg = error_of(r);
  EXPECT_THAT(msg, HasSubstr("metadata 'flag': bool value 2 is neither 0 nor 1"));
  EXPECT_THAT(msg, HasSubstr(at(value)));
}

TEST(GgufMalformed, ArraysNestedTooDeep) {
  RawGguf r;
  r.header(0, 1);
  r.str("deep");
  r.put<uint32_t>(static_cast<uint32_t>(ValueType::ARRAY));
  size_t level64 = 0;
  for (int depth = 0; depth < 100; ++depth) {
    const size_t here = r.put<uint32_t>(static_cast<uint32_t>(ValueType::ARRAY));
    if (depth == 64) level64 = here;
    r.put<uint64_t>(1);
  }
  r.zeros(64);
  const std::string msg = error_of(r);
  EXPECT_THAT(msg, HasSubstr("metadata 'deep' item 0: arrays nested deeper than 64 levels"));
  EXPECT_THAT(msg, HasSubstr(at(level64)));
}

TEST(GgufMalformed, DuplicateKey) {
  RawGguf r;
  r.header(0, 2);
  r.kv_u32("general.alignment", 32);
  const size_t second = r.kv_u32("general.alignment", 64);
  const std::string msg = error_of(r);
  EXPECT_THAT(msg, HasSubstr("metadata #1 'general.alignment' key: duplicate key"));
  EXPECT_THAT(msg, HasSubstr(at(second)));
}

TEST(GgufMalformed, AlignmentNotAPowerOfTwoOrNotU32) {
  RawGguf r;
  r.header(0, 1);
  const size_t key = r.kv_u32("general.alignment", 48);
  const size_t value = key + 8 + 17 + 4;
  std::string msg = error_of(r);
  EXPECT_THAT(msg, HasSubstr("metadata 'general.alignment': alignment 48 is not a power of two"));
  EXPECT_THAT(msg, HasSubstr(at(value)));

  RawGguf zero;
  zero.header(0, 1);
  zero.kv_u32("general.alignment", 0);
  EXPECT_THAT(error_of(zero), HasSubstr("alignment 0 is not a power of two"));

  RawGguf wrong_type;
  wrong_type.header(0, 1);
  wrong_type.str("general.alignment");
  wrong_type.put<uint32_t>(static_cast<uint32_t>(ValueType::UINT64));
  const size_t v64 = wrong_type.put<uint64_t>(32);
  msg = error_of(wrong_type);
  EXPECT_THAT(msg, HasSubstr("metadata 'general.alignment': must be of type u32, found u64"));
  EXPECT_THAT(msg, HasSubstr(at(v64)));
}

TEST(GgufMalformed, AbsurdCounts) {
  RawGguf tensors;
  tensors.header(uint64_t{1} << 40, 0);
  tensors.zeros(100);
  std::string msg = error_of(tensors);
  EXPECT_THAT(msg, HasSubstr("header tensor_count: tensor count 1099511627776 cannot fit in the 100 bytes after the header"));
  EXPECT_THAT(msg, HasSubstr(at(8)));

  RawGguf kvs;
  kvs.header(0, ~uint64_t{0});
  msg = error_of(kvs);
  EXPECT_THAT(msg, HasSubstr("header kv_count: metadata count 18446744073709551615 cannot fit"));
  EXPECT_THAT(msg, HasSubstr(at(16)));
}

// A file with one tensor info built from the given fields, then `data_bytes` of data.
RawGguf one_tensor(const std::vector<int64_t>& dims, uint32_t type, uint64_t offset, size_t data_bytes,
                   RawGguf::TensorFieldOffsets* where, uint32_t n_dims_override = 0) {
  RawGguf r;
  r.header(1, 0);
  if (n_dims_override) {
    where->name = r.str("w");
    where->n_dims = r.put<uint32_t>(n_dims_override);
    where->dims = r.size();
    for (uint32_t i = 0; i < n_dims_override; ++i) r.put<int64_t>(1);
    where->type = r.put<uint32_t>(type);
    where->offset = r.put<uint64_t>(offset);
  } else {
    *where = r.tensor_info("w", dims, type, offset);
  }
  r.pad_to(32);
  r.zeros(data_bytes);
  return r;
}

TEST(GgufMalformed, UnknownTensorType) {
  RawGguf::TensorFieldOffsets o{};
  const RawGguf r = one_tensor({8}, 99, 0, 64, &o);
  const std::string msg = error_of(r);
  EXPECT_THAT(msg, HasSubstr("tensor #0 'w' type: unknown tensor type id 99"));
  EXPECT_THAT(msg, HasSubstr(at(o.type)));
}

TEST(GgufMalformed, TooManyOrZeroDims) {
  RawGguf::TensorFieldOffsets o{};
  std::string msg = error_of(one_tensor({}, kF32, 0, 64, &o, 5));
  EXPECT_THAT(msg, HasSubstr("tensor #0 'w' n_dims: n_dims 5 is outside 1..4"));
  EXPECT_THAT(msg, HasSubstr(at(o.n_dims)));
  msg = error_of(one_tensor({}, kF32, 0, 64, &o));
  EXPECT_THAT(msg, HasSubstr("n_dims 0 is outside 1..4"));
}

TEST(GgufMalformed, ZeroOrNegativeDim) {
  RawGguf::TensorFieldOffsets o{};
  std::string msg = error_of(one_tensor({4, 0}, kF32, 0, 64, &o));
  EXPECT_THAT(msg, HasSubstr("tensor #0 'w' dims[1]: dimension 0 is not positive"));
  EXPECT_THAT(msg, HasSubstr(at(o.dims + 8)));
  msg = error_of(one_tensor({-3}, kF32, 0, 64, &o));
  EXPECT_THAT(msg, HasSubstr("tensor #0 'w' dims[0]: dimension -3 is not positive"));
  EXPECT_THAT(msg, HasSubstr(at(o.dims)));
}

TEST(GgufMalformed, ElementCountOverflow) {
  RawGguf::TensorFieldOffsets o{};
  const int64_t big = int64_t{1} << 32;
  const std::string msg = error_of(one_tensor({big, big}, kF32, 0, 64, &o));
  EXPECT_THAT(msg, HasSubstr("tensor #0 'w' dims[1]: element count overflows int64"));
  EXPECT_THAT(msg, HasSubstr(at(o.dims + 8)));
}

TEST(GgufMalformed, ByteSizeOverflow) {
  RawGguf::TensorFieldOffsets o{};
  const int64_t big = int64_t{1} << 31;  // 2^62 elements fit int64; 2^62 f64 = 2^65 bytes do not
  const std::string msg = error_of(one_tensor({big, big}, kF64, 0, 64, &o));
  EXPECT_THAT(msg, HasSubstr("tensor #0 'w' type: byte size of the tensor overflows 64 bits"));
  EXPECT_THAT(msg, HasSubstr(at(o.type)));
}

TEST(GgufMalformed, FirstDimNotAMultipleOfTheBlock) {
  RawGguf::TensorFieldOffsets o{};
  const std::string msg = error_of(one_tensor({100, 2}, kQ4K, 0, 1024, &o));
  EXPECT_THAT(msg, HasSubstr("tensor #0 'w' dims[0]: first dimension 100 is not a multiple of the q4_k block size 256"));
  EXPECT_THAT(msg, HasSubstr(at(o.dims)));
}

TEST(GgufMalformed, UnalignedTensorOffset) {
  RawGguf::TensorFieldOffsets o{};
  const std::string msg = error_of(one_tensor({8}, kF32, 16, 64, &o));
  EXPECT_THAT(msg, HasSubstr("tensor #0 'w' offset: data offset 16 is not a multiple of the alignment 32"));
  EXPECT_THAT(msg, HasSubstr(at(o.offset)));
}

TEST(GgufMalformed, TensorDataOutsideTheFile) {
  RawGguf::TensorFieldOffsets o{};
  const RawGguf r = one_tensor({16}, kF32, 0, 63, &o);  // needs 64 bytes of data
  const std::string msg = error_of(r);
  const size_t data_start = (o.offset + 8 + 31) / 32 * 32;
  EXPECT_THAT(msg, HasSubstr("tensor #0 'w' offset: data at file bytes [" + std::to_string(data_start) + ", " +
                             std::to_string(data_start + 64) + ") lies outside the file of " +
                             std::to_string(r.size()) + " bytes (truncated file?)"));
  EXPECT_THAT(msg, HasSubstr(at(o.offset)));
  // An offset far beyond the end must not wrap around.
  EXPECT_THAT(error_of(one_tensor({16}, kF32, ~uint64_t{0} & ~uint64_t{31}, 64, &o)), HasSubstr("lies outside the file"));
}

TEST(GgufMalformed, OverlappingTensors) {
  RawGguf r;
  r.header(2, 0);
  r.tensor_info("a", {16}, kF32, 0);
  const auto b = r.tensor_info("b", {16}, kF32, 32);
  r.pad_to(32);
  r.zeros(128);
  const std::string msg = error_of(r);
  EXPECT_THAT(msg, HasSubstr("tensor #1 'b' offset: data [32, 96) overlaps tensor 'a' at [0, 64)"));
  EXPECT_THAT(msg, HasSubstr(at(b.offset)));
}

TEST(GgufMalformed, DuplicateTensorName) {
  RawGguf r;
  r.header(2, 0);
  r.tensor_info("w", {8}, kF32, 0);
  const auto second = r.tensor_info("w", {8}, kF32, 32);
  r.pad_to(32);
  r.zeros(64);
  const std::string msg = error_of(r);
  EXPECT_THAT(msg, HasSubstr("tensor #1 'w' name: duplicate tensor name"));
  EXPECT_THAT(msg, HasSubstr(at(second.name)));
}

TEST(GgufMalformed, ErrorsFromDiskNameThePath) {
  testing::ScratchDir dir;
  RawGguf r;
  r.header(0, 0, 2);
  const std::string path = dir.file("old-v2.gguf");
  testing::write_bytes(path, r.bytes());
  try {
    GgufFile::open(path);
    FAIL() << "expected GgufError";
  } catch (const GgufError& e) {
    EXPECT_THAT(e.what(), HasSubstr(path + ": header version"));
  }
  try {
    GgufFile::open(dir.file("absent.gguf"));
    FAIL() << "expected GgufError";
  } catch (const GgufError& e) {
    EXPECT_THAT(e.what(), HasSubstr("absent.gguf: cannot open: No such file or directory"));
  }
  testing::write_bytes(dir.file("empty.gguf"), {});
  EXPECT_THROW(GgufFile::open(dir.file("empty.gguf")), GgufError);
}

// A small valid file with metadata arrays and tensors, the base for the sweeps below.
std::vector<uint8_t> valid_file(uint64_t* data_end) {
  testing::ScratchDir dir;
  GgufWriter w;
  w.set("general.architecture", Value::string("sweep"));
  w.set("tokens", Value::string_array({"a", "bb", "ccc"}));
  w.set("nested", Value::array(ValueType::ARRAY, {Value::array(ValueType::INT16, {Value::i16(-1)})}));
  w.set("general.alignment", Value::u32(16));
  std::vector<uint8_t> data(96, 7);
  w.add_tensor("blk.0.a", {8}, TensorType::F32, data.data(), 32);
  w.add_tensor("blk.0.b", {32, 2}, TensorType::Q8_0, data.data(), 68);
  w.write(dir.file("v.gguf"));
  const GgufFile f = GgufFile::open(dir.file("v.gguf"));
  *data_end = f.data_offset() + f.tensors().back().offset + f.tensors().back().n_bytes;
  return testing::read_bytes(dir.file("v.gguf"));
}

TEST(GgufMalformed, EveryTruncationIsAnErrorNotACrash) {
  uint64_t data_end = 0;
  const std::vector<uint8_t> full = valid_file(&data_end);
  ASSERT_LT(data_end, full.size()) << "the last tensor is followed by padding";
  for (size_t len = 0; len < full.size(); ++len) {
    if (len >= data_end) {
      // Only trailing padding is missing: the file is still complete.
      EXPECT_NO_THROW(GgufFile::from_bytes(full.data(), len, "cut.gguf")) << len;
      continue;
    }
    try {
      GgufFile::from_bytes(full.data(), len, "cut.gguf");
      ADD_FAILURE() << "a file cut to " << len << " bytes parsed";
    } catch (const GgufError& e) {
      EXPECT_THAT(e.what(), HasSubstr("cut.gguf: ")) << len;
      EXPECT_THAT(e.what(), HasSubstr("(byte offset ")) << len;
    }
  }
}

TEST(GgufMalformed, RandomCorruptionIsAnErrorNotACrash) {
  uint64_t data_end = 0;
  const std::vector<uint8_t> full = valid_file(&data_end);
  std::mt19937_64 rng(4711);
  int errors = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<uint8_t> bytes = full;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < flips; ++i) bytes[rng() % data_end] = static_cast<uint8_t>(rng());
    try {
      const GgufFile f = GgufFile::from_bytes(bytes.data(), bytes.size(), "corrupt.gguf");
      for (const TensorInfo& t : f.tensors()) {
        ASSERT_NE(t.data, nullptr);
        ASSERT_LE(t.offset + t.n_bytes + f.data_offset(), bytes.size());
        volatile uint8_t last = t.data[t.n_bytes - 1];  // touched under ASan in sanitizer builds
        (void)last;
      }
    } catch (const GgufError& e) {
      ++errors;
      ASSERT_THAT(e.what(), HasSubstr("corrupt.gguf: "));
    }
  }
  EXPECT_GT(errors, 1000) << "most random corruptions of the header should be caught";
}

}  // namespace
}  // namespace moraine::gguf
