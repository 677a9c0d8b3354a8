// Flash-decoding attention (kernels/cuda/attention_decode.h) against the exact softmax attention
// in double (the reference's formula), at positions around tile and split edges, for 1 to 16 rows,
// gated and not; a row gives the same bits whatever call serves it (the property decode after
// prefill relies on), also from a replayed CUDA graph at new device positions; a device position
// outside the capacity gives NaN rows.
// Tolerance, first order in u = 2^-24: a score (4 interleaved fma chains of head_dim / 4, their
// sum, the scaling) is off by at most
//   ds_j = (hd / 4 + 3) u scale sum_d |q_d k_jd| + u |s_j|
// which moves p_j relatively by up to 2 max_j ds_j; exp, the per-tile rescaling (one product per
// tile of 32 in a split) and the merge add (8 + 2 * tiles per split + splits) u; the weighted sum
// of values adds (positions per split + splits + 8) u of sum_j p_j |v_jd|.
// The half cache (the CUDA backend's F16 KV): K and V rounded to IEEE half on the host, the exact
// attention computed over those rounded values with the same tolerance (widening a half to float
// is exact, so the kernel's float arithmetic and its error are the float cache's), and bit for bit
// the float kernel's output on a float cache of the same values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/formats/block_layouts.h"
#include "common/formats/half_float.h"
#include "common/formats/quant.h"
#include "kernels/cpu/vec_dot.h"
#include "kernels/cuda/attention_decode.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/quantize_activations_llama.h"
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
  std::vector<uint16_t> k16, v16;   // f16: the cache's halves (k and v then hold their exact floats)
};

// f16: K and V rounded to half, k / v the rounded values.
Data make_data(const Case& c, bool f16 = false) {
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
  if (f16) {
    for (auto [from, to] : {std::pair{&d.k, &d.k16}, std::pair{&d.v, &d.v16}}) {
      to->resize(from->size());
      for (size_t i = 0; i < from->size(); ++i) {
        (*to)[i] = half::fp32_to_fp16((*from)[i]);
        (*from)[i] = half::fp16_to_fp32((*to)[i]);
      }
    }
  }
  return d;
}

// Output of attention_decode for rows [r0, r0 + n) of the case, served as one call; f16: over the
// half cache (d from make_data(c, true)).
std::vector<float> run(const Case& c, const Data& d, int64_t r0, int64_t n, int32_t pos, bool f16 = false) {
  const int64_t qd = c.s.n_head * c.s.head_dim;
  cuda::DeviceBuffer<float> q(static_cast<size_t>(n * qd)), k(f16 ? 0 : d.k.size()), v(f16 ? 0 : d.v.size()),
      g(d.gate.size()), out(static_cast<size_t>(n * qd));
  cuda::DeviceBuffer<__half> k16(f16 ? d.k16.size() : 0), v16(f16 ? d.v16.size() : 0);
  q.upload(d.q.data() + r0 * qd, static_cast<size_t>(n * qd));
  if (f16) {
    k16.upload(reinterpret_cast<const __half*>(d.k16.data()), d.k16.size());
    v16.upload(reinterpret_cast<const __half*>(d.v16.data()), d.v16.size());
  } else {
    k.upload(d.k.data(), d.k.size());
    v.upload(d.v.data(), d.v.size());
  }
  g.upload(d.gate.data(), d.gate.size());
  cuda::DeviceBuffer<int32_t> dpos(1);
  dpos.upload(&pos, 1);
  const int64_t sf = cuda::attention_decode_scratch_floats(c.s, n, c.max_ctx);
  cuda::DeviceBuffer<float> scratch(static_cast<size_t>(sf));
  out.fill_bytes(0xff);
  scratch.fill_bytes(0xff);
  const float* gate = c.gated ? g.get() + r0 * 2 * qd + c.s.head_dim : nullptr;
  if (f16)
    cuda::attention_decode(c.s, q.get(), k16.get(), v16.get(), n, dpos.get(), r0, c.max_ctx, gate, 2 * qd,
                           2 * c.s.head_dim, out.get(), scratch.get(), sf);
  else
    cuda::attention_decode(c.s, q.get(), k.get(), v.get(), n, dpos.get(), r0, c.max_ctx, gate, 2 * qd,
                           2 * c.s.head_dim, out.get(), scratch.get(), sf);
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> h(out.size());
  out.download(h.data(), h.size());
  return h;
}

void check_exact(const Case& c, bool f16 = false) {
  const Data d = make_data(c, f16);
  const cuda::AttentionShape& s = c.s;
  const int64_t hd = s.head_dim, group = s.n_head / s.n_head_kv, qd = s.n_head * hd;
  const double u = std::ldexp(1.0, -24);
  std::vector<double> want(static_cast<size_t>(c.n * qd)), tols(want.size());
  for (int64_t t = 0; t < c.n; ++t) {
    const int64_t n_kv = c.pos + t + 1;
    const int64_t tiles = (n_kv + cuda::kDecodeTile - 1) / cuda::kDecodeTile;
    const int64_t splits = cuda::attention_decode_splits(n_kv);
    const int64_t split_tiles = (tiles + splits - 1) / splits;
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
        max_ds = std::max(max_ds, double(hd / 4 + 3) * u * s.scale * mag + u * std::fabs(sc[j]));
      }
      double sum = 0;
      for (double& x : sc) sum += (x = std::exp(x - mx));
      const double rel = 2 * max_ds + double(8 + 2 * split_tiles + splits) * u +
                         double(std::min(n_kv, split_tiles * cuda::kDecodeTile) + splits + 8) * u;
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
        want[static_cast<size_t>(t * qd + h * hd + e)] = o;
        tols[static_cast<size_t>(t * qd + h * hd + e)] = tol;
      }
    }
  }
  const std::vector<float> got = run(c, d, 0, c.n, static_cast<int32_t>(c.pos), f16);
  for (size_t i = 0; i < got.size(); ++i) {
    const int64_t t = static_cast<int64_t>(i) / qd, h = static_cast<int64_t>(i) % qd / hd;
    ASSERT_LE(std::fabs(double(got[i]) - want[i]), tols[i] + 1e-30)
        << "pos " << c.pos << " row " << t << " head " << h << " dim " << i % hd << ": got " << got[i] << ", exact "
        << want[i] << ", tolerance " << tols[i];
  }
}

TEST(CudaAttentionDecode, MatchesExactAttention) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const cuda::AttentionShape qwen3 = cuda_test::attention_shape(32, 4, 128);
  check_exact({qwen3, 512, 1, 0, false, 1});       // the first token
  check_exact({qwen3, 512, 1, 31, false, 2});      // one full tile
  check_exact({qwen3, 512, 5, 30, false, 3});      // rows straddling a tile edge (1 and 2 splits)
  check_exact({qwen3, 2048, 16, 1010, false, 4});  // 32 tiles in 32 splits, then 33 (one split of 2 tiles)
  check_exact({qwen3, 8192, 16, 4088, false, 5});  // 128 tiles in 32 splits, then 129 in 64
  check_exact({cuda_test::attention_shape(16, 2, 256), 6144, 3, 5000, true, 6});  // gated heads of 256, 157 tiles
  check_exact({cuda_test::attention_shape(4, 4, 64), 256, 2, 40, false, 7});       // no grouping
  check_exact({cuda_test::attention_shape(12, 4, 128), 512, 2, 100, true, 8});     // odd group: one head per warp
  check_exact({cuda_test::attention_shape(32, 1, 128), 512, 2, 200, false, 9});    // 32 query heads per kv head
}

// The half cache: fresh values (other seeds), rounded to half; the same cases' edges.
TEST(CudaAttentionDecodeF16, MatchesExactAttentionOnTheHalfValues) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const cuda::AttentionShape qwen3 = cuda_test::attention_shape(32, 4, 128);
  check_exact({qwen3, 512, 1, 0, false, 101}, true);
  check_exact({qwen3, 512, 5, 30, false, 103}, true);
  check_exact({qwen3, 2048, 16, 1010, false, 104}, true);
  check_exact({qwen3, 8192, 16, 4088, false, 105}, true);
  check_exact({cuda_test::attention_shape(16, 2, 256), 6144, 3, 5000, true, 106}, true);
  check_exact({cuda_test::attention_shape(4, 4, 64), 256, 2, 40, false, 107}, true);
  check_exact({cuda_test::attention_shape(12, 4, 128), 512, 2, 100, true, 108}, true);
  check_exact({cuda_test::attention_shape(32, 1, 128), 512, 2, 200, false, 109}, true);
}

// Only the element type of the cache differs: the float kernel on the same (half-rounded) values
// gives the very same bits, at 1, 32 and 64 splits, for each head size.
TEST(CudaAttentionDecodeF16, BitIdenticalToTheFloatCacheOfTheSameValues) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  for (const Case& c : {Case{cuda_test::attention_shape(32, 4, 128), 8192, 16, 5000, true, 111},
                        Case{cuda_test::attention_shape(32, 4, 128), 2048, 3, 20, false, 112},
                        Case{cuda_test::attention_shape(16, 2, 256), 4096, 2, 3000, true, 113},
                        Case{cuda_test::attention_shape(8, 8, 64), 1024, 4, 900, false, 114}}) {
    const Data d = make_data(c, true);
    const std::vector<float> half_cache = run(c, d, 0, c.n, static_cast<int32_t>(c.pos), true);
    const std::vector<float> float_cache = run(c, d, 0, c.n, static_cast<int32_t>(c.pos), false);
    ASSERT_EQ(std::memcmp(half_cache.data(), float_cache.data(), half_cache.size() * 4), 0)
        << "head_dim " << c.s.head_dim << " at position " << c.pos;
  }
}

// The property decode after prefill relies on: the bits of a row do not depend on the call (rows
// 4093 .. 4101 see 128 tiles in 32 splits, then 129 tiles in 64 splits).
TEST(CudaAttentionDecode, RowBitsDoNotDependOnTheCall) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const Case c{cuda_test::attention_shape(32, 4, 128), 8192, 9, 4093, true, 10};
  const Data d = make_data(c);
  const int64_t qd = c.s.n_head * c.s.head_dim;
  const std::vector<float> all = run(c, d, 0, c.n, static_cast<int32_t>(c.pos));
  for (int64_t r = 0; r < c.n; ++r) {
    const std::vector<float> one = run(c, d, r, 1, static_cast<int32_t>(c.pos));
    ASSERT_EQ(std::memcmp(one.data(), all.data() + r * qd, static_cast<size_t>(qd) * 4), 0) << "row " << r;
  }
}

// A captured graph reads the position from device memory at every replay and gives the bits of a
// direct call (the same replay twice too: nothing a call leaves behind changes the next).
TEST(CudaAttentionDecode, GraphReplayMatchesDirectCalls) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const Case c{cuda_test::attention_shape(32, 4, 128), 8192, 4, 0, true, 11};
  const Data d = make_data(c);
  const int64_t qd = c.s.n_head * c.s.head_dim;
  cuda::DeviceBuffer<float> q(static_cast<size_t>(c.n * qd)), k(d.k.size()), v(d.v.size()), g(d.gate.size()),
      out(static_cast<size_t>(c.n * qd));
  q.upload(d.q.data(), q.size());
  k.upload(d.k.data(), d.k.size());
  v.upload(d.v.data(), d.v.size());
  g.upload(d.gate.data(), d.gate.size());
  cuda::DeviceBuffer<int32_t> dpos(1);
  const int64_t sf = cuda::attention_decode_scratch_floats(c.s, c.n, c.max_ctx);
  cuda::DeviceBuffer<float> scratch(static_cast<size_t>(sf));
  scratch.fill_bytes(0xff);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  (void)run(c, d, 0, c.n, 0);   // one direct call first: one-time setup happens outside the capture
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  cuda::attention_decode(c.s, q.get(), k.get(), v.get(), c.n, dpos.get(), 0, c.max_ctx, g.get() + c.s.head_dim, 2 * qd,
                         2 * c.s.head_dim, out.get(), scratch.get(), sf, stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int32_t pos : {5, 2046, 5000, 2046}) {   // 1, 32 and 64 splits
    dpos.upload(&pos, 1);
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<float> replayed(out.size());
    out.download(replayed.data(), replayed.size());
    const std::vector<float> direct = run(c, d, 0, c.n, pos);
    ASSERT_EQ(std::memcmp(replayed.data(), direct.data(), direct.size() * 4), 0) << "position " << pos;
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// attention_decode_quantized: the same floats as attention_decode (memcmp), and its q8_0 rows
// byte for byte those of quantize_activations_llama on them and of the CPU reference's quantizer
// (llama.cpp's x86 rule, cpu::quantize_activation_row_llama_x86): head_dim 64 / 128 / 256,
// float and half caches, gated and not, 1 to 16 rows; outputs poisoned before the call.
TEST(CudaAttentionDecodeQuantized, BytesOfAttentionThenQuantize) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const std::vector<Case> cases = {
      {cuda_test::attention_shape(32, 4, 128), 1024, 1, 599, false, 31},
      {cuda_test::attention_shape(32, 4, 128), 1024, 3, 40, true, 32},
      {cuda_test::attention_shape(16, 2, 64), 4096, 16, 2100, false, 33},
      {cuda_test::attention_shape(8, 2, 256), 512, 2, 7, true, 34},
  };
  for (const Case& c : cases) {
    for (bool f16 : {false, true}) {
      SCOPED_TRACE("head_dim " + std::to_string(c.s.head_dim) + ", " + std::to_string(c.n) + " rows at " +
                   std::to_string(c.pos) + (c.gated ? ", gated" : "") + (f16 ? ", f16 cache" : ""));
      const Data d = make_data(c, f16);
      const int64_t qd = c.s.n_head * c.s.head_dim;
      const size_t act_row = row_bytes(TensorType::Q8_0, qd);
      cuda::DeviceBuffer<float> q(static_cast<size_t>(c.n * qd)), k(d.k.size()), v(d.v.size()), g(d.gate.size()),
          out(static_cast<size_t>(c.n * qd));
      cuda::DeviceBuffer<__half> k16(f16 ? d.k16.size() : 0), v16(f16 ? d.v16.size() : 0);
      q.upload(d.q.data(), q.size());
      k.upload(d.k.data(), d.k.size());
      v.upload(d.v.data(), d.v.size());
      if (f16) {
        k16.upload(reinterpret_cast<const __half*>(d.k16.data()), d.k16.size());
        v16.upload(reinterpret_cast<const __half*>(d.v16.data()), d.v16.size());
      }
      g.upload(d.gate.data(), d.gate.size());
      cuda::DeviceBuffer<int32_t> dpos(1);
      const int32_t pos = static_cast<int32_t>(c.pos);
      dpos.upload(&pos, 1);
      const int64_t sf = cuda::attention_decode_scratch_floats(c.s, c.n, c.max_ctx);
      cuda::DeviceBuffer<float> scratch(static_cast<size_t>(sf));
      cuda::DeviceBuffer<uint8_t> act(act_row * static_cast<size_t>(c.n)), act_want(act.size());
      out.fill_bytes(0xff);
      act.fill_bytes(0x5a);
      scratch.fill_bytes(0xff);
      const float* gate = c.gated ? g.get() + c.s.head_dim : nullptr;
      if (f16)
        cuda::attention_decode_quantized(c.s, q.get(), k16.get(), v16.get(), c.n, dpos.get(), 0, c.max_ctx, gate,
                                         2 * qd, 2 * c.s.head_dim, out.get(), act.get(), scratch.get(), sf);
      else
        cuda::attention_decode_quantized(c.s, q.get(), k.get(), v.get(), c.n, dpos.get(), 0, c.max_ctx, gate, 2 * qd,
                                         2 * c.s.head_dim, out.get(), act.get(), scratch.get(), sf);
      CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<float> got(out.size());
      out.download(got.data(), got.size());
      const std::vector<float> plain = run(c, d, 0, c.n, pos, f16);
      ASSERT_EQ(std::memcmp(got.data(), plain.data(), plain.size() * 4), 0) << "floats differ from attention_decode";
      cuda::quantize_activations_llama(TensorType::Q8_0, out.get(), act_want.get(), qd, c.n);
      CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<uint8_t> got_q(act.size()), want_q(act.size()), ref_q(act.size());
      act.download(got_q.data(), got_q.size());
      act_want.download(want_q.data(), want_q.size());
      for (int64_t t = 0; t < c.n; ++t)
        cpu::quantize_activation_row_llama_x86(TensorType::Q8_0, plain.data() + t * qd, ref_q.data() + t * act_row, qd);
      for (size_t i = 0; i < got_q.size(); ++i) {
        const size_t block = i / sizeof(BlockQ8_0);
        ASSERT_EQ(got_q[i], ref_q[i]) << "byte " << i << " (row " << block / (qd / 32) << ", block "
                                      << block % (qd / 32) << ") differs from the CPU reference's quantizer";
        ASSERT_EQ(got_q[i], want_q[i]) << "byte " << i << " differs from quantize_activations_llama";
      }
    }
  }
}

// attention_decode_fused_qk against qk_norm_rope_store then attention_decode_quantized (and
// attention_decode without the q8_0 rows), byte for byte: the output, its q8_0 rows and the
// whole K and V caches (filled with the same random values first, so a store to a wrong place
// shows); float and half caches, gated q (q head stride 2 head_dim), partial rotation, head_dim
// 64 / 128 / 256, positions at tile and split edges (1, 19, 32 and 64 splits), and a position
// outside the capacity (NaN rows, caches untouched); then the same from a graph replayed at new
// positions. Outputs poisoned before each call.
struct FusedQkCase {
  cuda::AttentionShape s;
  int64_t n_rot, max_ctx;
  bool gated, f16;
};

struct FusedQkRun {
  std::vector<float> out;
  std::vector<uint8_t> act, k, v;   // the caches' bytes
};

struct FusedQkData {
  FusedQkCase c;
  int64_t qd, kv_dim, q_head_stride, row;   // row: the q | k | v projection row's floats
  cuda::DeviceBuffer<float> proj, qn, kn, q_out, out, scratch, kc, vc;
  cuda::DeviceBuffer<__half> kc16, vc16;
  cuda::DeviceBuffer<uint8_t> act;
  cuda::DeviceBuffer<int32_t> pos;
  std::vector<float> k_init, v_init;
  std::vector<uint16_t> k16_init, v16_init;
  int64_t sf;
  FusedQkData(const FusedQkCase& cs, uint32_t seed) : c(cs) {
    std::mt19937 rng(seed);
    qd = c.s.n_head * c.s.head_dim;
    kv_dim = c.s.n_head_kv * c.s.head_dim;
    q_head_stride = c.gated ? 2 * c.s.head_dim : c.s.head_dim;
    row = c.s.n_head * q_head_stride + 2 * kv_dim;
    proj = cuda::uploaded(cuda_test::random_values(rng, static_cast<size_t>(row)));
    qn = cuda::uploaded(cuda_test::normal_values(rng, static_cast<size_t>(c.s.head_dim), 1.0f));
    kn = cuda::uploaded(cuda_test::normal_values(rng, static_cast<size_t>(c.s.head_dim), 1.0f));
    q_out = cuda::DeviceBuffer<float>(static_cast<size_t>(qd));
    out = cuda::DeviceBuffer<float>(static_cast<size_t>(qd));
    act = cuda::DeviceBuffer<uint8_t>(row_bytes(TensorType::Q8_0, qd));
    sf = cuda::attention_decode_scratch_floats(c.s, 1, c.max_ctx);
    scratch = cuda::DeviceBuffer<float>(static_cast<size_t>(sf));
    pos = cuda::DeviceBuffer<int32_t>(1);
    k_init = cuda_test::normal_values(rng, static_cast<size_t>(c.max_ctx * kv_dim), 1.0f);
    v_init = cuda_test::normal_values(rng, k_init.size(), 1.0f);
    if (c.f16) {
      for (auto [from, to] : {std::pair{&k_init, &k16_init}, std::pair{&v_init, &v16_init}}) {
        to->resize(from->size());
        for (size_t i = 0; i < from->size(); ++i) (*to)[i] = half::fp32_to_fp16((*from)[i]);
      }
      kc16 = cuda::DeviceBuffer<__half>(k16_init.size());
      vc16 = cuda::DeviceBuffer<__half>(v16_init.size());
    } else {
      kc = cuda::DeviceBuffer<float>(k_init.size());
      vc = cuda::DeviceBuffer<float>(v_init.size());
    }
  }
  void reset(int32_t p) {
    pos.upload(&p, 1);
    if (c.f16) {
      kc16.upload(reinterpret_cast<const __half*>(k16_init.data()), k16_init.size());
      vc16.upload(reinterpret_cast<const __half*>(v16_init.data()), v16_init.size());
    } else {
      kc.upload(k_init.data(), k_init.size());
      vc.upload(v_init.data(), v_init.size());
    }
    out.fill_bytes(0xff);
    act.fill_bytes(0x5a);
    q_out.fill_bytes(0xff);
    scratch.fill_bytes(0xff);
  }
  cuda::QkNormRopeStoreArgs args() const {
    cuda::QkNormRopeStoreArgs a;
    a.q = proj.get();
    a.q_row_stride = row;
    a.q_head_stride = q_head_stride;
    a.k = proj.get() + c.s.n_head * q_head_stride;
    a.k_row_stride = row;
    a.v = a.k + kv_dim;
    a.v_row_stride = row;
    a.q_norm = qn.get();
    a.k_norm = kn.get();
    a.rows = 1;
    a.n_head = c.s.n_head;
    a.n_head_kv = c.s.n_head_kv;
    a.head_dim = c.s.head_dim;
    a.n_rot = c.n_rot;
    a.pos0_dev = pos.get();
    a.freq_base = 1e6;
    a.eps = 1e-6f;
    a.max_pos = c.max_ctx;
    a.q_out = const_cast<float*>(q_out.get());
    if (c.f16) {
      a.k_cache_f16 = const_cast<__half*>(kc16.get());
      a.v_cache_f16 = const_cast<__half*>(vc16.get());
    } else {
      a.k_cache = const_cast<float*>(kc.get());
      a.v_cache = const_cast<float*>(vc.get());
    }
    return a;
  }
  const float* gate() const { return c.gated ? proj.get() + c.s.head_dim : nullptr; }
  void enqueue(bool fused, bool quantize, cudaStream_t stream) {
    const cuda::QkNormRopeStoreArgs a = args();
    void* act_out = quantize ? act.get() : nullptr;
    if (fused) {
      cuda::attention_decode_fused_qk(a, c.s, gate(), row, q_head_stride, out.get(), act_out, scratch.get(), sf, stream);
      return;
    }
    cuda::qk_norm_rope_store(a, stream);
    auto attend = [&](const auto* k, const auto* v) {
      if (quantize)
        cuda::attention_decode_quantized(c.s, q_out.get(), k, v, 1, pos.get(), 0, c.max_ctx, gate(), row, q_head_stride,
                                         out.get(), act_out, scratch.get(), sf, stream);
      else
        cuda::attention_decode(c.s, q_out.get(), k, v, 1, pos.get(), 0, c.max_ctx, gate(), row, q_head_stride,
                               out.get(), scratch.get(), sf, stream);
    };
    if (c.f16) attend(kc16.get(), vc16.get());
    else attend(kc.get(), vc.get());
  }
  FusedQkRun result() {
    CUDA_CHECK(cudaDeviceSynchronize());
    FusedQkRun r;
    r.out.resize(out.size());
    out.download(r.out.data(), r.out.size());
    r.act.resize(act.size());
    act.download(r.act.data(), r.act.size());
    const size_t cache_bytes = k_init.size() * (c.f16 ? 2 : 4);
    r.k.resize(cache_bytes);
    r.v.resize(cache_bytes);
    if (c.f16) {
      kc16.download(reinterpret_cast<__half*>(r.k.data()), k_init.size());
      vc16.download(reinterpret_cast<__half*>(r.v.data()), v_init.size());
    } else {
      kc.download(reinterpret_cast<float*>(r.k.data()), k_init.size());
      vc.download(reinterpret_cast<float*>(r.v.data()), v_init.size());
    }
    return r;
  }
  FusedQkRun run(int32_t p, bool fused, bool quantize) {
    reset(p);
    enqueue(fused, quantize, nullptr);
    return result();
  }
};

void expect_same_run(const FusedQkRun& got, const FusedQkRun& want, const std::string& what) {
  ASSERT_EQ(std::memcmp(got.out.data(), want.out.data(), want.out.size() * 4), 0) << what << ": output";
  ASSERT_EQ(got.act, want.act) << what << ": q8_0 rows";
  ASSERT_EQ(got.k, want.k) << what << ": K cache";
  ASSERT_EQ(got.v, want.v) << what << ": V cache";
}

TEST(CudaAttentionDecodeFusedQk, BytesOfQkNormRopeStoreThenAttention) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const std::vector<FusedQkCase> cases = {
      {cuda_test::attention_shape(32, 4, 128), 128, 8192, false, false},   // Qwen3-30B-A3B
      {cuda_test::attention_shape(32, 4, 128), 128, 8192, false, true},    // its F16 cache
      {cuda_test::attention_shape(16, 2, 256), 64, 1024, true, false},     // gated, partial rotation (Qwen3-Next)
      {cuda_test::attention_shape(16, 2, 256), 64, 1024, true, true},
      {cuda_test::attention_shape(12, 4, 64), 64, 1024, false, false},     // odd group of 3
  };
  uint32_t seed = 51;
  for (const FusedQkCase& c : cases) {
    FusedQkData d(c, seed++);
    for (int32_t p : {0, 31, 32, 599, 1023, 2046, 5000, 8191}) {
      if (p >= c.max_ctx) continue;
      for (bool quantize : {true, false}) {
        const std::string what = "head_dim " + std::to_string(c.s.head_dim) + (c.f16 ? " f16" : " f32") +
                                 (c.gated ? " gated" : "") + " position " + std::to_string(p) +
                                 (quantize ? " quantized" : "");
        const FusedQkRun want = d.run(p, false, quantize);
        expect_same_run(d.run(p, true, quantize), want, what);
      }
    }
    // Outside the capacity: NaN rows and the caches as they were, as unfused.
    for (int32_t p : {-1, static_cast<int32_t>(c.max_ctx)}) {
      const FusedQkRun got = d.run(p, true, true), want = d.run(p, false, true);
      for (float x : got.out) ASSERT_TRUE(std::isnan(x)) << "position " << p;
      ASSERT_EQ(got.k, want.k) << "position " << p << ": K cache";
      ASSERT_EQ(got.v, want.v) << "position " << p << ": V cache";
    }
  }
}

TEST(CudaAttentionDecodeFusedQk, GraphReplayAtNewPositions) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  FusedQkData d({cuda_test::attention_shape(32, 4, 128), 128, 8192, false, false}, 71);
  (void)d.run(3, true, true);   // one direct call first: one-time setup happens outside the capture
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  d.enqueue(true, true, stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int32_t p : {5, 600, 4100, 600}) {
    const FusedQkRun want = d.run(p, false, true);
    d.reset(p);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    expect_same_run(d.result(), want, "replay at position " + std::to_string(p));
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(CudaAttentionDecodeFusedQkArguments, RejectsBadCalls) {
  cuda::QkNormRopeStoreArgs a;
  a.rows = 2;
  a.n_head = 32;
  a.n_head_kv = 4;
  a.head_dim = a.n_rot = 128;
  a.q_head_stride = 128;
  a.k_row_stride = a.v_row_stride = 512;
  a.max_pos = 16;
  const cuda::AttentionShape s = cuda_test::attention_shape(32, 4, 128);
  EXPECT_FALSE(cuda::attention_decode_fused_qk_supported(a, s));   // two rows
  a.rows = 1;
  EXPECT_TRUE(cuda::attention_decode_fused_qk_supported(a, s));
  a.n_rot = 127;
  EXPECT_FALSE(cuda::attention_decode_fused_qk_supported(a, s));
  a.n_rot = 128;
  EXPECT_FALSE(cuda::attention_decode_fused_qk_supported(a, cuda_test::attention_shape(32, 8, 128)));
  float* p = nullptr;
  EXPECT_THROW(cuda::attention_decode_fused_qk(a, s, nullptr, 0, 0, p, nullptr, p, 1 << 20), std::invalid_argument);
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
  float* odd_q = reinterpret_cast<float*>(uintptr_t{4});   // float4 loads need 16-byte alignment
  EXPECT_THROW(cuda::attention_decode(cuda_test::attention_shape(32, 4, 128), odd_q, p, p, 1, nullptr, 0, 16, nullptr, 0, 0, p, p, 1 << 20),
               std::invalid_argument);
}

}  // namespace
}  // namespace moraine
