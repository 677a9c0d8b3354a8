// Shared pieces of the CUDA kernel tests: skipping without a device, random inputs.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/formats/half_float.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/device.h"

// Skips the current test when no CUDA device is present (the build machine and CI have nvcc
// but no GPU); on the GPU machine the tests run.
#define MORAINE_SKIP_WITHOUT_CUDA_DEVICE()                         \
  do {                                                             \
    std::string moraine_why_;                                      \
    if (!::moraine::cuda::device_available(&moraine_why_))         \
      GTEST_SKIP() << "no CUDA device: " << moraine_why_;          \
  } while (0)

namespace moraine::cuda_test {

// Gaussian values with a per-32-element spread from 1e-3 to 1e2 and a few outliers, so block
// scales cover a wide range (as real activations and weights do).
inline std::vector<float> random_values(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_scale(-3.0f, 2.0f);
  std::uniform_int_distribution<int> outlier(0, 99);
  std::vector<float> v(n);
  float scale = 1.0f;
  for (size_t i = 0; i < n; ++i) {
    if (i % 32 == 0) scale = std::pow(10.0f, log_scale(rng));
    v[i] = normal(rng) * scale * (outlier(rng) == 0 ? 8.0f : 1.0f);
  }
  return v;
}

// Plain Gaussian values (the attention tests' q, K, V and gates).
inline std::vector<float> normal_values(std::mt19937& rng, size_t n, float sd) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// An attention shape with the usual 1/sqrt(head_dim) scale; kv_pad floats after each cached
// position's heads (0: packed).
inline cuda::AttentionShape attention_shape(int64_t n_head, int64_t n_head_kv, int64_t hd, int64_t kv_pad = 0) {
  cuda::AttentionShape s;
  s.n_head = n_head;
  s.n_head_kv = n_head_kv;
  s.head_dim = hd;
  s.kv_stride = n_head_kv * hd + kv_pad;
  s.scale = 1.0f / std::sqrt(static_cast<float>(hd));
  return s;
}

// x rounded to IEEE half: the halves, and x replaced by their exact floats.
inline std::vector<uint16_t> round_to_half(std::vector<float>& x) {
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    h[i] = half::fp32_to_fp16(x[i]);
    x[i] = half::fp16_to_fp32(h[i]);
  }
  return h;
}

// A prefill attention test's inputs for n queries after n_past cached positions: q (sd 1), the
// caches K (sd 2.5: wide scores, so the running max moves across KV tiles) and V (random_values),
// and with gated the gate rows (2 x the query width per token, sd 2), drawn in that order.
struct PrefillInputs {
  std::vector<float> q, kc, vc, gate;
};
inline PrefillInputs prefill_inputs(std::mt19937& rng, const cuda::AttentionShape& s, int64_t n, int64_t n_past,
                                    bool gated) {
  const size_t qd = static_cast<size_t>(s.n_head * s.head_dim), ctx = static_cast<size_t>((n_past + n) * s.kv_stride);
  PrefillInputs in;
  in.q = normal_values(rng, static_cast<size_t>(n) * qd, 1.0f);
  in.kc = normal_values(rng, ctx, 2.5f);
  in.vc = random_values(rng, ctx);
  if (gated) in.gate = normal_values(rng, static_cast<size_t>(n) * 2 * qd, 2.0f);
  return in;
}

}  // namespace moraine::cuda_test
