// Tensor-core prefill attention over the F16 cache (kernels/cuda/attention_prefill_tc.h) against
// the exact softmax attention in double over the same half K and V (the formula of
// moraine::reference::attend_one_head), for Qwen3-30B and qwen3next shapes, a group of 3 (query
// tiles cut mid-row), prefills from empty and after a cached past, long enough for many KV tiles
// through the double buffer. Outputs NaN-poisoned before the run. Not compared bit for bit with
// attention_prefill: the arithmetic differs (tensor cores, split operands).
//
// Tolerance, first order in u = 2^-24, the way tests/cuda/attention_prefill_test.cpp derives its
// own; what differs from there:
//   The mma model: products of halves are exact in F32; each addition inside or onto the F32
//   accumulator errs by at most 2u of the running sum of magnitudes (one ulp: tensor cores align
//   and truncate rather than round to nearest, Fasi, Higham, Mikaitis, Pranesh 2021; an m16n8k16
//   counts as 16 additions). Plain F32 instructions (scale, expf, the rescales) as in that test.
//   Split operands: x = x_hi + x_lo + e, |e| <= 2^-22 (1 + 2^-10) |x| while x - x_hi is a normal
//   half, else |e| < 2^-14: a part in half's subnormal range, whether the tensor cores take it
//   (then |e| <= 2^-25) or flush it to zero (|e| < 2^-14; not documented either way, so the bound
//   allows it). The kernel splits q 2^e, the power of two that brings its query tile's max |q| to
//   [2^14, 2^15), so q's absolute part is 2^-14 2^-e <= 2^-28 max|q| (taken over all of q here);
//   it splits p 2^15, so p's is 2^-29, and p <= 1 in the running max's units, <= 1 after the
//   (<= 1) rescales. Both scalings are exact.
//   score s_j: two mma chains into one accumulator over the KV tile (q_hi.K and q_lo.K: 2 hd
//     additions over sum_d (|q_hi| + |q_lo|)|k_jd| <= (1 + 2^-10) sum_d |q_d k_jd|), q's split,
//     then the scale:
//     ds_j <= (4 hd (1 + 2^-10) + 4.004) u scale sum_d |q_d k_jd| + 2^-28 max|q| scale sum_d |k_jd|
//             + u |s_j|;
//   p_j: as in that test, e_p <= 2 max ds + 4u max|s| + (2 + 3 tiles) u;
//   the numerator: per KV tile a fresh mma chain (P_hi.V and P_lo.V: 2 kBc additions over
//     (1 + 2^-10) sum p_j |v_jd|), P's split (4.004 u relative and 2^-29 sum_j |v_jd| absolute),
//     then O = O corr + tile (2u a tile): (4 kBc (1 + 2^-10) + 4.004 + 2 tiles) u relative;
//   the denominator l (unsplit F32 p): a lane's kBc / 4 values, 2 quad shuffles, l corr + sum:
//     (kBc / 4 + 2 + 2 tiles) u; the final 1/l and its multiply 2u (the 2^-15 is exact);
//   rel = 2 e_p + the numerator's + the denominator's + 2u, all relative to sum_j p_j |v_jd| / l,
//   plus the absolute 2^-29 sum_j |v_jd| / l.
//   kBc is taken as 64 (the kernel's largest KV tile) in the chains, tiles = ceil(n_kv / 32) (its
//   smallest): a query's tiles past its last position are exact no-ops (corr = 1, p = 0).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

#include "common/formats/half_float.h"
#include "kernels/cuda/attention_prefill_tc.h"
#include "kernels/cuda/device_buffer.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

constexpr double kMaxTile = 64, kMinTile = 32;  // the kernel's KV tiles (positions), see the top

// window / sinks (gpt-oss's options, AttentionShape): a sliding window over the positions (the
// exact attention over the window's positions, tiles counted over them plus one for the partial
// first) and a sink logit per head (sd 3), adding 2u (|sink - m| + |max s - m|) + 8u as in
// attention_sinks_test.cpp (the sink's exp and the sum's rescale, each expf's 2u and u of its
// argument; the products, the add, the division).
void check(const cuda::AttentionShape& s0, int64_t n, int64_t n_past, bool gated, uint32_t seed, int64_t window = 0,
           bool with_sinks = false) {
  std::mt19937 rng(seed);
  cuda::AttentionShape s = s0;
  s.window = window;
  const int64_t hd = s.head_dim, group = s.n_head / s.n_head_kv, qd = s.n_head * hd;
  cuda_test::PrefillInputs in = cuda_test::prefill_inputs(rng, s, n, n_past, gated);
  const std::vector<float> sinks = with_sinks ? cuda_test::normal_values(rng, static_cast<size_t>(s.n_head), 3.0f)
                                              : std::vector<float>();
  cuda::DeviceBuffer<float> dsinks(std::max<size_t>(sinks.size(), 1));
  if (with_sinks) {
    dsinks.upload(sinks.data(), sinks.size());
    s.sinks = dsinks.get();
  }
  const std::vector<float>& q = in.q;
  std::vector<float>&kc = in.kc, &vc = in.vc, &gate = in.gate;
  const std::vector<uint16_t> k16 = cuda_test::round_to_half(kc), v16 = cuda_test::round_to_half(vc);

  cuda::DeviceBuffer<float> dq(q.size()), dg(std::max<size_t>(gate.size(), 1)), dout(q.size());
  cuda::DeviceBuffer<__half> dk(k16.size()), dv(v16.size());
  dq.upload(q.data(), q.size());
  dk.upload(reinterpret_cast<const __half*>(k16.data()), k16.size());
  dv.upload(reinterpret_cast<const __half*>(v16.data()), v16.size());
  if (gated) dg.upload(gate.data(), gate.size());
  dout.fill_bytes(0xff);
  ASSERT_TRUE(cuda::attention_prefill_tc_supports(s, dk.get(), dv.get()));
  cuda::attention_prefill_tc(s, dq.get(), dk.get(), dv.get(), n, n_past, gated ? dg.get() : nullptr, 2 * qd, 2 * hd,
                             dout.get());
  std::vector<float> got(q.size());
  dout.download(got.data(), got.size());

  const double u = std::ldexp(1.0, -24), split = 4.004 * u, grow = 1 + std::ldexp(1.0, -10);
  double q_max = 0;
  for (float x : q) q_max = std::max(q_max, double(std::fabs(x)));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < s.n_head; ++h) {
      const int64_t n_kv = n_past + t + 1, g = h / group;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, n_kv - window) : 0, seen = n_kv - lo;
      const float* qh = q.data() + (t * s.n_head + h) * hd;
      std::vector<double> sc(static_cast<size_t>(seen));
      double smax = -INFINITY, max_ds = 0, max_s = 0;
      for (int64_t j = 0; j < seen; ++j) {
        double dot = 0, mag = 0, k1 = 0;
        for (int64_t d = 0; d < hd; ++d) {
          const double kv = kc[(lo + j) * s.kv_stride + g * hd + d];
          const double p = double(qh[d]) * kv;
          dot += p;
          mag += std::fabs(p);
          k1 += std::fabs(kv);
        }
        sc[j] = dot * s.scale;
        const double ds = (4 * double(hd) * grow + 4.004) * u * s.scale * mag +
                          std::ldexp(1.0, -28) * q_max * s.scale * k1 + u * std::fabs(sc[j]);
        max_ds = std::max(max_ds, ds);
        max_s = std::max(max_s, std::fabs(sc[j]));
        smax = std::max(smax, sc[j]);
      }
      const double mx = with_sinks ? std::max(smax, double(sinks[h])) : smax;
      double sum = with_sinks ? std::exp(sinks[h] - mx) : 0.0;
      for (double& v : sc) sum += (v = std::exp(v - mx));
      const double tiles = std::ceil(double(seen) / kMinTile) + (window > 0 ? 1 : 0);
      const double e_p = 2 * max_ds + 4 * u * max_s + (2 + 3 * tiles) * u;
      const double numerator = (4 * kMaxTile * grow + 2 * tiles) * u + split;
      const double denominator = (kMaxTile / 4 + 2 + 2 * tiles) * u;
      double rel = 2 * e_p + numerator + denominator + 2 * u;
      if (with_sinks) rel += 2 * u * (std::fabs(sinks[h] - mx) + std::fabs(smax - mx)) + 8 * u;
      for (int64_t d = 0; d < hd; ++d) {
        double o = 0, mag = 0, v1 = 0;
        for (int64_t j = 0; j < seen; ++j) {
          const double v = vc[(lo + j) * s.kv_stride + g * hd + d];
          const double pv = sc[j] / sum * v;
          o += pv;
          mag += std::fabs(pv);
          v1 += std::fabs(v);
        }
        double tol = rel * mag + std::ldexp(1.0, -29) * v1 / sum;
        if (gated) {
          const double sg = 1.0 / (1.0 + std::exp(-double(gate[t * 2 * qd + h * 2 * hd + d])));
          o *= sg;
          tol = tol * sg + 4 * u * std::fabs(o);
        }
        const float gd = got[(t * s.n_head + h) * hd + d];
        ASSERT_LE(std::fabs(gd - o), tol + 1e-30)
            << "row " << t << " head " << h << " dim " << d << ": got " << gd << ", exact " << o << ", tol " << tol;
      }
    }
  }
}

// The bound above is dominated by the mma chains, loose enough that dropping q_lo or P_lo would
// pass it; this check isolates the split. K and V one-hot: position j's kv head holds c_j
// (+-2^e, e in -2..3) in K and w_j (a random half) in V, both at dim j (n_kv <= head_dim), zeros
// elsewhere. Then every mma sum has one nonzero product (q_hi c_j and p_hi w_j are exact: 11 x
// 11 bits) plus the lo product: one truncated addition (2u), and adding zeros is exact. So
//   ds_j <= (4.004 + 2) u scale |q_j c_j| + 2^-28 max|q| scale |c_j| + u |s_j|  (split, add, scale);
//   e_p as above; output dim d < n_kv is p_d w_d / l: the numerator carries P's split (4.004u,
//   2^-29 |w_d| absolute), its add (2u) and the later tiles' rescales (u a tile), l and the final
//   1/l as above: rel = 2 e_p + (6.004 + tiles) u + (kBc / 4 + 2 + 2 tiles) u + 2u, ~400u here.
//   Dims d >= n_kv are exact zeros. Without the split an operand errs by up to 2^-12 = 4096u.
void check_split(const cuda::AttentionShape& s, int64_t n, int64_t n_past, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t hd = s.head_dim, n_ctx = n_past + n, group = s.n_head / s.n_head_kv, qd = s.n_head * hd;
  ASSERT_LE(n_ctx, hd) << "one-hot rows need a dim per position";
  // Wide q (sd 3) so the scores spread and the running max moves.
  const std::vector<float> q = cuda_test::normal_values(rng, static_cast<size_t>(n * qd), 3.0f);
  std::vector<float> kc(static_cast<size_t>(n_ctx * s.kv_stride), 0.0f), vc(kc.size(), 0.0f);
  std::uniform_int_distribution<int> exponent(-2, 3), sign(0, 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t j = 0; j < n_ctx; ++j)
    for (int64_t g = 0; g < s.n_head_kv; ++g) {
      kc[j * s.kv_stride + g * hd + j] = std::ldexp(sign(rng) ? 1.0f : -1.0f, exponent(rng));
      vc[j * s.kv_stride + g * hd + j] = normal(rng);
    }
  const std::vector<uint16_t> k16 = cuda_test::round_to_half(kc), v16 = cuda_test::round_to_half(vc);

  cuda::DeviceBuffer<float> dq(q.size()), dout(q.size());
  cuda::DeviceBuffer<__half> dk(k16.size()), dv(v16.size());
  dq.upload(q.data(), q.size());
  dk.upload(reinterpret_cast<const __half*>(k16.data()), k16.size());
  dv.upload(reinterpret_cast<const __half*>(v16.data()), v16.size());
  dout.fill_bytes(0xff);
  cuda::attention_prefill_tc(s, dq.get(), dk.get(), dv.get(), n, n_past, nullptr, 0, 0, dout.get());
  std::vector<float> got(q.size());
  dout.download(got.data(), got.size());

  const double u = std::ldexp(1.0, -24);
  double q_max = 0;
  for (float x : q) q_max = std::max(q_max, double(std::fabs(x)));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < s.n_head; ++h) {
      const int64_t n_kv = n_past + t + 1, g = h / group;
      const float* qh = q.data() + (t * s.n_head + h) * hd;
      std::vector<double> p(static_cast<size_t>(n_kv));
      double mx = -INFINITY, max_ds = 0, max_s = 0;
      for (int64_t j = 0; j < n_kv; ++j) {
        const double c = kc[j * s.kv_stride + g * hd + j];
        p[j] = double(qh[j]) * c * s.scale;
        max_ds = std::max(max_ds, 6.004 * u * s.scale * std::fabs(double(qh[j]) * c) +
                                      std::ldexp(1.0, -28) * q_max * s.scale * std::fabs(c) + u * std::fabs(p[j]));
        max_s = std::max(max_s, std::fabs(p[j]));
        mx = std::max(mx, p[j]);
      }
      double sum = 0;
      for (double& v : p) sum += (v = std::exp(v - mx));
      const double tiles = std::ceil(double(n_kv) / kMinTile);
      const double e_p = 2 * max_ds + 4 * u * max_s + (2 + 3 * tiles) * u;
      const double rel = 2 * e_p + (6.004 + tiles) * u + (kMaxTile / 4 + 2 + 2 * tiles) * u + 2 * u;
      for (int64_t d = 0; d < hd; ++d) {
        double o = 0, tol = 0;
        if (d < n_kv) {
          const double w = vc[d * s.kv_stride + g * hd + d];
          o = p[d] / sum * w;
          tol = rel * std::fabs(o) + std::ldexp(1.0, -29) * std::fabs(w) / sum;
        }
        const float gd = got[(t * s.n_head + h) * hd + d];
        ASSERT_LE(std::fabs(gd - o), tol + 1e-30)
            << "row " << t << " head " << h << " dim " << d << ": got " << gd << ", exact " << o << ", tol " << tol;
      }
    }
  }
}

TEST(CudaAttentionPrefillTc, MatchesExactAttentionOnTheHalfValues) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check(cuda_test::attention_shape(32, 4, 128, 8), 200, 0, false, 201);   // Qwen3-30B, a prefill from empty
  check(cuda_test::attention_shape(32, 4, 128, 8), 70, 333, false, 202);  // a second chunk after a cached past
  check(cuda_test::attention_shape(16, 2, 256, 8), 90, 40, true, 203);    // qwen3next, gated
  check(cuda_test::attention_shape(6, 2, 128, 8), 75, 5, true, 204);      // group of 3: tiles cut mid-row
  check(cuda_test::attention_shape(4, 4, 256, 8), 40, 20, false, 205);    // no grouping
  check(cuda_test::attention_shape(32, 4, 128, 8), 1, 0, false, 206);     // a single row and position
  check(cuda_test::attention_shape(8, 1, 128, 8), 150, 900, false, 207);  // ~30 KV tiles, both buffers many times
}

// gpt-oss's options at the tensor-core kernel's head sizes: windows shorter than the prefill and
// than a KV tile, after a past longer than the window, sinks with and without a window.
TEST(CudaAttentionPrefillTc, SinksAndSlidingWindowMatchExactAttention) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check(cuda_test::attention_shape(32, 4, 128, 8), 200, 0, false, 301, 128, true);
  check(cuda_test::attention_shape(32, 4, 128, 8), 70, 333, false, 302, 40, true);
  check(cuda_test::attention_shape(16, 2, 256, 8), 90, 40, true, 303, 0, true);
  check(cuda_test::attention_shape(6, 2, 128, 8), 75, 5, false, 304, 8, false);
  check(cuda_test::attention_shape(8, 1, 128, 8), 150, 900, false, 305, 300, true);
}

TEST(CudaAttentionPrefillTc, SplitOperandsKeepF32Accuracy) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check_split(cuda_test::attention_shape(32, 4, 128, 8), 100, 20, 301);  // Qwen3-30B: 2 KV tiles of 64
  check_split(cuda_test::attention_shape(16, 2, 256, 8), 60, 150, 302);  // qwen3next's head_dim: 7 tiles of 32
  check_split(cuda_test::attention_shape(6, 2, 128, 8), 75, 5, 303);     // group of 3: tiles cut mid-row
}

TEST(CudaAttentionPrefillTcArguments, RejectsWhatItDoesNotTake) {
  // No device needed: the checks come before any launch. Non-null, 16-byte aligned fakes.
  const auto* fake = reinterpret_cast<const __half*>(uintptr_t{4096});
  cuda::AttentionShape s = cuda_test::attention_shape(4, 2, 64, 8);  // head_dim 64: no tensor-core variant
  EXPECT_FALSE(cuda::attention_prefill_tc_supports(s, fake, fake));
  EXPECT_THROW(cuda::attention_prefill_tc(s, nullptr, fake, fake, 64, 0, nullptr, 0, 0, nullptr),
               std::invalid_argument);
  s = cuda_test::attention_shape(4, 2, 128, 4);  // kv_stride 260: not a multiple of 8 halves
  EXPECT_FALSE(cuda::attention_prefill_tc_supports(s, fake, fake));
  EXPECT_THROW(cuda::attention_prefill_tc(s, nullptr, fake, fake, 64, 0, nullptr, 0, 0, nullptr),
               std::invalid_argument);
  s = cuda_test::attention_shape(4, 2, 128, 8);
  EXPECT_TRUE(cuda::attention_prefill_tc_supports(s, fake, fake));
  EXPECT_FALSE(cuda::attention_prefill_tc_supports(s, fake + 1, fake));  // 2 bytes off: no 16-byte cp.async
  EXPECT_THROW(cuda::attention_prefill_tc(s, nullptr, fake, fake + 4, 64, 0, nullptr, 0, 0, nullptr),
               std::invalid_argument);
  EXPECT_THROW(cuda::attention_prefill_tc(s, nullptr, fake, fake, 64, -1, nullptr, 0, 0, nullptr),
               std::invalid_argument);  // negative n_past
  s = cuda_test::attention_shape(4, 3, 128, 8);  // 4 heads do not group over 3 kv heads
  EXPECT_THROW(cuda::attention_prefill_tc(s, nullptr, fake, fake, 64, 0, nullptr, 0, 0, nullptr),
               std::invalid_argument);
}

}  // namespace
}  // namespace moraine
