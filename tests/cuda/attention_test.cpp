// Causal GQA attention on the GPU (kernels/cuda/attention.h) against the exact softmax attention
// (in double) of the reference's formula (moraine::reference::attend_one_head), with a KV length
// crossing several chunks, a gate, and a check that a batch of rows gives bit-identical output
// to the same rows run one by one (the property decode-after-prefill relies on), and that the
// GQA-shared kernel gives the very bits of the kernel before the sharing.
// Tolerance, first order in u = 2^-24: a score s_j is off by at most
//   ds_j = (hd/32 + 5) u scale sum_d |q_d k_jd| + u |s_j|   (fma chain, warp tree, scaling),
// which moves p_j relatively by up to 2 max_j ds_j, plus 8u for exp and the normalisation; the
// weighted sum of values adds (positions per chunk + chunks + 8) u of sum_j p_j |v_jd|.
// The half cache (the CUDA backend's F16 KV): K and V rounded to IEEE half on the host, the exact
// attention over those rounded values with the same tolerance (the kernel widens each element
// exactly), batch and row by row alike; and bit for bit the float cache's output of the same values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "common/formats/half_float.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/device_buffer.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

struct Run {
  cuda::AttentionShape s;
  int64_t n, n_past;
  bool gated;
};

// f16: the cache is kc / vc as halves (they must be half values: round_to_half).
std::vector<float> run_gpu(const Run& r, const std::vector<float>& q, const std::vector<float>& kc,
                           const std::vector<float>& vc, const std::vector<float>& gate, int64_t rows_per_call,
                           int64_t scratch_rows, bool f16 = false) {
  const cuda::AttentionShape& s = r.s;
  const int64_t qd = s.n_head * s.head_dim;
  cuda::DeviceBuffer<float> dq(q.size()), dk(kc.size()), dv(vc.size()), dg(std::max<size_t>(gate.size(), 1)),
      dout(q.size());
  cuda::DeviceBuffer<__half> dk16(f16 ? kc.size() : 0), dv16(f16 ? vc.size() : 0);
  dq.upload(q.data(), q.size());
  dk.upload(kc.data(), kc.size());
  dv.upload(vc.data(), vc.size());
  if (f16) {
    for (auto [from, to] : {std::pair{&kc, &dk16}, std::pair{&vc, &dv16}}) {
      std::vector<uint16_t> h(from->size());
      for (size_t i = 0; i < h.size(); ++i) h[i] = half::fp32_to_fp16((*from)[i]);
      to->upload(reinterpret_cast<const __half*>(h.data()), h.size());
    }
  }
  if (!gate.empty()) dg.upload(gate.data(), gate.size());
  dout.fill_bytes(0xff);
  const int64_t scratch = cuda::attention_scratch_floats(s, scratch_rows, r.n_past + r.n);
  cuda::DeviceBuffer<float> dscratch(static_cast<size_t>(scratch));
  for (int64_t t0 = 0; t0 < r.n; t0 += rows_per_call) {
    const int64_t m = std::min(rows_per_call, r.n - t0);
    const float* g = r.gated ? dg.get() + t0 * 2 * qd : nullptr;
    if (f16)
      cuda::attention(s, dq.get() + t0 * qd, dk16.get(), dv16.get(), m, r.n_past + t0, g, 2 * qd, 2 * s.head_dim,
                      dout.get() + t0 * qd, dscratch.get(), scratch);
    else
      cuda::attention(s, dq.get() + t0 * qd, dk.get(), dv.get(), m, r.n_past + t0, g, 2 * qd, 2 * s.head_dim,
                      dout.get() + t0 * qd, dscratch.get(), scratch);
  }
  std::vector<float> out(q.size());
  dout.download(out.data(), out.size());
  return out;
}

// x replaced by its values rounded to IEEE half.
void round_to_half(std::vector<float>& x) {
  for (float& v : x) v = half::fp16_to_fp32(half::fp32_to_fp16(v));
}

// f16: K and V rounded to half and served from a half cache (also compared bit for bit with the
// float cache of the same values).
void check(const Run& r, uint32_t seed, bool f16 = false) {
  std::mt19937 rng(seed);
  const cuda::AttentionShape& s = r.s;
  const int64_t hd = s.head_dim, n_ctx = r.n_past + r.n, group = s.n_head / s.n_head_kv;
  const std::vector<float> q = cuda_test::normal_values(rng, static_cast<size_t>(r.n * s.n_head * hd), 1.0f);
  std::vector<float> kc = cuda_test::normal_values(rng, static_cast<size_t>(n_ctx * s.kv_stride), 1.0f);
  std::vector<float> vc = cuda_test::random_values(rng, static_cast<size_t>(n_ctx * s.kv_stride));
  if (f16) round_to_half(kc), round_to_half(vc);
  // The gate rides beside each head in a row of 2 * n_head * hd (as in qwen3next's q projection).
  std::vector<float> gate;
  if (r.gated) gate = cuda_test::normal_values(rng, static_cast<size_t>(r.n * 2 * s.n_head * hd), 2.0f);

  const std::vector<float> got = run_gpu(r, q, kc, vc, gate, r.n, r.n, f16);
  if (f16) {
    const std::vector<float> float_cache = run_gpu(r, q, kc, vc, gate, r.n, r.n, false);
    ASSERT_EQ(std::memcmp(float_cache.data(), got.data(), got.size() * 4), 0)
        << "the half cache's output differs from the float cache's of the same values";
  }
  const double u = std::ldexp(1.0, -24);
  for (int64_t t = 0; t < r.n; ++t) {
    for (int64_t h = 0; h < s.n_head; ++h) {
      const int64_t n_kv = r.n_past + t + 1, g = h / group;
      const float* qh = q.data() + (t * s.n_head + h) * hd;
      std::vector<double> sc(n_kv);
      double mx = -INFINITY, max_ds = 0;
      for (int64_t j = 0; j < n_kv; ++j) {
        double dot = 0, mag = 0;
        for (int64_t d = 0; d < hd; ++d) {
          const double p = double(qh[d]) * kc[j * s.kv_stride + g * hd + d];
          dot += p;
          mag += std::fabs(p);
        }
        sc[j] = dot * s.scale;
        max_ds = std::max(max_ds, (double(hd) / 32 + 5) * u * s.scale * mag + u * std::fabs(sc[j]));
        mx = std::max(mx, sc[j]);
      }
      double sum = 0;
      for (double& v : sc) sum += (v = std::exp(v - mx));
      const int64_t chunks = (n_kv + cuda::kAttentionChunk - 1) / cuda::kAttentionChunk;
      const double rel = 2 * max_ds + 8 * u + double(std::min<int64_t>(n_kv, cuda::kAttentionChunk) + chunks + 8) * u;
      for (int64_t d = 0; d < hd; ++d) {
        double o = 0, mag = 0;
        for (int64_t j = 0; j < n_kv; ++j) {
          const double pv = sc[j] / sum * vc[j * s.kv_stride + g * hd + d];
          o += pv;
          mag += std::fabs(pv);
        }
        double tol = rel * mag;
        if (r.gated) {
          const double gv = gate[t * 2 * s.n_head * hd + h * 2 * hd + d];
          const double sg = 1.0 / (1.0 + std::exp(-gv));
          o *= sg;
          tol = tol * sg + 4 * u * std::fabs(o);
        }
        const float gd = got[(t * s.n_head + h) * hd + d];
        ASSERT_LE(std::fabs(gd - o), tol + 1e-30) << "row " << t << " head " << h << " dim " << d << ": got " << gd
                                                  << ", exact " << o;
      }
    }
  }
  // Row by row (as decode) gives the very same bits as the batch (as prefill), and so does the
  // batch through a scratch that holds two rows (passes of two rows).
  const std::vector<float> one_by_one = run_gpu(r, q, kc, vc, gate, 1, 1, f16);
  EXPECT_EQ(std::memcmp(one_by_one.data(), got.data(), got.size() * 4), 0) << "batch and row-by-row outputs differ";
  const std::vector<float> in_passes = run_gpu(r, q, kc, vc, gate, r.n, 2, f16);
  EXPECT_EQ(std::memcmp(in_passes.data(), got.data(), got.size() * 4), 0) << "a batch in passes of two rows differs";
}

TEST(CudaAttention, MatchesExactSoftmaxAttention) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check({cuda_test::attention_shape(4, 2, 128), 1, 0, false}, 1);     // the first decode step: one position
  check({cuda_test::attention_shape(4, 2, 128), 7, 0, false}, 2);     // a prefill from empty
  check({cuda_test::attention_shape(8, 2, 128), 3, 600, false}, 3);   // decode rows over three chunks
  check({cuda_test::attention_shape(6, 3, 256), 5, 250, true}, 4);    // gated, rows straddling a chunk boundary
  check({cuda_test::attention_shape(3, 1, 40), 300, 0, false}, 5);    // a long prefill, head_dim not a multiple of 32
}

TEST(CudaAttentionF16, MatchesExactSoftmaxAttentionOnTheHalfValues) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check({cuda_test::attention_shape(4, 2, 128), 7, 0, false}, 102, true);
  check({cuda_test::attention_shape(8, 2, 128), 3, 600, false}, 103, true);
  check({cuda_test::attention_shape(6, 3, 256), 5, 250, true}, 104, true);
  check({cuda_test::attention_shape(3, 1, 40), 300, 0, false}, 105, true);
  check({cuda_test::attention_shape(4, 2, 16), 40, 20, true}, 106, true);   // the golden qwen3moe_odd's heads
}

// The GQA-shared kernel (`attention`: one CTA per kv head and chunk for all its query heads and
// rows) against the kernel before the sharing (`attention_unshared`: one CTA per row, head and
// chunk), which it must reproduce bit for bit: same chunk cut, same arithmetic order per query.
// Qwen3-30B (32 q heads over 4 kv heads of 128) and qwen3next (16 over 2 of 256, gated) shapes,
// decode and multi-row calls, chunk boundaries, and a group of 1 and of 3.
void check_shared_equals_unshared(const Run& r, uint32_t seed) {
  std::mt19937 rng(seed);
  const cuda::AttentionShape& s = r.s;
  const int64_t hd = s.head_dim, n_ctx = r.n_past + r.n, qd = s.n_head * hd;
  const std::vector<float> q = cuda_test::normal_values(rng, static_cast<size_t>(r.n * qd), 1.0f);
  const std::vector<float> kc = cuda_test::normal_values(rng, static_cast<size_t>(n_ctx * s.kv_stride), 1.0f);
  const std::vector<float> vc = cuda_test::random_values(rng, static_cast<size_t>(n_ctx * s.kv_stride));
  std::vector<float> gate;
  if (r.gated) gate = cuda_test::normal_values(rng, static_cast<size_t>(r.n * 2 * qd), 2.0f);
  cuda::DeviceBuffer<float> dq(q.size()), dk(kc.size()), dv(vc.size()), dg(std::max<size_t>(gate.size(), 1)),
      dout(q.size());
  dq.upload(q.data(), q.size());
  dk.upload(kc.data(), kc.size());
  dv.upload(vc.data(), vc.size());
  if (!gate.empty()) dg.upload(gate.data(), gate.size());
  const int64_t scratch = cuda::attention_scratch_floats(s, r.n, n_ctx);
  cuda::DeviceBuffer<float> dscratch(static_cast<size_t>(scratch));
  std::vector<float> shared(q.size()), unshared(q.size());
  const float* g = r.gated ? dg.get() : nullptr;
  dout.fill_bytes(0xff);
  cuda::attention(s, dq.get(), dk.get(), dv.get(), r.n, r.n_past, g, 2 * qd, 2 * hd, dout.get(), dscratch.get(),
                  scratch);
  dout.download(shared.data(), shared.size());
  dout.fill_bytes(0xff);
  dscratch.fill_bytes(0xff);
  cuda::attention_unshared(s, dq.get(), dk.get(), dv.get(), r.n, r.n_past, g, 2 * qd, 2 * hd, dout.get(),
                           dscratch.get(), scratch);
  dout.download(unshared.data(), unshared.size());
  for (size_t i = 0; i < shared.size(); ++i) {
    ASSERT_FALSE(std::isnan(shared[i])) << "output " << i << " not written";
    ASSERT_EQ(std::memcmp(&shared[i], &unshared[i], 4), 0)
        << "row " << i / qd << " head " << i % qd / hd << " dim " << i % hd << ": shared " << shared[i]
        << ", unshared " << unshared[i];
  }
}

TEST(CudaAttention, GqaSharedKernelBitIdenticalToUnshared) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check_shared_equals_unshared({cuda_test::attention_shape(32, 4, 128), 1, 3000, false}, 11);  // decode, 12 chunks
  check_shared_equals_unshared({cuda_test::attention_shape(32, 4, 128), 16, 250, false}, 12);  // 16 rows across a chunk edge
  check_shared_equals_unshared({cuda_test::attention_shape(32, 4, 128), 1, 0, false}, 13);     // one position
  check_shared_equals_unshared({cuda_test::attention_shape(16, 2, 256), 3, 511, true}, 14);    // qwen3next, gated
  check_shared_equals_unshared({cuda_test::attention_shape(4, 4, 64), 9, 100, false}, 15);     // no grouping
  check_shared_equals_unshared({cuda_test::attention_shape(6, 2, 40), 70, 200, true}, 16);     // group of 3, odd head_dim
  check_shared_equals_unshared({cuda_test::attention_shape(8, 1, 512), 2, 300, false}, 17);    // largest head_dim
}

TEST(CudaAttentionArguments, RejectsBadShapeAndSmallScratch) {
  const float* kNoCache = nullptr;   // picks the float cache's overload
  cuda::AttentionShape s = cuda_test::attention_shape(4, 3, 64);  // 4 heads do not group over 3 kv heads
  EXPECT_THROW(cuda::attention(s, nullptr, kNoCache, kNoCache, 1, 0, nullptr, 0, 0, nullptr, nullptr, 1 << 20),
               std::invalid_argument);
  s = cuda_test::attention_shape(4, 2, 64);  // one row needs 4 heads x 1 chunk x 66 floats
  EXPECT_THROW(cuda::attention(s, nullptr, kNoCache, kNoCache, 1, 0, nullptr, 0, 0, nullptr, nullptr, 263),
               std::invalid_argument);
}

}  // namespace
}  // namespace moraine
