// Real llama.cpp vocab files: every key and value agrees with gguf-py (llama.cpp's own Python
// reader, the oracle), every file loads, and writing it back reproduces it byte for byte.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "tests/gguf/gguf_test_util.h"

namespace moraine::gguf {
namespace {

using testing::read_bytes;
using testing::ScratchDir;
using testing::vocab_path;

const std::string kModels = std::string(MORAINE_SOURCE_DIR) + "/.cache/oracle/llama.cpp/models";

// zlib's CRC-32 (reflected 0xEDB88320), to compare with the oracle's zlib.crc32.
class Crc32 {
 public:
  void add(const void* data, size_t n) {
    static const std::array<uint32_t, 256> table = [] {
      std::array<uint32_t, 256> t{};
      for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        t[i] = c;
      }
      return t;
    }();
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < n; ++i) crc_ = table[(crc_ ^ p[i]) & 0xff] ^ (crc_ >> 8);
  }
  uint32_t value() const { return crc_ ^ 0xffffffffu; }

 private:
  uint32_t crc_ = 0xffffffffu;
};

template <class T>
void add_as(Crc32& crc, T v) {
  crc.add(&v, sizeof v);
}

// Feeds the value as GGUF encodes it (the oracle hashes the same encoding).
void add_encoded(Crc32& crc, const Value& v) {
  switch (v.type()) {
    case ValueType::UINT8: add_as(crc, static_cast<uint8_t>(*v.as_u64())); return;
    case ValueType::INT8: add_as(crc, static_cast<int8_t>(*v.as_i64())); return;
    case ValueType::UINT16: add_as(crc, static_cast<uint16_t>(*v.as_u64())); return;
    case ValueType::INT16: add_as(crc, static_cast<int16_t>(*v.as_i64())); return;
    case ValueType::UINT32: add_as(crc, static_cast<uint32_t>(*v.as_u64())); return;
    case ValueType::INT32: add_as(crc, static_cast<int32_t>(*v.as_i64())); return;
    case ValueType::UINT64: add_as(crc, *v.as_u64()); return;
    case ValueType::INT64: add_as(crc, *v.as_i64()); return;
    case ValueType::FLOAT32: add_as(crc, static_cast<float>(*v.as_f64())); return;
    case ValueType::FLOAT64: add_as(crc, *v.as_f64()); return;
    case ValueType::BOOL: add_as(crc, static_cast<uint8_t>(*v.as_bool())); return;
    case ValueType::STRING:
      add_as(crc, static_cast<uint64_t>(v.as_string()->size()));
      crc.add(v.as_string()->data(), v.as_string()->size());
      return;
    case ValueType::ARRAY:
      for (const Value& item : v.as_array()->items) add_encoded(crc, item);
      return;
  }
}

std::string run_command(const std::string& cmd, int* status) {
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return "";
  std::string out;
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  *status = pclose(pipe);
  return out;
}

// Both vocabularies the tokenizer work depends on: byte-level BPE (qwen2) and SentencePiece
// (llama-spm, with scores and bools). gguf-py takes ~3-13 s per file here, so not all 20.
const char* const kOracleVocabs[] = {"qwen2", "llama-spm"};

TEST(GgufVocab, EveryKeyAndValueMatchesGgufPy) {
  const std::string gguf_py = std::string(MORAINE_SOURCE_DIR) + "/.cache/oracle/llama.cpp/gguf-py";
  ASSERT_TRUE(std::filesystem::exists(gguf_py)) << gguf_py << " is missing: run tests/oracle/setup";
  std::string cmd = "/usr/bin/python3 " + std::string(MORAINE_SOURCE_DIR) + "/tests/gguf/gguf_py_dump.py " + gguf_py;
  for (const char* v : kOracleVocabs) cmd += " " + vocab_path(v);
  int status = 0;
  const std::string out = run_command(cmd + " 2>&1", &status);
  ASSERT_EQ(status, 0) << "gguf-py oracle failed (needs numpy: apt-get install -y python3-numpy):\n" << out;
  const nlohmann::json oracle = nlohmann::json::parse(out);
  for (const char* v : kOracleVocabs) {
    SCOPED_TRACE(v);
    const nlohmann::json& want = oracle.at(vocab_path(v));
    const GgufFile f = GgufFile::open(vocab_path(v));
    EXPECT_EQ(f.tensors().size(), want.at("tensors").get<size_t>());
    ASSERT_EQ(f.metadata().size(), want.at("fields").size());
    ASSERT_GT(f.metadata().size(), 15u);
    for (size_t i = 0; i < f.metadata().size(); ++i) {
      const auto& [key, value] = f.metadata()[i];
      const nlohmann::json& w = want.at("fields")[i];
      EXPECT_EQ(key, w.at("key").get<std::string>());
      EXPECT_EQ(static_cast<int>(value.type()), w.at("type").get<int>()) << key;
      Crc32 crc;
      add_encoded(crc, value);
      EXPECT_EQ(crc.value(), w.at("crc").get<uint32_t>()) << key;
      if (const Array* a = value.as_array()) {
        EXPECT_EQ(a->items.size(), w.at("count").get<size_t>()) << key;
        EXPECT_EQ(static_cast<int>(a->elem_type), w.at("elem_type").get<int>()) << key;
      }
    }
  }
}

std::vector<std::string> all_vocab_files() {
  std::vector<std::string> out;
  if (!std::filesystem::exists(kModels)) return out;
  for (const auto& e : std::filesystem::directory_iterator(kModels)) {
    if (e.path().extension() == ".gguf") out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(GgufVocab, EveryVocabFileLoadsAndWritesBackByteForByte) {
  const std::vector<std::string> files = all_vocab_files();
  ASSERT_GE(files.size(), 15u) << kModels << " lacks the vocab files: run tests/oracle/setup";
  ScratchDir dir;
  size_t refused = 0;
  for (const std::string& path : files) {
    SCOPED_TRACE(path);
    const std::vector<uint8_t> original = read_bytes(path);
    uint32_t version = 0;
    std::memcpy(&version, original.data() + 4, 4);
    if (version != 3) {
      // ggml-vocab-aquila.gguf is a GGUF v2 file: refused, with the reason.
      EXPECT_THROW(
          {
            try {
              GgufFile::open(path);
            } catch (const GgufError& e) {
              EXPECT_THAT(e.what(), ::testing::HasSubstr("v3 is required"));
              throw;
            }
          },
          GgufError);
      ++refused;
      continue;
    }
    const GgufFile f = GgufFile::open(path);
    // The header's counts, read straight from the bytes, independent of the parser.
    uint64_t n_tensors = 0, n_kv = 0;
    std::memcpy(&n_tensors, original.data() + 8, 8);
    std::memcpy(&n_kv, original.data() + 16, 8);
    EXPECT_EQ(f.metadata().size(), n_kv);
    EXPECT_EQ(f.tensors().size(), n_tensors);
    EXPECT_EQ(f.file_bytes(), original.size());
    ASSERT_TRUE(f.get_array("tokenizer.ggml.tokens")) << "every vocab file has its token list";
    EXPECT_GT(f.get_array("tokenizer.ggml.tokens")->items.size(), 1000u);

    GgufWriter w;
    for (const auto& [key, value] : f.metadata()) w.set(key, value);
    for (const TensorInfo& t : f.tensors()) w.add_tensor(t.name, t.shape, t.type, t.data, t.n_bytes);
    const std::string copy = dir.file("copy.gguf");
    w.write(copy);
    const std::vector<uint8_t> written = read_bytes(copy);
    ASSERT_EQ(written.size(), original.size());
    EXPECT_TRUE(written == original) << "bytes differ";
  }
  EXPECT_LE(refused, 1u) << "only the one old v2 file is refused";
}

TEST(GgufVocab, Qwen2VocabLoadsInUnderAFifthOfASecond) {
  const std::string path = vocab_path("qwen2");
  double best = 1e9;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const GgufFile f = GgufFile::open(path);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s);
    ASSERT_EQ(f.get_array("tokenizer.ggml.tokens")->items.size(), 151936u);
    ASSERT_EQ(f.get_array("tokenizer.ggml.merges")->items.size(), 151387u);
  }
  std::printf("qwen2 vocab load: %.1f ms (best of 3)\n", best * 1e3);
  EXPECT_LT(best, 0.2);
}

}  // namespace
}  // namespace moraine::gguf
