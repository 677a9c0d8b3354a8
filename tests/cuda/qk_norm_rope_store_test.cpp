// qk_norm_rope_store (kernels/cuda/qk_norm_rope_store.h) against the unfused sequence the CUDA
// backend's attention block runs (head_rms_norm q, rope_neox_at q, head_rms_norm k, rope_neox_at
// k, kv_store_at k, kv_store_at v), byte for byte (memcmp of the packed q and of both whole
// caches, which start from random contents), on fresh random inputs: head_dim 64/128/256, partial
// rotary, q with and without a gate beside each head, 1/3/16 rows, positions 0 and mid-cache,
// separate q/k/v buffers and one concatenated qkv matvec output; positions outside the cache; and
// one captured graph replayed at several device positions. A half cache (k_cache_f16 / v_cache_f16:
// the CUDA backend's F16 KV) gets exactly the float cache's values rounded to nearest even, q the
// same bits.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/formats/half_float.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/head_rms_norm.h"
#include "kernels/cuda/kv_store.h"
#include "kernels/cuda/qk_norm_rope_store.h"
#include "kernels/cuda/rope.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

struct Case {
  int64_t n_head, n_head_kv, hd, n_rot;
  bool gate;    // q carries a gate beside each head (q head stride 2 * hd)
  bool concat;  // q, k, v are one matvec output [rows][q_rows + 2 kv_dim]
  int64_t rows;
  int32_t pos;
  double base = 1e6;
  int64_t max_pos = 600;
  std::string name() const {
    return std::to_string(n_head) + "/" + std::to_string(n_head_kv) + " heads x" + std::to_string(hd) + " n_rot " +
           std::to_string(n_rot) + (gate ? " gated" : "") + (concat ? " concatenated qkv" : " separate q/k/v") +
           " rows " + std::to_string(rows) + " pos " + std::to_string(pos);
  }
};

struct Outputs {
  std::vector<float> q, k_cache, v_cache;
};

// Inputs on the device, as the backend holds them.
struct Inputs {
  Case c;
  int64_t q_rows, q_head_stride, kv_dim;
  cuda::DeviceBuffer<float> qkv, q, k, v, q_norm, k_norm;
  std::vector<float> cache0;
  cuda::DeviceBuffer<int32_t> pos;

  Inputs(const Case& cs, uint32_t seed) : c(cs) {
    std::mt19937 rng(seed);
    q_head_stride = c.gate ? 2 * c.hd : c.hd;
    q_rows = c.n_head * q_head_stride;
    kv_dim = c.n_head_kv * c.hd;
    const auto up = [&](cuda::DeviceBuffer<float>& b, size_t n) {
      const std::vector<float> h = cuda_test::random_values(rng, n);
      b = cuda::DeviceBuffer<float>(n);
      b.upload(h.data(), n);
    };
    if (c.concat) {
      up(qkv, static_cast<size_t>(c.rows * (q_rows + 2 * kv_dim)));
    } else {
      up(q, static_cast<size_t>(c.rows * q_rows));
      up(k, static_cast<size_t>(c.rows * kv_dim));
      up(v, static_cast<size_t>(c.rows * kv_dim));
    }
    up(q_norm, static_cast<size_t>(c.hd));
    up(k_norm, static_cast<size_t>(c.hd));
    cache0 = cuda_test::random_values(rng, static_cast<size_t>(c.max_pos * kv_dim));
    pos = cuda::DeviceBuffer<int32_t>(1);
    pos.upload(&c.pos, 1);
  }
  int64_t row_stride() const { return c.concat ? q_rows + 2 * kv_dim : 0; }
  const float* q_in() const { return c.concat ? qkv.get() : q.get(); }
  const float* k_in() const { return c.concat ? qkv.get() + q_rows : k.get(); }
  const float* v_in() const { return c.concat ? qkv.get() + q_rows + kv_dim : v.get(); }
  int64_t q_stride() const { return c.concat ? row_stride() : q_rows; }
  int64_t kv_stride() const { return c.concat ? row_stride() : kv_dim; }

  cuda::QkNormRopeStoreArgs args(float* q_out, float* kc, float* vc) const {
    cuda::QkNormRopeStoreArgs a;
    a.q = q_in();
    a.q_row_stride = q_stride();
    a.q_head_stride = q_head_stride;
    a.k = k_in();
    a.k_row_stride = kv_stride();
    a.v = v_in();
    a.v_row_stride = kv_stride();
    a.q_norm = q_norm.get();
    a.k_norm = k_norm.get();
    a.rows = c.rows;
    a.n_head = c.n_head;
    a.n_head_kv = c.n_head_kv;
    a.head_dim = c.hd;
    a.n_rot = c.n_rot;
    a.pos0_dev = pos.get();
    a.freq_base = c.base;
    a.eps = 1e-6f;
    a.max_pos = c.max_pos;
    a.q_out = q_out;
    a.k_cache = kc;
    a.v_cache = vc;
    return a;
  }
};

Outputs download(const cuda::DeviceBuffer<float>& q, const cuda::DeviceBuffer<float>& kc,
                 const cuda::DeviceBuffer<float>& vc) {
  Outputs o{std::vector<float>(q.size()), std::vector<float>(kc.size()), std::vector<float>(vc.size())};
  q.download(o.q.data(), o.q.size());
  kc.download(o.k_cache.data(), o.k_cache.size());
  vc.download(o.v_cache.data(), o.v_cache.size());
  return o;
}

// The backend's unfused sequence (gpu_worker/cuda_backend.cu attention_block). k is normalised
// into packed scratch first (head_rms_norm's packed output), v of a concatenated output is packed
// with a strided copy: kv_store_at takes packed rows.
Outputs unfused(const Inputs& in) {
  const Case& c = in.c;
  cuda::DeviceBuffer<float> q(static_cast<size_t>(c.rows * c.n_head * c.hd)), k(static_cast<size_t>(c.rows * in.kv_dim)),
      v(static_cast<size_t>(c.rows * in.kv_dim)), kc(in.cache0.size()), vc(in.cache0.size());
  q.fill_bytes(0xff);
  kc.upload(in.cache0.data(), in.cache0.size());
  vc.upload(in.cache0.data(), in.cache0.size());
  const float eps = 1e-6f;
  cuda::head_rms_norm(in.q_in(), in.q_stride(), in.q_head_stride, in.q_norm.get(), q.get(), c.rows, c.n_head, c.hd, eps);
  cuda::rope_neox_at(q.get(), c.rows, c.n_head, c.n_head * c.hd, c.hd, c.n_rot, in.pos.get(), c.base);
  cuda::head_rms_norm(in.k_in(), in.kv_stride(), c.hd, in.k_norm.get(), k.get(), c.rows, c.n_head_kv, c.hd, eps);
  cuda::rope_neox_at(k.get(), c.rows, c.n_head_kv, in.kv_dim, c.hd, c.n_rot, in.pos.get(), c.base);
  CUDA_CHECK(cudaMemcpy2D(v.get(), in.kv_dim * 4, in.v_in(), in.kv_stride() * 4, in.kv_dim * 4, c.rows,
                          cudaMemcpyDeviceToDevice));
  cuda::kv_store_at(k.get(), kc.get(), c.rows, in.kv_dim, in.pos.get(), c.max_pos);
  cuda::kv_store_at(v.get(), vc.get(), c.rows, in.kv_dim, in.pos.get(), c.max_pos);
  return download(q, kc, vc);
}

Outputs fused(const Inputs& in, cudaStream_t stream = nullptr) {
  const Case& c = in.c;
  cuda::DeviceBuffer<float> q(static_cast<size_t>(c.rows * c.n_head * c.hd)), kc(in.cache0.size()), vc(in.cache0.size());
  q.fill_bytes(0xff);
  kc.upload(in.cache0.data(), in.cache0.size());
  vc.upload(in.cache0.data(), in.cache0.size());
  cuda::qk_norm_rope_store(in.args(q.get(), kc.get(), vc.get()), stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return download(q, kc, vc);
}

// The kernel into a half cache whose initial contents are cache0 as halves (cache0 must hold half
// values). Returns q and both caches widened back to float.
Outputs fused_f16(const Inputs& in) {
  const Case& c = in.c;
  std::vector<uint16_t> h0(in.cache0.size());
  for (size_t i = 0; i < h0.size(); ++i) h0[i] = half::fp32_to_fp16(in.cache0[i]);
  cuda::DeviceBuffer<float> q(static_cast<size_t>(c.rows * c.n_head * c.hd));
  cuda::DeviceBuffer<__half> kc(h0.size()), vc(h0.size());
  q.fill_bytes(0xff);
  kc.upload(reinterpret_cast<const __half*>(h0.data()), h0.size());
  vc.upload(reinterpret_cast<const __half*>(h0.data()), h0.size());
  cuda::QkNormRopeStoreArgs a = in.args(q.get(), nullptr, nullptr);
  a.k_cache_f16 = kc.get();
  a.v_cache_f16 = vc.get();
  cuda::qk_norm_rope_store(a);
  CUDA_CHECK(cudaDeviceSynchronize());
  Outputs o{std::vector<float>(q.size()), std::vector<float>(h0.size()), std::vector<float>(h0.size())};
  q.download(o.q.data(), o.q.size());
  for (auto [from, to] : {std::pair{&kc, &o.k_cache}, std::pair{&vc, &o.v_cache}}) {
    std::vector<uint16_t> h(h0.size());
    from->download(reinterpret_cast<__half*>(h.data()), h.size());
    for (size_t i = 0; i < h.size(); ++i) (*to)[i] = half::fp16_to_fp32(h[i]);
  }
  return o;
}

void expect_same(const Outputs& got, const Outputs& want, const std::string& what) {
  for (size_t i = 0; i < want.q.size(); ++i)
    ASSERT_EQ(std::memcmp(&got.q[i], &want.q[i], 4), 0)
        << what << ": q float " << i << ": fused " << got.q[i] << ", unfused " << want.q[i];
  for (size_t i = 0; i < want.k_cache.size(); ++i)
    ASSERT_EQ(std::memcmp(&got.k_cache[i], &want.k_cache[i], 4), 0)
        << what << ": k cache float " << i << ": fused " << got.k_cache[i] << ", unfused " << want.k_cache[i];
  ASSERT_EQ(std::memcmp(got.v_cache.data(), want.v_cache.data(), want.v_cache.size() * 4), 0) << what << ": v cache";
}

TEST(CudaQkNormRopeStore, BitIdenticalToUnfusedSequence) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  uint32_t seed = 1;
  std::vector<Case> cases;
  for (int64_t rows : {1, 3, 16})
    for (int32_t pos : {0, 517}) {
      cases.push_back({32, 4, 128, 128, false, false, rows, pos});  // Qwen3-30B-A3B
      cases.push_back({32, 4, 128, 128, false, true, rows, pos});   // one qkv matvec output
      cases.push_back({16, 2, 256, 64, true, false, rows, pos});    // Qwen3-Next: gate, rotary 1/4
      cases.push_back({16, 2, 256, 64, true, true, rows, pos});
      cases.push_back({8, 8, 64, 64, false, false, rows, pos});     // no GQA, head_dim 64
      cases.push_back({12, 3, 64, 32, true, true, rows, pos});
    }
  cases.push_back({6, 2, 40, 24, false, false, 5, 33, 1e4});  // head_dim not a multiple of 32
  cases.push_back({4, 1, 128, 96, true, true, 7, 593});       // the last positions of the cache
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name());
    const Inputs in(c, seed++);
    expect_same(fused(in), unfused(in), c.name());
  }
}

// The half cache: q bit for bit the float run's, each cache element the float run's rounded to
// nearest even (the caches start from random half values; unwritten positions keep them).
TEST(CudaQkNormRopeStoreF16, HalfCacheHoldsTheFloatValuesRounded) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  uint32_t seed = 200;
  for (const Case& c : {Case{32, 4, 128, 128, false, true, 1, 517}, Case{32, 4, 128, 128, false, false, 16, 0},
                        Case{16, 2, 256, 64, true, true, 3, 300}, Case{6, 2, 40, 24, false, false, 5, 33, 1e4},
                        Case{6, 3, 16, 16, false, true, 7, 100}, Case{4, 1, 128, 96, true, true, 7, 593}}) {
    SCOPED_TRACE(c.name());
    Inputs in(c, seed++);
    for (float& x : in.cache0) x = half::fp16_to_fp32(half::fp32_to_fp16(x));
    const Outputs want = fused(in), got = fused_f16(in);
    ASSERT_EQ(std::memcmp(got.q.data(), want.q.data(), want.q.size() * 4), 0) << "q";
    int64_t written = 0;
    for (auto [g, w] : {std::pair{&got.k_cache, &want.k_cache}, std::pair{&got.v_cache, &want.v_cache}}) {
      for (size_t i = 0; i < w->size(); ++i) {
        const float rounded = half::fp16_to_fp32(half::fp32_to_fp16((*w)[i]));
        ASSERT_EQ(std::memcmp(&(*g)[i], &rounded, 4), 0) << "cache element " << i << ": half cache " << (*g)[i]
                                                         << ", float cache " << (*w)[i] << " rounded " << rounded;
        written += (*w)[i] != in.cache0[i];
      }
    }
    EXPECT_GT(written, 0) << "the float run wrote nothing: the comparison proves nothing";
  }
}

// Device positions outside the cache: both leave the caches untouched; a negative one leaves q
// NaN in the rotated dims (rope_neox_at), one past the end rotates q as usual.
TEST(CudaQkNormRopeStore, BadDevicePositionMatchesUnfused) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  uint32_t seed = 100;
  for (int32_t pos : {-1, -1000, 598, 1 << 30}) {
    const Case c{16, 2, 128, 64, true, true, 3, pos};
    SCOPED_TRACE(c.name());
    const Inputs in(c, seed++);
    const Outputs got = fused(in);
    expect_same(got, unfused(in), c.name());
    ASSERT_EQ(std::memcmp(got.k_cache.data(), in.cache0.data(), in.cache0.size() * 4), 0) << "k cache written";
    ASSERT_EQ(std::memcmp(got.v_cache.data(), in.cache0.data(), in.cache0.size() * 4), 0) << "v cache written";
    if (pos < 0) {
      EXPECT_TRUE(std::isnan(got.q[0]) && std::isnan(got.q[63]) && !std::isnan(got.q[64])) << "q dims 0, 63, 64";
    }
  }
}

// One captured launch serves every step: the position is read on the device at replay.
TEST(CudaQkNormRopeStore, GraphReplayAtSeveralPositions) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const Case c{32, 4, 128, 128, false, true, 1, 0};
  Inputs in(c, 200);
  cuda::DeviceBuffer<float> q(static_cast<size_t>(c.rows * c.n_head * c.hd)), kc(in.cache0.size()), vc(in.cache0.size());
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  cuda::qk_norm_rope_store(in.args(q.get(), kc.get(), vc.get()), stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int32_t pos : {0, 1, 300, 599}) {
    in.c.pos = pos;
    in.pos.upload(&pos, 1);
    q.fill_bytes(0xff);
    kc.upload(in.cache0.data(), in.cache0.size());
    vc.upload(in.cache0.data(), in.cache0.size());
    // The uploads and the fill run on the legacy stream, which a non-blocking stream does not wait
    // for, and cudaMemcpy from pageable memory may return before its DMA lands: without this sync
    // the cache upload could overwrite the graph's store (seen once on the H200, run A).
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    expect_same(download(q, kc, vc), unfused(in), "graph replay at " + std::to_string(pos));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// glm4moe's order: the projections' biases, then the q/k norms and RoPE. With biases the kernel
// gives the bits of the kernel without them on inputs biased on the host (one rounded float add
// each, as reference::attention_block adds them), for separate and concatenated q / k / v.
TEST(CudaQkNormRopeStore, BiasesBeforeTheNormsEqualBiasedInputs) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  uint32_t seed = 300;
  for (const Case& c : {Case{4, 2, 16, 8, false, false, 3, 5}, Case{4, 2, 16, 8, false, true, 1, 40},
                        Case{12, 2, 128, 64, false, true, 16, 517}, Case{6, 2, 40, 24, false, false, 5, 33, 1e4}}) {
    SCOPED_TRACE(c.name());
    const uint32_t input_seed = seed++;
    const Inputs in(c, input_seed);
    std::mt19937 rng(seed++);
    const std::vector<float> qb = cuda_test::random_values(rng, static_cast<size_t>(c.n_head * c.hd));
    const std::vector<float> kb = cuda_test::random_values(rng, static_cast<size_t>(in.kv_dim));
    const std::vector<float> vb = cuda_test::random_values(rng, static_cast<size_t>(in.kv_dim));
    cuda::DeviceBuffer<float> dqb(qb.size()), dkb(kb.size()), dvb(vb.size());
    dqb.upload(qb.data(), qb.size());
    dkb.upload(kb.data(), kb.size());
    dvb.upload(vb.data(), vb.size());
    cuda::DeviceBuffer<float> q(static_cast<size_t>(c.rows * c.n_head * c.hd)), kc(in.cache0.size()), vc(in.cache0.size());
    q.fill_bytes(0xff);
    kc.upload(in.cache0.data(), in.cache0.size());
    vc.upload(in.cache0.data(), in.cache0.size());
    cuda::QkNormRopeStoreArgs a = in.args(q.get(), kc.get(), vc.get());
    a.q_bias = dqb.get();
    a.k_bias = dkb.get();
    a.v_bias = dvb.get();
    cuda::qk_norm_rope_store(a);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const Outputs got = download(q, kc, vc);
    // The same random inputs, biased on the host.
    Inputs biased(c, input_seed);
    const auto add = [&](cuda::DeviceBuffer<float>& buf, int64_t stride, int64_t offset, const std::vector<float>& b) {
      std::vector<float> h(buf.size());
      buf.download(h.data(), h.size());
      for (int64_t t = 0; t < c.rows; ++t)
        for (size_t i = 0; i < b.size(); ++i) h[t * stride + offset + static_cast<int64_t>(i)] += b[i];
      buf.upload(h.data(), h.size());
    };
    if (c.concat) {
      add(biased.qkv, biased.row_stride(), 0, qb);
      add(biased.qkv, biased.row_stride(), biased.q_rows, kb);
      add(biased.qkv, biased.row_stride(), biased.q_rows + biased.kv_dim, vb);
    } else {
      add(biased.q, biased.q_rows, 0, qb);
      add(biased.k, biased.kv_dim, 0, kb);
      add(biased.v, biased.kv_dim, 0, vb);
    }
    expect_same(got, fused(biased), c.name() + " with biases");
  }
}

// Argument checks come before any CUDA call, so this runs without a device too.
TEST(CudaQkNormRopeStoreArguments, RejectsBadShapes) {
  float f = 0;
  int32_t p = 0;
  cuda::QkNormRopeStoreArgs a;
  a.q = a.k = a.v = a.q_norm = a.k_norm = &f;
  a.q_out = a.k_cache = a.v_cache = &f;
  a.pos0_dev = &p;
  a.rows = 1;
  a.n_head = 4;
  a.n_head_kv = 2;
  a.head_dim = 64;
  a.n_rot = 64;
  a.q_row_stride = 256;
  a.q_head_stride = 64;
  a.k_row_stride = a.v_row_stride = 128;
  a.max_pos = 8;
  cuda::QkNormRopeStoreArgs b = a;
  b.n_rot = 63;  // odd
  EXPECT_THROW(cuda::qk_norm_rope_store(b), std::invalid_argument);
  b = a;
  b.n_rot = 128;  // past head_dim
  EXPECT_THROW(cuda::qk_norm_rope_store(b), std::invalid_argument);
  b = a;
  b.q_head_stride = 32;  // heads overlap
  EXPECT_THROW(cuda::qk_norm_rope_store(b), std::invalid_argument);
  b = a;
  b.k_row_stride = 100;
  EXPECT_THROW(cuda::qk_norm_rope_store(b), std::invalid_argument);
  b = a;
  b.max_pos = 0;
  EXPECT_THROW(cuda::qk_norm_rope_store(b), std::invalid_argument);
  b = a;
  b.pos0_dev = nullptr;
  EXPECT_THROW(cuda::qk_norm_rope_store(b), std::invalid_argument);
  __half hf;
  b = a;
  b.k_cache_f16 = b.v_cache_f16 = &hf;  // both a float and a half cache
  EXPECT_THROW(cuda::qk_norm_rope_store(b), std::invalid_argument);
  b.k_cache = b.v_cache = nullptr;
  b.v_cache_f16 = nullptr;  // half k cache without a v cache
  EXPECT_THROW(cuda::qk_norm_rope_store(b), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
