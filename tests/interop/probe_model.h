// A one-layer llama model whose logits expose `output.weight`, so what llama.cpp reads from a
// GGUF file can be compared value by value with what moraine meant to write.
//
// Every layer weight is zero, so attention and FFN add exactly 0 and the final hidden state is
// RMSNorm(token_embd[t]) * output_norm (rms epsilon 0). Token embeddings are chosen so that the
// norm is exact in float:
//   - tokens 0..255: e_t (one-hot, value 1): mean square 1/256, 1/sqrt = 16 exactly, so the hidden
//     state is 16 * output_norm[t] * e_t = c_t * e_t and logit[t][v] = c_t * W[v][t]: column t of
//     the weight. All 256 one-hot tokens together read back the whole matrix.
//   - tokens 256..511: random +-1 vectors: mean square 1, scale 1, hidden = +-output_norm: every
//     element of a weight row takes part, which checks llama.cpp's dot product against ours.
// output_norm[k] = (127/16) * 2^-s_k with s_k in 0..3, and s_k = 0 for k % 32 == 0. Then every
// activation block llama.cpp quantizes (Q8_0: 32, Q8_K: 256 elements) has its largest magnitude
// equal to 127 * 2^-e for one e, so the activation scale is a power of two and c_t * e_t is
// represented exactly (q = 127), in F16 and BF16 as well (127 needs 7 mantissa bits).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/formats/tensor_type.h"

namespace moraine::test {

class ProbeModel {
 public:
  static constexpr int64_t kEmbd = 256;   // one K-quant super-block per row
  static constexpr int64_t kVocab = 512;  // kEmbd one-hot tokens + kEmbd sign tokens

  explicit ProbeModel(uint64_t seed);

  // The final hidden state llama.cpp computes for `token` (exact by construction).
  std::vector<float> hidden(int64_t token) const;
  // The one-hot hidden value c_t = 127 * 2^-s_t of token t < kEmbd.
  float one_hot_value(int64_t t) const;

  // Writes the model with output.weight = `output_bytes` ([kVocab rows][kEmbd] of `output_type`).
  void write(const std::string& path, TensorType output_type, const std::vector<uint8_t>& output_bytes) const;

 private:
  std::vector<int> exponent_;     // s_k
  std::vector<float> sign_rows_;  // [kVocab - kEmbd][kEmbd], +-1
};

}  // namespace moraine::test
