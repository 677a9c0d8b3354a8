// Tiny Hugging Face checkpoints written by the tests themselves (no torch): safetensors with the
// names, shapes and dtypes transformers saves, config.json, and a byte-level BPE tokenizer.json
// (+ tokenizer_config.json with a chat template), so a converter test needs no fixture files.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "tests/convert/convert_test_util.h"

namespace moraine::convert::test {

// A checkpoint under construction: float tensors (stored BF16, so the values kept here are
// exactly what the file holds) and raw U8 tensors (MXFP4 blocks and scales).
class TinyCheckpoint {
 public:
  explicit TinyCheckpoint(uint32_t seed) : rng_(seed) {}

  // A bf16 tensor of normal(0, std) values (mean `mean`); returns the bf16-exact values.
  const std::vector<float>& normal(const std::string& name, std::vector<int64_t> shape, float std, float mean = 0.0f) {
    std::normal_distribution<float> d(mean, std);
    std::vector<float> v(static_cast<size_t>(count(shape)));
    for (float& x : v) x = bf16_to_fp32(fp32_to_bf16(d(rng_)));
    return put(name, std::move(shape), std::move(v));
  }
  const std::vector<float>& put(const std::string& name, std::vector<int64_t> shape, std::vector<float> v) {
    std::vector<uint8_t> bytes(v.size() * 2);
    for (size_t i = 0; i < v.size(); ++i) {
      const uint16_t h = fp32_to_bf16(v[i]);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
    raw_.push_back({name, "BF16", shape, std::move(bytes)});
    return values_[name] = std::move(v);
  }
  // A U8 tensor of uniform bytes in [lo, hi].
  const std::vector<uint8_t>& bytes(const std::string& name, std::vector<int64_t> shape, int lo, int hi) {
    std::uniform_int_distribution<int> d(lo, hi);
    std::vector<uint8_t> b(static_cast<size_t>(count(shape)));
    for (uint8_t& x : b) x = static_cast<uint8_t>(d(rng_));
    raw_.push_back({name, "U8", std::move(shape), b});
    return bytes_[name] = std::move(b);
  }
  void write(const std::string& path) const { write_safetensors(path, raw_); }

  const std::vector<float>& f(const std::string& name) const { return values_.at(name); }
  const std::vector<uint8_t>& u8(const std::string& name) const { return bytes_.at(name); }
  std::vector<RawTensor>& raw() { return raw_; }

  static int64_t count(const std::vector<int64_t>& s) {
    int64_t n = 1;
    for (int64_t d : s) n *= d;
    return n;
  }

 private:
  std::mt19937 rng_;
  std::vector<RawTensor> raw_;
  std::map<std::string, std::vector<float>> values_;
  std::map<std::string, std::vector<uint8_t>> bytes_;
};

// GPT-2's byte -> printable code point map (ByteLevel pre-tokenizer), as UTF-8.
inline std::string byte_token(int b) {
  int n = 0, cp = -1;
  for (int x = 0; x < 256; ++x) {
    const bool printable = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255);
    const int c = printable ? x : 256 + n++;
    if (x == b) cp = c;
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// The pre-tokenizer split patterns of the two BPE families the converter maps.
inline const char* o200k_regex() {
  return R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
}
inline const char* qwen2_regex() {
  return R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
}

// Ids of the tiny tokenizer: bytes are ids 0..255 (byte value = id), then these merges.
struct TinyVocab {
  static constexpr int k12 = 256, k123 = 257, k45 = 258, kHe = 259, kLl = 260, kHell = 261, kHello = 262, kSpW = 263;
  static constexpr int kFirstFiller = 264;
};

// tokenizer.json (byte-level BPE, `regex` split) with vocab_size ids: 256 bytes, a few merges,
// filler tokens, and the added tokens `added` at the top ids; tokenizer_config.json names eos
// and the chat template.
inline void write_tiny_tokenizer(const std::string& dir, int64_t vocab_size, const char* regex,
                                 const std::vector<std::string>& added, const std::string& eos,
                                 const std::string& chat_template) {
  using nlohmann::json;
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_token(b)] = b;
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"1", "2"}, {"12", "3"}, {"4", "5"}, {"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {byte_token(' '), "w"}};
  json mj = json::array();
  int id = TinyVocab::k12;
  for (const auto& [a, b] : merges) {
    mj.push_back(a + " " + b);
    vocab[a + b] = id++;
  }
  const int64_t n_filler = vocab_size - static_cast<int64_t>(added.size()) - id;
  for (int64_t k = 0; k < n_filler; ++k) vocab["zq" + std::to_string(k)] = id++;
  json added_j = json::array();
  for (const std::string& a : added) added_j.push_back({{"id", id++}, {"content", a}, {"special", true}});
  const json tok = {
      {"version", "1.0"},
      {"added_tokens", added_j},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", mj}}},
  };
  std::ofstream(dir + "/tokenizer.json") << tok.dump();
  const json cfg = {{"add_bos_token", false}, {"eos_token", eos}, {"chat_template", chat_template}};
  std::ofstream(dir + "/tokenizer_config.json") << cfg.dump(1);
}

}  // namespace moraine::convert::test
