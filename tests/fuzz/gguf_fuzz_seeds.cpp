// Writes small valid GGUF files into a directory: the fuzzer's starting corpus. Each covers
// different structure (every value type, nested arrays, tensors of several types, custom
// alignment, no tensors) so mutations start from deep inside the format.
#include <cstdio>
#include <string>
#include <vector>

#include "common/gguf/gguf.h"

using moraine::TensorType;
using moraine::gguf::GgufWriter;
using moraine::gguf::Value;
using moraine::gguf::ValueType;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  try {
    {
      GgufWriter w;
      w.set("u8", Value::u8(7));
      w.set("i8", Value::i8(-7));
      w.set("u16", Value::u16(700));
      w.set("i16", Value::i16(-700));
      w.set("u32", Value::u32(70000));
      w.set("i32", Value::i32(-70000));
      w.set("u64", Value::u64(7000000000));
      w.set("i64", Value::i64(-7000000000));
      w.set("f32", Value::f32(0.5f));
      w.set("f64", Value::f64(-0.25));
      w.set("bool", Value::boolean(true));
      w.set("string", Value::string("moraine"));
      w.set("tokens", Value::string_array({"a", "b", "<|end|>"}));
      w.set("scores", Value::array(ValueType::FLOAT32, {Value::f32(1), Value::f32(-1)}));
      w.set("nested", Value::array(ValueType::ARRAY, {Value::array(ValueType::INT32, {Value::i32(3)}),
                                                      Value::array(ValueType::INT32, {})}));
      w.write(dir + "/values.gguf");
    }
    {
      static std::vector<uint8_t> data(4096, 0x3c);
      GgufWriter w;
      w.set("general.architecture", Value::string("seed"));
      w.set("general.alignment", Value::u32(64));
      w.add_tensor("token_embd.weight", {32, 2}, TensorType::Q8_0, data.data(), 68);
      w.add_tensor("blk.0.attn_q.weight", {256}, TensorType::Q4_K, data.data(), 144);
      w.add_tensor("blk.0.attn_norm.weight", {4, 2}, TensorType::F32, data.data(), 32);
      w.add_tensor("blk.1.ffn_up_exps.weight", {32, 1, 2}, TensorType::MXFP4, data.data(), 34);
      w.write(dir + "/tensors.gguf");
    }
    {
      static std::vector<uint8_t> data(64, 1);
      GgufWriter w;
      w.set("split.no", Value::u16(0));
      w.set("split.count", Value::u16(1));
      w.add_tensor("w", {8}, TensorType::F16, data.data(), 16);
      w.write(dir + "/split-keys.gguf");
    }
    {
      GgufWriter w;
      w.write(dir + "/empty.gguf");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gguf_fuzz_seeds: %s\n", e.what());
    return 1;
  }
  return 0;
}
