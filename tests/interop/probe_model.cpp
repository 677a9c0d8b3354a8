#include "tests/interop/probe_model.h"

#include <cmath>
#include <random>

#include "common/gguf/gguf.h"
#include "tests/interop/llama_oracle.h"

namespace moraine::test {

ProbeModel::ProbeModel(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> exp_dist(0, 3);
  exponent_.resize(kEmbd);
  for (int64_t k = 0; k < kEmbd; ++k) exponent_[k] = (k % 32 == 0) ? 0 : exp_dist(rng);
  std::bernoulli_distribution coin(0.5);
  sign_rows_.resize((kVocab - kEmbd) * kEmbd);
  for (float& s : sign_rows_) s = coin(rng) ? 1.0f : -1.0f;
}

float ProbeModel::one_hot_value(int64_t t) const { return std::ldexp(127.0f, -exponent_[t]); }

std::vector<float> ProbeModel::hidden(int64_t token) const {
  std::vector<float> h(kEmbd, 0.0f);
  if (token < kEmbd) {
    h[token] = one_hot_value(token);
  } else {
    const float* signs = &sign_rows_[(token - kEmbd) * kEmbd];
    for (int64_t k = 0; k < kEmbd; ++k) h[k] = signs[k] * std::ldexp(127.0f / 16.0f, -exponent_[k]);
  }
  return h;
}

void ProbeModel::write(const std::string& path, TensorType output_type,
                       const std::vector<uint8_t>& output_bytes) const {
  using gguf::Value;
  gguf::GgufWriter w;
  w.set("general.architecture", Value::string("llama"));
  w.set("general.name", Value::string("moraine interop probe"));
  w.set("llama.context_length", Value::u32(1024));
  w.set("llama.embedding_length", Value::u32(kEmbd));
  w.set("llama.block_count", Value::u32(1));
  w.set("llama.feed_forward_length", Value::u32(kEmbd));
  w.set("llama.attention.head_count", Value::u32(2));
  w.set("llama.attention.head_count_kv", Value::u32(2));
  w.set("llama.rope.dimension_count", Value::u32(kEmbd / 2));
  // Epsilon 0 keeps the norm exact (see the header); the mean square is never 0 here.
  w.set("llama.attention.layer_norm_rms_epsilon", Value::f32(0.0f));
  add_minimal_llama_vocab(w, kVocab);

  std::vector<float> embd(kVocab * kEmbd, 0.0f);
  for (int64_t t = 0; t < kEmbd; ++t) embd[t * kEmbd + t] = 1.0f;
  std::copy(sign_rows_.begin(), sign_rows_.end(), embd.begin() + kEmbd * kEmbd);
  std::vector<float> norm(kEmbd);
  for (int64_t k = 0; k < kEmbd; ++k) norm[k] = std::ldexp(127.0f / 16.0f, -exponent_[k]);
  const std::vector<float> zeros(kEmbd * kEmbd, 0.0f);
  const uint64_t vec_bytes = kEmbd * sizeof(float);
  const uint64_t mat_bytes = zeros.size() * sizeof(float);

  w.add_tensor("token_embd.weight", {kEmbd, kVocab}, TensorType::F32, embd.data(), embd.size() * sizeof(float));
  w.add_tensor("output_norm.weight", {kEmbd}, TensorType::F32, norm.data(), vec_bytes);
  w.add_tensor("output.weight", {kEmbd, kVocab}, output_type, output_bytes.data(), output_bytes.size());
  w.add_tensor("blk.0.attn_norm.weight", {kEmbd}, TensorType::F32, zeros.data(), vec_bytes);
  w.add_tensor("blk.0.ffn_norm.weight", {kEmbd}, TensorType::F32, zeros.data(), vec_bytes);
  for (const char* name : {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}) {
    w.add_tensor(std::string("blk.0.") + name + ".weight", {kEmbd, kEmbd}, TensorType::F32, zeros.data(), mat_bytes);
  }
  w.write(path);
}

}  // namespace moraine::test
