// gpt-oss's attention options in every attention kernel the CUDA backend runs: a learned sink
// logit per head (AttentionShape::sinks: exp(sink - max) joins each softmax's denominator, no
// value row) and a sliding window (AttentionShape::window: the query at position p sees positions
// > p - window), against the exact attention in double of reference::attend_one_head_sink over the
// window's positions (common/reference/attention_block.cpp). Kernels: attention_prefill (tiled),
// attention (split-KV), attention_at (bit-identical to attention, also with these options) and
// attention_decode (flash decoding; a row's bits do not depend on the call that serves it).
// Tolerances: each kernel's own first-order bound, derived in its test file (attention_prefill_test,
// attention_test, attention_decode_test), with n_kv replaced by the positions the window leaves,
// plus, for the sink, 2u (|sink - m| + |max_j s_j - m|) + 8u, m = max(sink, max_j s_j): its exp and
// the running sum's rescale exp(max s - m) (expf's 2u and u of the argument each), the products, the
// add to the denominator and the division; all relative to sum_j p_j |v_jd| with the sink's share in
// the p's. Sinks are drawn wide (sd 3) so that some heads give the sink most of the mass.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_decode.h"
#include "kernels/cuda/attention_prefill.h"
#include "kernels/cuda/device_buffer.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

enum class Kernel { Prefill, Split, Decode };

struct Case {
  cuda::AttentionShape s;   // sinks set by the test; window as given
  int64_t n, n_past;
  bool sinks;
  uint32_t seed;
};

struct Inputs {
  std::vector<float> q, kc, vc, sinks;
};

Inputs make_inputs(const Case& c) {
  std::mt19937 rng(c.seed);
  cuda_test::PrefillInputs in = cuda_test::prefill_inputs(rng, c.s, c.n, c.n_past, false);
  Inputs r{in.q, in.kc, in.vc, {}};
  if (c.sinks) r.sinks = cuda_test::normal_values(rng, static_cast<size_t>(c.s.n_head), 3.0f);
  return r;
}

// The kernel's output for the case's rows (decode: rows in one call, r0 the first of them).
std::vector<float> run(Kernel kernel, const Case& c, const Inputs& in, int64_t r0, int64_t rows, bool at = false) {
  const cuda::AttentionShape& s0 = c.s;
  const int64_t qd = s0.n_head * s0.head_dim, max_ctx = c.n_past + c.n;
  cuda::DeviceBuffer<float> dq(static_cast<size_t>(rows * qd)), dk(in.kc.size()), dv(in.vc.size()),
      dsink(std::max<size_t>(in.sinks.size(), 1)), dout(static_cast<size_t>(rows * qd));
  dq.upload(in.q.data() + r0 * qd, static_cast<size_t>(rows * qd));
  dk.upload(in.kc.data(), in.kc.size());
  dv.upload(in.vc.data(), in.vc.size());
  if (!in.sinks.empty()) dsink.upload(in.sinks.data(), in.sinks.size());
  dout.fill_bytes(0xff);
  cuda::AttentionShape s = s0;
  s.sinks = in.sinks.empty() ? nullptr : dsink.get();
  const int32_t pos = static_cast<int32_t>(c.n_past);
  cuda::DeviceBuffer<int32_t> dpos(1);
  dpos.upload(&pos, 1);
  if (kernel == Kernel::Prefill) {
    cuda::attention_prefill(s, dq.get(), dk.get(), dv.get(), rows, c.n_past + r0, nullptr, 0, 0, dout.get());
  } else if (kernel == Kernel::Split) {
    const int64_t sf = at ? cuda::attention_at_scratch_floats(s, rows, max_ctx) : cuda::attention_scratch_floats(s, rows, max_ctx);
    cuda::DeviceBuffer<float> scratch(static_cast<size_t>(sf));
    scratch.fill_bytes(0xff);
    if (at) {
      const int32_t p = static_cast<int32_t>(c.n_past + r0);
      dpos.upload(&p, 1);
      cuda::attention_at(s, dq.get(), dk.get(), dv.get(), rows, dpos.get(), max_ctx, nullptr, 0, 0, dout.get(),
                         scratch.get(), sf);
    } else {
      cuda::attention(s, dq.get(), dk.get(), dv.get(), rows, c.n_past + r0, nullptr, 0, 0, dout.get(), scratch.get(), sf);
    }
    CUDA_CHECK(cudaDeviceSynchronize());
  } else {
    const int64_t sf = cuda::attention_decode_scratch_floats(s, rows, max_ctx);
    cuda::DeviceBuffer<float> scratch(static_cast<size_t>(sf));
    scratch.fill_bytes(0xff);
    cuda::attention_decode(s, dq.get(), dk.get(), dv.get(), rows, dpos.get(), r0, max_ctx, nullptr, 0, 0, dout.get(),
                           scratch.get(), sf);
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  std::vector<float> h(dout.size());
  dout.download(h.data(), h.size());
  return h;
}

void check(Kernel kernel, const Case& c) {
  const Inputs in = make_inputs(c);
  const cuda::AttentionShape& s = c.s;
  const int64_t hd = s.head_dim, group = s.n_head / s.n_head_kv;
  std::vector<float> got;
  if (kernel == Kernel::Decode) {   // in calls of up to 16 rows
    for (int64_t r0 = 0; r0 < c.n; r0 += cuda::kAttentionDecodeMaxRows) {
      const int64_t rows = std::min<int64_t>(cuda::kAttentionDecodeMaxRows, c.n - r0);
      const std::vector<float> part = run(kernel, c, in, r0, rows);
      got.insert(got.end(), part.begin(), part.end());
    }
  } else {
    got = run(kernel, c, in, 0, c.n);
  }
  const double u = std::ldexp(1.0, -24);
  for (int64_t t = 0; t < c.n; ++t) {
    for (int64_t h = 0; h < s.n_head; ++h) {
      const int64_t n_kv = c.n_past + t + 1, g = h / group;
      const int64_t lo = s.window > 0 ? std::max<int64_t>(0, n_kv - s.window) : 0, seen = n_kv - lo;
      const float* qh = in.q.data() + (t * s.n_head + h) * hd;
      std::vector<double> sc(static_cast<size_t>(seen));
      double smax = -INFINITY, max_ds = 0, max_s = 0;
      const double dot_terms = kernel == Kernel::Prefill ? double(hd) : kernel == Kernel::Split ? double(hd) / 32 + 5 : double(hd / 4 + 3);
      for (int64_t j = 0; j < seen; ++j) {
        double dot = 0, mag = 0;
        for (int64_t d = 0; d < hd; ++d) {
          const double p = double(qh[d]) * in.kc[(lo + j) * s.kv_stride + g * hd + d];
          dot += p;
          mag += std::fabs(p);
        }
        sc[j] = dot * s.scale;
        max_ds = std::max(max_ds, dot_terms * u * s.scale * mag + u * std::fabs(sc[j]));
        max_s = std::max(max_s, std::fabs(sc[j]));
        smax = std::max(smax, sc[j]);
      }
      const double mx = in.sinks.empty() ? smax : std::max(smax, double(in.sinks[h]));
      double sum = in.sinks.empty() ? 0.0 : std::exp(in.sinks[h] - mx);
      for (double& v : sc) sum += (v = std::exp(v - mx));
      double rel = 0;
      if (kernel == Kernel::Prefill) {
        const double tiles = double((seen + 15) / 16 + 1);   // the window's first tile may be partial
        const double e_p = 2 * max_ds + 4 * u * max_s + (2 + 3 * tiles) * u;
        rel = 2 * e_p + (double(seen) + 2 * tiles + 7) * u;
      } else if (kernel == Kernel::Split) {
        const int64_t chunks = (n_kv - 1) / cuda::kAttentionChunk - lo / cuda::kAttentionChunk + 1;
        rel = 2 * max_ds + 8 * u + double(std::min<int64_t>(n_kv, cuda::kAttentionChunk) + chunks + 8) * u;
      } else {
        const int64_t tiles = (seen + cuda::kDecodeTile - 1) / cuda::kDecodeTile;
        const int64_t splits = cuda::attention_decode_splits(seen), split_tiles = (tiles + splits - 1) / splits;
        rel = 2 * max_ds + double(8 + 2 * split_tiles + splits) * u +
              double(std::min(seen, split_tiles * cuda::kDecodeTile) + splits + 8) * u;
      }
      // The sink: exp(sink - m) and the running sum's rescale exp(smax - m) (m = max(smax, sink)), each
      // 2u for expf plus u of its argument's size, then the products, the add and the division.
      if (!in.sinks.empty()) rel += 2 * u * (std::fabs(in.sinks[h] - mx) + std::fabs(smax - mx)) + 8 * u;
      for (int64_t d = 0; d < hd; ++d) {
        double o = 0, mag = 0;
        for (int64_t j = 0; j < seen; ++j) {
          const double pv = sc[j] / sum * in.vc[(lo + j) * s.kv_stride + g * hd + d];
          o += pv;
          mag += std::fabs(pv);
        }
        const float gd = got[(t * s.n_head + h) * hd + d];
        ASSERT_LE(std::fabs(gd - o), rel * mag + 1e-30)
            << "kernel " << static_cast<int>(kernel) << " row " << t << " head " << h << " dim " << d << " (window "
            << s.window << ", " << seen << " positions): got " << gd << ", exact " << o;
      }
    }
  }
}

cuda::AttentionShape windowed(cuda::AttentionShape s, int64_t window) {
  s.window = window;
  return s;
}

// gpt-oss-20b's heads (64 of 64 dims over 8 kv heads, window 128) and gpt-oss-tiny's (8 of 32 over 2,
// window 8), for windows shorter and longer than what the rows see, with and without sinks.
TEST(CudaAttentionSinks, PrefillMatchesExactAttention) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const cuda::AttentionShape oss = cuda_test::attention_shape(64, 8, 64), tiny = cuda_test::attention_shape(8, 2, 32);
  check(Kernel::Prefill, {windowed(oss, 128), 200, 0, true, 1});     // the window slides inside the prefill
  check(Kernel::Prefill, {windowed(oss, 128), 70, 333, true, 2});    // after a cached past longer than the window
  check(Kernel::Prefill, {oss, 90, 40, true, 3});                    // sinks only (a full-attention layer)
  check(Kernel::Prefill, {windowed(tiny, 8), 75, 5, false, 4});      // window only
  check(Kernel::Prefill, {windowed(tiny, 8), 40, 20, true, 5});
}

TEST(CudaAttentionSinks, SplitKvMatchesExactAttention) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const cuda::AttentionShape oss = cuda_test::attention_shape(64, 8, 64), tiny = cuda_test::attention_shape(8, 2, 32);
  check(Kernel::Split, {windowed(oss, 128), 40, 600, true, 11});     // windows over chunk edges (256)
  check(Kernel::Split, {windowed(tiny, 8), 30, 250, true, 12});      // windows wholly inside one chunk, and across
  check(Kernel::Split, {oss, 20, 300, true, 13});
  check(Kernel::Split, {windowed(tiny, 300), 20, 500, false, 14});   // a window longer than one chunk
}

TEST(CudaAttentionSinks, DecodeMatchesExactAttention) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const cuda::AttentionShape oss = cuda_test::attention_shape(64, 8, 64);
  check(Kernel::Decode, {windowed(oss, 128), 16, 1000, true, 21});   // 4 tiles seen of 32 in the cache
  check(Kernel::Decode, {windowed(oss, 128), 20, 100, true, 22});    // the window fills up over the rows
  check(Kernel::Decode, {oss, 5, 4090, true, 23});                   // sinks only, 128 -> 129 tiles
  check(Kernel::Decode, {windowed(oss, 4000), 3, 4500, false, 24});  // a long window: 125 tiles in 32 splits
  check(Kernel::Decode, {windowed(cuda_test::attention_shape(12, 4, 128), 40), 4, 77, true, 25});   // odd group
}

// attention_at is the split-KV kernel read at a device position: the same bits with the options too;
// and a decode row's bits do not depend on the call that serves it (decode after prefill).
TEST(CudaAttentionSinks, RowBitsDoNotDependOnTheCall) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const Case split{windowed(cuda_test::attention_shape(8, 2, 32), 8), 12, 260, true, 31};
  const Inputs in = make_inputs(split);
  const std::vector<float> host = run(Kernel::Split, split, in, 0, split.n);
  const std::vector<float> dev = run(Kernel::Split, split, in, 0, split.n, true);
  ASSERT_EQ(std::memcmp(host.data(), dev.data(), host.size() * 4), 0) << "attention_at differs from attention";
  const Case dec{windowed(cuda_test::attention_shape(64, 8, 64), 128), 9, 700, true, 32};
  const Inputs din = make_inputs(dec);
  const std::vector<float> batch = run(Kernel::Decode, dec, din, 0, dec.n);
  const int64_t qd = 64 * 64;
  for (int64_t r = 0; r < dec.n; ++r) {
    const std::vector<float> one = run(Kernel::Decode, dec, din, r, 1);
    ASSERT_EQ(std::memcmp(one.data(), batch.data() + r * qd, qd * 4), 0) << "row " << r << " alone differs";
  }
}

}  // namespace
}  // namespace moraine
