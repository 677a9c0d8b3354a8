// Tiled causal prefill attention (kernels/cuda/attention_prefill.h) against the exact softmax
// attention in double (the formula of moraine::reference::attend_one_head), for Qwen3-30B and
// qwen3next shapes, a group of 3 with an odd head_dim, the largest head_dim, prefills from empty
// and after a cached past, and query tiles cut mid-row. Outputs NaN-poisoned before the run.
//
// Tolerance, first order in u = 2^-24 (the kernel is not bit-identical to the decode kernels):
//   score s_j: a sequential fma chain over head_dim, then the scale:
//     ds_j <= hd u scale sum_d |q_d k_jd| + u |s_j|;
//   p_j = exp(s_j - m) with m a running max (itself a computed score): relative error
//     2 max ds + u |s_j - m| (the subtraction) + 2u (expf), then per later KV tile one correction
//     factor exp(m_old - m_new) and its multiply (the |m_old - m_new| telescope to <= 2 max|s|,
//     plus 3u a tile): e_p <= 2 max ds + 4u max|s| + (2 + 3 tiles) u;
//   the numerator sum_j p_j v_jd and the denominator l both carry e_p per term (2 e_p on the
//   ratio) plus their own accumulation: one fma chain over n_kv positions for the numerator, a
//   warp tree per tile and the rescale for l (n_kv + 2 tiles + 5 u), and the final 1/l multiply
//   (2u); all relative to sum_j p_j |v_jd| / l. tiles is counted with the smallest KV tile (16).
// The half cache (the CUDA backend's F16 KV): K and V rounded to IEEE half on the host, the exact
// attention over those rounded values with the same tolerance (the kernel widens each element
// exactly), and bit for bit the float kernel's output on a float cache of the same values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/formats/half_float.h"
#include "kernels/cuda/attention_prefill.h"
#include "kernels/cuda/device_buffer.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

// f16: K and V rounded to half, the kernel run over the half cache and also (bit-identical) over
// a float cache of the same values.
void check(const cuda::AttentionShape& s, int64_t n, int64_t n_past, bool gated, uint32_t seed, bool f16 = false) {
  std::mt19937 rng(seed);
  const int64_t hd = s.head_dim, group = s.n_head / s.n_head_kv, qd = s.n_head * hd;
  cuda_test::PrefillInputs in = cuda_test::prefill_inputs(rng, s, n, n_past, gated);
  const std::vector<float>& q = in.q;
  std::vector<float>&kc = in.kc, &vc = in.vc, &gate = in.gate;
  std::vector<uint16_t> k16, v16;
  if (f16) k16 = cuda_test::round_to_half(kc), v16 = cuda_test::round_to_half(vc);

  cuda::DeviceBuffer<float> dq(q.size()), dk(kc.size()), dv(vc.size()), dg(std::max<size_t>(gate.size(), 1)),
      dout(q.size());
  dq.upload(q.data(), q.size());
  dk.upload(kc.data(), kc.size());
  dv.upload(vc.data(), vc.size());
  if (gated) dg.upload(gate.data(), gate.size());
  dout.fill_bytes(0xff);
  cuda::attention_prefill(s, dq.get(), dk.get(), dv.get(), n, n_past, gated ? dg.get() : nullptr, 2 * qd, 2 * hd,
                          dout.get());
  std::vector<float> got(q.size());
  dout.download(got.data(), got.size());
  if (f16) {
    cuda::DeviceBuffer<__half> dk16(k16.size()), dv16(v16.size());
    dk16.upload(reinterpret_cast<const __half*>(k16.data()), k16.size());
    dv16.upload(reinterpret_cast<const __half*>(v16.data()), v16.size());
    dout.fill_bytes(0xff);
    cuda::attention_prefill(s, dq.get(), dk16.get(), dv16.get(), n, n_past, gated ? dg.get() : nullptr, 2 * qd,
                            2 * hd, dout.get());
    std::vector<float> from_half(q.size());
    dout.download(from_half.data(), from_half.size());
    ASSERT_EQ(std::memcmp(from_half.data(), got.data(), got.size() * 4), 0)
        << "the half cache's output differs from the float cache's of the same values";
    got.swap(from_half);
  }

  const double u = std::ldexp(1.0, -24);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < s.n_head; ++h) {
      const int64_t n_kv = n_past + t + 1, g = h / group;
      const float* qh = q.data() + (t * s.n_head + h) * hd;
      std::vector<double> sc(static_cast<size_t>(n_kv));
      double mx = -INFINITY, max_ds = 0, max_s = 0;
      for (int64_t j = 0; j < n_kv; ++j) {
        double dot = 0, mag = 0;
        for (int64_t d = 0; d < hd; ++d) {
          const double p = double(qh[d]) * kc[j * s.kv_stride + g * hd + d];
          dot += p;
          mag += std::fabs(p);
        }
        sc[j] = dot * s.scale;
        max_ds = std::max(max_ds, double(hd) * u * s.scale * mag + u * std::fabs(sc[j]));
        max_s = std::max(max_s, std::fabs(sc[j]));
        mx = std::max(mx, sc[j]);
      }
      double sum = 0;
      for (double& v : sc) sum += (v = std::exp(v - mx));
      const double tiles = double((n_kv + 15) / 16);
      const double e_p = 2 * max_ds + 4 * u * max_s + (2 + 3 * tiles) * u;
      const double rel = 2 * e_p + (double(n_kv) + 2 * tiles + 7) * u;
      for (int64_t d = 0; d < hd; ++d) {
        double o = 0, mag = 0;
        for (int64_t j = 0; j < n_kv; ++j) {
          const double pv = sc[j] / sum * vc[j * s.kv_stride + g * hd + d];
          o += pv;
          mag += std::fabs(pv);
        }
        double tol = rel * mag;
        if (gated) {
          const double sg = 1.0 / (1.0 + std::exp(-double(gate[t * 2 * qd + h * 2 * hd + d])));
          o *= sg;
          tol = tol * sg + 4 * u * std::fabs(o);
        }
        const float gd = got[(t * s.n_head + h) * hd + d];
        ASSERT_LE(std::fabs(gd - o), tol + 1e-30)
            << "row " << t << " head " << h << " dim " << d << ": got " << gd << ", exact " << o;
      }
    }
  }
}

TEST(CudaAttentionPrefill, MatchesExactSoftmaxAttention) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check(cuda_test::attention_shape(32, 4, 128, 8), 200, 0, false, 1);   // Qwen3-30B, a prefill from empty
  check(cuda_test::attention_shape(32, 4, 128, 8), 70, 333, false, 2);  // a second chunk after a cached past
  check(cuda_test::attention_shape(16, 2, 256, 8), 90, 40, true, 3);    // qwen3next, gated
  check(cuda_test::attention_shape(6, 2, 40, 8), 75, 5, true, 4);       // group of 3 (tiles cut mid-row), odd head_dim
  check(cuda_test::attention_shape(4, 4, 512, 8), 40, 20, false, 5);    // largest head_dim, no grouping
  check(cuda_test::attention_shape(32, 4, 128, 8), 1, 0, false, 6);     // a single row and position
}

TEST(CudaAttentionPrefillF16, MatchesExactAttentionOnTheHalfValues) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check(cuda_test::attention_shape(32, 4, 128, 8), 200, 0, false, 101, true);
  check(cuda_test::attention_shape(32, 4, 128, 8), 70, 333, false, 102, true);
  check(cuda_test::attention_shape(16, 2, 256, 8), 90, 40, true, 103, true);
  check(cuda_test::attention_shape(6, 2, 40, 8), 75, 5, true, 104, true);
  check(cuda_test::attention_shape(4, 4, 512, 8), 40, 20, false, 105, true);
}

TEST(CudaAttentionPrefillArguments, RejectsBadShape) {
  const float* kNoCache = nullptr;   // picks the float cache's overload
  cuda::AttentionShape s = cuda_test::attention_shape(4, 3, 64, 8);  // 4 heads do not group over 3 kv heads
  EXPECT_THROW(cuda::attention_prefill(s, nullptr, kNoCache, kNoCache, 64, 0, nullptr, 0, 0, nullptr),
               std::invalid_argument);
  s = cuda_test::attention_shape(4, 2, 1024, 8);  // head_dim above kAttentionPrefillMaxHeadDim
  EXPECT_THROW(cuda::attention_prefill(s, nullptr, kNoCache, kNoCache, 64, 0, nullptr, 0, 0, nullptr),
               std::invalid_argument);
  s = cuda_test::attention_shape(4, 2, 64, 8);
  EXPECT_THROW(cuda::attention_prefill(s, nullptr, kNoCache, kNoCache, 64, -1, nullptr, 0, 0, nullptr),
               std::invalid_argument);  // negative n_past
}

}  // namespace
}  // namespace moraine
