// qk_norm_rope_store's plain form (no q / k norm: gpt-oss), kernels/cuda/qk_norm_rope_store.h:
// q / k / v plus their biases, q and k rotated by NEOX RoPE or YaRN, k and v stored at the device
// position, against the reference's own steps (attention_block: the float bias add, then
// reference::rope_neox_yarn / rope_neox) on fresh random inputs: gpt-oss-20b's rotation (head 64,
// base 150000, YaRN factor 32 over 4096 positions), gpt-oss-tiny's heads, partial rotary, without
// biases, one concatenated q | k | v row and positions far from zero, the correction dims rounded
// (llama.cpp) and fractional (HF's truncate=false, gpt-oss's config); a half cache. The kernel takes
// low / high / mscale from model::yarn_ramp, as the backend gives them.
// Tolerance (rope_test.cpp's, scaled by mscale): theta, cos and sin are double on both sides, so
// c and s agree unless a double differing in its last bits rounds across a float boundary (one
// float ulp of c or s, <= 2^-24 mscale); the rotation is the same two products and one sum each
// rounded, so |got - want| <= 2^-22 mscale (|x0| + |x1|). The bias add and v are exact (memcmp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/formats/half_float.h"
#include "common/model/arch/parts.h"
#include "common/reference/ops.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/qk_norm_rope_store.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

struct Case {
  int64_t n_head, n_head_kv, hd, n_rot, rows;
  int32_t pos;
  bool yarn, biases, concat;
  double base = 150000.0, factor = 32.0;
  int64_t orig_ctx = 4096;
  bool truncate = true;   // RopePart::yarn_truncate
};

void check(const Case& c, uint32_t seed, bool f16 = false) {
  std::mt19937 rng(seed);
  const int64_t qd = c.n_head * c.hd, kv = c.n_head_kv * c.hd, max_pos = c.pos + c.rows + 3;
  const int64_t row = qd + 2 * kv;   // concatenated: q | k | v per row; else three buffers
  const std::vector<float> x = cuda_test::random_values(rng, static_cast<size_t>(c.rows * row));
  const std::vector<float> bias = cuda_test::random_values(rng, static_cast<size_t>(qd + 2 * kv));
  cuda::DeviceBuffer<float> dx(x.size()), db(bias.size()), dq(static_cast<size_t>(c.rows * qd)),
      dk(static_cast<size_t>(max_pos * kv)), dv(dk.size());
  cuda::DeviceBuffer<__half> dk16(f16 ? dk.size() : 0), dv16(f16 ? dv.size() : 0);
  std::vector<float> packed(x.size());   // separate buffers: q rows, then k rows, then v rows
  for (int64_t t = 0; t < c.rows; ++t) {
    std::memcpy(packed.data() + t * qd, x.data() + t * row, qd * 4);
    std::memcpy(packed.data() + c.rows * qd + t * kv, x.data() + t * row + qd, kv * 4);
    std::memcpy(packed.data() + c.rows * (qd + kv) + t * kv, x.data() + t * row + qd + kv, kv * 4);
  }
  dx.upload(c.concat ? x.data() : packed.data(), x.size());
  db.upload(bias.data(), bias.size());
  dk.fill_bytes(0);
  dv.fill_bytes(0);
  if (f16) dk16.fill_bytes(0), dv16.fill_bytes(0);
  cuda::DeviceBuffer<int32_t> dpos(1);
  dpos.upload(&c.pos, 1);
  cuda::QkNormRopeStoreArgs a;
  a.q = dx.get();
  a.q_row_stride = c.concat ? row : qd;
  a.q_head_stride = c.hd;
  a.k = c.concat ? dx.get() + qd : dx.get() + c.rows * qd;
  a.k_row_stride = c.concat ? row : kv;
  a.v = c.concat ? dx.get() + qd + kv : dx.get() + c.rows * (qd + kv);
  a.v_row_stride = a.k_row_stride;
  a.rows = c.rows;
  a.n_head = c.n_head;
  a.n_head_kv = c.n_head_kv;
  a.head_dim = c.hd;
  a.n_rot = c.n_rot;
  a.pos0_dev = dpos.get();
  a.freq_base = c.base;
  a.max_pos = max_pos;
  a.q_out = dq.get();
  if (f16) {
    a.k_cache_f16 = dk16.get();
    a.v_cache_f16 = dv16.get();
  } else {
    a.k_cache = dk.get();
    a.v_cache = dv.get();
  }
  if (c.biases) {
    a.q_bias = db.get();
    a.k_bias = db.get() + qd;
    a.v_bias = db.get() + qd + kv;
  }
  model::RopePart rope;
  rope.n_rot = c.n_rot;
  rope.freq_base = c.base;
  rope.scaling = model::RopeScaling::Yarn;
  rope.yarn_factor = c.factor;
  rope.yarn_orig_ctx = c.orig_ctx;
  rope.yarn_truncate = c.truncate;
  if (c.yarn) {
    const model::YarnRamp r = model::yarn_ramp(rope, c.n_rot);
    a.yarn = {true, c.factor, r.low, r.high, r.mscale};
  }
  cuda::qk_norm_rope_store(a);
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> q(dq.size()), kc(dk.size()), vc(dv.size());
  dq.download(q.data(), q.size());
  if (f16) {
    std::vector<uint16_t> k16(kc.size()), v16(vc.size());
    dk16.download(reinterpret_cast<__half*>(k16.data()), k16.size());
    dv16.download(reinterpret_cast<__half*>(v16.data()), v16.size());
    for (size_t i = 0; i < kc.size(); ++i) kc[i] = half::fp16_to_fp32(k16[i]), vc[i] = half::fp16_to_fp32(v16[i]);
  } else {
    dk.download(kc.data(), kc.size());
    dv.download(vc.data(), vc.size());
  }
  const double mscale = c.yarn ? 1.0 + 0.1 * std::log(c.factor) : 1.0;
  const int64_t half = c.n_rot / 2;
  // One head as the reference makes it; got: the kernel's (f16: through the half rounding).
  const auto expect_head = [&](const float* raw, const float* b, const float* got, int64_t pos, bool rounded,
                               const std::string& what) {
    std::vector<float> want(static_cast<size_t>(c.hd)), biased(static_cast<size_t>(c.hd));
    for (int64_t i = 0; i < c.hd; ++i) want[i] = biased[i] = c.biases ? raw[i] + b[i] : raw[i];
    if (c.yarn) reference::rope_neox_yarn(want.data(), c.n_rot, pos, rope);
    else reference::rope_neox(want.data(), c.n_rot, pos, c.base);
    for (int64_t i = 0; i < c.hd; ++i) {
      const int64_t p = i < half ? i : i - half;
      double tol = i < c.n_rot ? std::ldexp(mscale, -22) * (std::fabs(biased[p]) + std::fabs(biased[p + half])) : 0.0;
      const double w = rounded ? half::fp16_to_fp32(half::fp32_to_fp16(want[i])) : want[i];
      if (rounded) tol = tol * 2 + std::ldexp(std::fabs(w), -10);   // half rounding of either side
      ASSERT_LE(std::fabs(double(got[i]) - w), tol) << what << " dim " << i << ": got " << got[i] << ", want " << w;
    }
  };
  for (int64_t t = 0; t < c.rows; ++t) {
    const int64_t pos = c.pos + t;
    const float* xr = x.data() + t * row;
    for (int64_t h = 0; h < c.n_head; ++h)
      expect_head(xr + h * c.hd, bias.data() + h * c.hd, q.data() + (t * c.n_head + h) * c.hd, pos, false,
                  "row " + std::to_string(t) + " q head " + std::to_string(h));
    for (int64_t h = 0; h < c.n_head_kv; ++h) {
      expect_head(xr + qd + h * c.hd, bias.data() + qd + h * c.hd, kc.data() + pos * kv + h * c.hd, pos, f16,
                  "row " + std::to_string(t) + " k head " + std::to_string(h));
      for (int64_t i = 0; i < c.hd; ++i) {
        float want = c.biases ? xr[qd + kv + h * c.hd + i] + bias[qd + kv + h * c.hd + i] : xr[qd + kv + h * c.hd + i];
        if (f16) want = half::fp16_to_fp32(half::fp32_to_fp16(want));
        ASSERT_EQ(vc[pos * kv + h * c.hd + i], want) << "row " << t << " v head " << h << " dim " << i;
      }
    }
  }
}

TEST(CudaQkRopeYarn, MatchesReferenceSteps) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check({64, 8, 64, 64, 3, 0, true, true, true}, 1);      // gpt-oss-20b, the first positions, q | k | v rows
  check({64, 8, 64, 64, 2, 20000, true, true, false}, 2);    // far positions (the scaled low frequencies matter)
  check({8, 2, 32, 32, 16, 37, true, true, true}, 3);     // gpt-oss-tiny, a prefill's rows
  check({8, 2, 64, 32, 4, 500, true, false, false}, 4);   // partial rotary, no biases
  check({8, 2, 64, 64, 4, 500, false, true, false}, 5);   // biases with plain RoPE
  Case fractional{64, 8, 64, 64, 3, 3000, true, true, true};
  fractional.truncate = false;   // gpt-oss's own config (HF truncate=false)
  check(fractional, 6);
}

TEST(CudaQkRopeYarn, HalfCacheGetsTheRoundedValues) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check({64, 8, 64, 64, 3, 4000, true, true, true}, 11, true);
}

// Biases or YaRN with a q / k norm: refused (no kernel does both).
TEST(CudaQkRopeYarnArguments, RefusesYarnWithNorms) {
  const model::YarnRamp r = model::yarn_ramp(model::RopePart{64, 150000.0, model::RopeScaling::Yarn, 32.0, 4096}, 64);
  const cuda::RopeYarn y{true, 32.0, r.low, r.high, r.mscale};
  cuda::QkNormRopeStoreArgs a;
  a.rows = 1, a.n_head = 1, a.n_head_kv = 1, a.head_dim = 64, a.n_rot = 64, a.max_pos = 4;
  a.q_head_stride = a.q_row_stride = a.k_row_stride = a.v_row_stride = 64;
  float dummy = 0;
  a.q = a.k = a.v = a.q_norm = a.k_norm = &dummy;
  a.yarn = y;
  EXPECT_THROW(cuda::qk_norm_rope_store(a), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
