// Flash-decoding attention (kernels/cuda/attention_decode.h) against the exact softmax attention
// in double (the reference's formula), at positions around chunk and tile edges, for 1 to 16 rows,
// gated and not; a row gives the same bits whatever call serves it (the property decode after
// prefill relies on); a device position outside the capacity gives NaN rows.
// Tolerance, first order in u = 2^-24: a score is off by at most
//   ds_j = (hd + 2) u scale sum_d |q_d k_jd| + u |s_j|     (sequential fma chain, scaling)
// which moves p_j relatively by up to 2 max_j ds_j; exp, the per-tile rescaling (one product per
// tile of 32) and the merge add (8 + 2 * tiles + chunks) u; the weighted sum of values adds
// (positions per chunk + chunks + 8) u of sum_j p_j |v_jd|.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/attention_decode.h"
#include "kernels/cuda/device_buffer.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

struct Case {
  cuda::AttentionShape s;
  int64_t max_ctx, n, pos;   // rows n at positions pos .. pos + n - 1
  bool gated;
  uint32_t seed;
};

struct Data {
  std::vector<float> q, k, v, gate;
};

Data make_data(const Case& c) {
  std::mt19937 rng(c.seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Data d;
  const int64_t qd = c.s.n_head * c.s.head_dim;
  d.q.resize(static_cast<size_t>(c.n * qd));
  d.k.resize(static_cast<size_t>(c.max_ctx * c.s.kv_stride));
  d.v.resize(d.k.size());
  d.gate.resize(static_cast<size_t>(c.n * 2 * qd));
  for (float& x : d.q) x = nd(rng);
  for (float& x : d.k) x = nd(rng);
  for (float& x : d.v) x = nd(rng);
  for (float& x : d.gate) x = 2.0f * nd(rng);
  return d;
}

// Output of attention_decode for rows [r0, r0 + n) of the case, served as one call.
std::vector<float> run(const Case& c, const Data& d, int64_t r0, int64_t n, int32_t pos) {
  const int64_t qd = c.s.n_head * c.s.head_dim;
  cuda::DeviceBuffer<float> q(static_cast<size_t>(n * qd)), k(d.k.size()), v(d.v.size()), g(d.gate.size()),
      out(static_cast<size_t>(n * qd));
  q.upload(d.q.data() + r0 * qd, static_cast<size_t>(n * qd));
  k.upload(d.k.data(), d.k.size());
  v.upload(d.v.data(), d.v.size());
  g.upload(d.gate.data(), d.gate.size());
  cuda::DeviceBuffer<int32_t> dpos(1);
  dpos.upload(&pos, 1);
  const int64_t sf = cuda::attention_decode_scratch_floats(c.s, n, c.max_ctx);
  cuda::DeviceBuffer<float> scratch(static_cast<size_t>(sf));
  out.fill_bytes(0xff);
  scratch.fill_bytes(0xff);
  const float* gate = c.gated ? g.get() + r0 * 2 * qd + c.s.head_dim : nullptr;
  cuda::attention_decode(c.s, q.get(), k.get(), v.get(), n, dpos.get(), r0, c.max_ctx, gate, 2 * qd, 2 * c.s.head_dim,
                         out.get(), scratch.get(), sf);
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> h(out.size());
  out.download(h.data(), h.size());
  return h;
}

void check_exact(const Case& c) {
  const Data d = make_data(c);
  const std::vector<float> got = run(c, d, 0, c.n, static_cast<int32_t>(c.pos));
  const cuda::AttentionShape& s = c.s;
  const int64_t hd = s.head_dim, group = s.n_head / s.n_head_kv, qd = s.n_head * hd;
  const double u = std::ldexp(1.0, -24);
  for (int64_t t = 0; t < c.n; ++t) {
    const int64_t n_kv = c.pos + t + 1;
    const int64_t chunks = (n_kv + cuda::kDecodeChunk - 1) / cuda::kDecodeChunk;
    for (int64_t h = 0; h < s.n_head; ++h) {
      const int64_t kvh = h / group;
      const float* qh = d.q.data() + t * qd + h * hd;
      std::vector<double> sc(static_cast<size_t>(n_kv));
      double mx = -INFINITY, max_ds = 0;
      for (int64_t j = 0; j < n_kv; ++j) {
        double dot = 0, mag = 0;
        for (int64_t e = 0; e < hd; ++e) {
          const double p = double(qh[e]) * d.k[j * s.kv_stride + kvh * hd + e];
          dot += p;
          mag += std::fabs(p);
        }
        sc[j] = dot * s.scale;
        mx = std::max(mx, sc[j]);
        max_ds = std::max(max_ds, double(hd + 2) * u * s.scale * mag + u * std::fabs(sc[j]));
      }
      double sum = 0;
      for (double& x : sc) sum += (x = std::exp(x - mx));
      const double rel = 2 * max_ds + double(8 + 2 * (cuda::kDecodeChunk / 32) + chunks) * u +
                         double(std::min<int64_t>(n_kv, cuda::kDecodeChunk) + chunks + 8) * u;
      for (int64_t e = 0; e < hd; ++e) {
        double o = 0, mag = 0;
        for (int64_t j = 0; j < n_kv; ++j) {
          const double pv = sc[j] / sum * d.v[j * s.kv_stride + kvh * hd + e];
          o += pv;
          mag += std::fabs(pv);
        }
        double tol = rel * mag;
        if (c.gated) {
          const double sg = 1.0 / (1.0 + std::exp(-double(d.gate[t * 2 * qd + h * 2 * hd + hd + e])));
          o *= sg;
          tol = tol * sg + 4 * u * std::fabs(o);
        }
        const double gd = got[static_cast<size_t>(t * qd + h * hd + e)];
        ASSERT_LE(std::fabs(gd - o), tol + 1e-30) << "pos " << c.pos << " row " << t << " head " << h << " dim " << e
                                                  << ": got " << gd << ", exact " << o << ", tolerance " << tol;
      }
    }
  }
}

TEST(CudaAttentionDecode, MatchesExactAttention) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check_exact({cuda_test::attention_shape(32, 4, 128), 512, 1, 0, false, 1});      // the first token
  check_exact({cuda_test::attention_shape(32, 4, 128), 512, 1, 127, false, 2});    // a chunk's last position
  check_exact({cuda_test::attention_shape(32, 4, 128), 512, 5, 126, false, 3});    // rows straddling a chunk edge
  check_exact({cuda_test::attention_shape(32, 4, 128), 1024, 16, 700, false, 4});  // 16 rows, several chunks, partial tiles
  check_exact({cuda_test::attention_shape(16, 2, 256), 512, 3, 300, true, 5});     // qwen3next's gated heads of 256
  check_exact({cuda_test::attention_shape(4, 4, 64), 256, 2, 40, false, 6});       // no grouping
}

// The property decode after prefill relies on: the bits of a row do not depend on the call.
TEST(CudaAttentionDecode, RowBitsDoNotDependOnTheCall) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const Case c{cuda_test::attention_shape(32, 4, 128), 1024, 9, 250, true, 7};
  const Data d = make_data(c);
  const std::vector<float> all = run(c, d, 0, c.n, static_cast<int32_t>(c.pos));
  const int64_t qd = c.s.n_head * c.s.head_dim;
  for (int64_t r = 0; r < c.n; ++r) {
    const std::vector<float> one = run(c, d, r, 1, static_cast<int32_t>(c.pos));
    ASSERT_EQ(std::memcmp(one.data(), all.data() + r * qd, static_cast<size_t>(qd) * 4), 0) << "row " << r;
  }
}

TEST(CudaAttentionDecode, PositionOutsideCapacityGivesNaN) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const Case c{cuda_test::attention_shape(8, 2, 64), 256, 4, 0, false, 8};
  const Data d = make_data(c);
  for (int32_t pos : {-1, 253, 100000}) {
    const std::vector<float> got = run(c, d, 0, c.n, pos);
    for (float x : got) ASSERT_TRUE(std::isnan(x)) << "position " << pos;
  }
}

TEST(CudaAttentionDecodeArguments, RejectsBadCalls) {
  const cuda::AttentionShape odd = cuda_test::attention_shape(4, 2, 96);
  EXPECT_FALSE(cuda::attention_decode_supported(odd));
  EXPECT_TRUE(cuda::attention_decode_supported(cuda_test::attention_shape(32, 4, 128)));
  float* p = nullptr;
  EXPECT_THROW(cuda::attention_decode(odd, p, p, p, 1, nullptr, 0, 16, nullptr, 0, 0, p, p, 1 << 20),
               std::invalid_argument);
  EXPECT_THROW(cuda::attention_decode(cuda_test::attention_shape(32, 4, 128), p, p, p, 17, nullptr, 0, 16, nullptr, 0, 0, p, p, 1 << 20),
               std::invalid_argument);
  EXPECT_THROW(cuda::attention_decode(cuda_test::attention_shape(32, 4, 128), p, p, p, 1, nullptr, 0, 4096, nullptr, 0, 0, p, p, 10),
               std::invalid_argument);
}

}  // namespace
}  // namespace moraine
