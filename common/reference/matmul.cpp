#include "common/reference/matmul.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cpu/vec_dot.h"

namespace moraine::reference {

namespace {

// Eight independent float partial sums, combined pairwise at the end: a fixed order (so the
// result is the same for any batch or thread split) that compilers keep in vector registers.
float dot_f32(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  for (int j = 0; i < n; ++i, ++j) acc[j] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

}  // namespace

float dot_row(TensorType weight_type, int64_t n, const void* w_row, const void* act_row) {
  if (weight_type == TensorType::F32) {
    return dot_f32(static_cast<const float*>(w_row), static_cast<const float*>(act_row), n);
  }
  // Quantized and half types: the ISA-dispatched kernel (each one is tested against
  // vec_dot_reference; integer block sums are exact, so only the float combination may differ).
  return cpu::vec_dot(weight_type, n, w_row, act_row);
}

namespace {

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

float dot_row_in_order(TensorType weight_type, int64_t n, const void* w_row, const void* act_row, DotOrderSeed order,
                       int64_t row, int64_t n_rows) {
  if (order == 0) return dot_row(weight_type, n, w_row, act_row);
  const TypeTraits& wt = type_traits(weight_type);
  const TensorType act_type = dot_activation_type(weight_type);
  // A block of a quantized type; 32 elements of a float type (its own 8-lane dot_f32 inside).
  const int64_t elems = wt.block_elems > 1 ? wt.block_elems : 32;
  const int64_t nb = (n + elems - 1) / elems;
  const size_t w_bytes = row_bytes(weight_type, std::min(elems, n));
  const size_t a_bytes = row_bytes(act_type, std::min(elems, n));
  thread_local std::vector<float> terms;
  thread_local std::vector<int64_t> perm;
  terms.resize(static_cast<size_t>(nb));
  perm.resize(static_cast<size_t>(nb));
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t len = std::min(elems, n - b * elems);
    terms[b] = dot_row(weight_type, len, static_cast<const uint8_t*>(w_row) + b * w_bytes,
                       static_cast<const uint8_t*>(act_row) + b * a_bytes);
    perm[b] = b;
  }
  uint64_t state = order ^ (static_cast<uint64_t>(row) * 0x100000001b3ull) ^
                   (static_cast<uint64_t>(n_rows) << 32) ^ static_cast<uint64_t>(n);
  splitmix64(state);
  for (int64_t i = nb - 1; i > 0; --i) {
    std::swap(perm[i], perm[splitmix64(state) % static_cast<uint64_t>(i + 1)]);
  }
  float acc = 0.0f;
  for (int64_t i = 0; i < nb; ++i) acc += terms[perm[i]];
  return acc;
}

PackedActivations pack_activations(TensorType weight_type, const float* x, int64_t n_tokens,
                                   int64_t n_cols, DotOrderSeed order) {
  PackedActivations p;
  p.type = order == kFloatDots ? TensorType::F32 : dot_activation_type(weight_type);
  p.n_cols = n_cols;
  p.n_tokens = n_tokens;
  p.row_bytes = row_bytes(p.type, n_cols);
  if (p.type == TensorType::F32) {
    p.f32 = x;
    return p;
  }
  p.bytes.resize(p.row_bytes * static_cast<size_t>(n_tokens));
  // llama.cpp's runtime rounding on x86, not ggml's reference quantize_row: the two pick a
  // different int8 for some activations (q8_0: 127/amax vs 1/(amax/127), ties to even vs away),
  // and on tiny MoE models one such step moves logits visibly. Measured on qwen3moe_k256 Q8_0
  // (F32 router), worst gap to node-llama-cpp / max |logit|: 1.9e-2 with the reference
  // rounding, 2.3e-7 with this one (tests/reference/llama_oracle_test.cpp).
  for (int64_t t = 0; t < n_tokens; ++t) {
    cpu::quantize_activation_row_llama_x86(p.type, x + t * n_cols,
                                           p.bytes.data() + static_cast<size_t>(t) * p.row_bytes, n_cols);
  }
  return p;
}

void matmul(const model::Matrix& w, const PackedActivations& x, float* y, ThreadPool& pool, DotOrderSeed order) {
  const bool float_dots = order == kFloatDots;
  if (x.n_cols != w.n_cols || x.type != (float_dots ? TensorType::F32 : dot_activation_type(w.type))) {
    throw std::invalid_argument("matmul: activations (" + std::to_string(x.n_cols) +
                                " cols) do not fit weight " + std::to_string(w.n_cols) + " cols");
  }
  const int64_t n_rows = w.n_rows;
  const int64_t n_tokens = x.n_tokens;
  if (float_dots && w.type != TensorType::F32) {
    pool.parallel_for(n_rows, w.n_cols * n_tokens, [&](int64_t r0, int64_t r1) {
      std::vector<float> row(static_cast<size_t>(w.n_cols));
      for (int64_t r = r0; r < r1; ++r) {
        dequantize_row(w.type, w.row(r), row.data(), w.n_cols);
        for (int64_t t = 0; t < n_tokens; ++t) y[t * n_rows + r] = dot_f32(row.data(), x.f32 + t * x.n_cols, w.n_cols);
      }
    });
    return;
  }
  if (float_dots) order = 0;
  // Split over rows: every thread streams a disjoint slice of the weight once for all tokens.
  pool.parallel_for(n_rows, w.n_cols * n_tokens, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* wr = w.row(r);
      for (int64_t t = 0; t < n_tokens; ++t) {
        y[t * n_rows + r] = order == 0 ? dot_row(w.type, w.n_cols, wr, x.row(t))
                                       : dot_row_in_order(w.type, w.n_cols, wr, x.row(t), order, r, n_rows);
      }
    }
  });
}

void matmul(const model::Matrix& w, const float* x, int64_t n_tokens, float* y, ThreadPool& pool,
            DotOrderSeed order) {
  matmul(w, pack_activations(w.type, x, n_tokens, w.n_cols, order), y, pool, order);
}

}  // namespace moraine::reference
