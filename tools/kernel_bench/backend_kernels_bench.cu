// Backend kernel bench. Weight-reading kernels (matvec_float, embed_rows) cycle over enough
// copies that the bytes exceed the 60 MB L2, as in decode; the activation kernels work on buffers
// the size a step of that many tokens has, so their numbers include whatever L2 reuse a real
// step gets. Inputs are random (the kernels' speed does not depend on the values).
#include "tools/kernel_bench/backend_kernels_bench.h"
#include "tools/kernel_bench/cuda_timing.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cuda/argmax.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_decode.h"
#include "kernels/cuda/attention_prefill.h"
#include "kernels/cuda/attention_prefill_tc.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/embed_rows.h"
#include "kernels/cuda/head_rms_norm.h"
#include "kernels/cuda/kv_store.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/matvec_float.h"
#include "kernels/cuda/moe_combine.h"
#include "kernels/cuda/qk_norm_rope_store.h"
#include "kernels/cuda/quantize_activations_llama.h"
#include "kernels/cuda/residual_add.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/cuda/rms_norm_quantize.h"
#include "kernels/cuda/rope.h"
#include "kernels/cuda/router.h"
#include "kernels/cuda/router_fused.h"
#include "kernels/cuda/swiglu.h"

namespace moraine::kernel_bench {
namespace {

using cuda::DeviceBuffer;

DeviceBuffer<float> random_device(size_t n, uint32_t seed, float sd = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  DeviceBuffer<float> b(n);
  b.upload(v.data(), n);
  return b;
}

// Microseconds per call of fn(stream, i) when kReps calls are captured into one CUDA graph and
// the graph is replayed, as the backend's decode step runs: launch gaps between tiny kernels in a
// graph are what the fused kernels remove, and stream launches from the host hide them behind
// the host's own launch cost.
template <class Fn>
double graph_ms_per_call(Fn&& fn, double min_ms) {
  constexpr int kReps = 20;
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kReps; ++i) fn(stream, i);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double ms = ms_per_call([&](int) { CUDA_CHECK(cudaGraphLaunch(exec, nullptr)); }, min_ms) / kReps;
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
  return ms;
}

struct Line {
  std::string kernel, shape;
  double us, rate;
  const char* unit;  // "GB/s" or "TFLOP/s"
};

// The Qwen3-30B-A3B shapes every section uses.
constexpr int64_t kD = 2048, kHeads = 32, kKvHeads = 4, kHeadDim = 128, kFf = 768, kExperts = 128, kTopK = 8;
// One row of the table: kernel, shape, milliseconds per call, bytes or FLOPs per call, unit.
using AddRow = std::function<void(std::string, std::string, double, double, const char*)>;

cuda::AttentionShape bench_attention_shape() {
  cuda::AttentionShape s;
  s.n_head = kHeads;
  s.n_head_kv = kKvHeads;
  s.head_dim = kHeadDim;
  s.kv_stride = kKvHeads * kHeadDim;
  s.scale = 0.088f;
  return s;
}

void fused_decode_rows(double min_ms, const AddRow& add) {
  const int64_t d = kD, n_head = kHeads, n_kv = kKvHeads, hd = kHeadDim, n_expert = kExperts, k = kTopK;
  // Fused decode-step kernels against the unfused sequences they replace (bit-identical outputs:
  // tests/cuda/{rms_norm_quantize,qk_norm_rope_store,matvec_accumulate,router_fused}_test.cpp), per stream
  // launch and per call inside a captured graph (the backend's decode step).
  for (int64_t n : {int64_t{1}, int64_t{16}}) {
    const std::string tok = std::to_string(n) + (n == 1 ? " token" : " tokens");
    const auto both = [&](const std::string& name, const std::string& shape, double amount,
                          const std::function<void(cudaStream_t, int)>& fn) {
      add(name, shape + ", stream", ms_per_call([&](int i) { fn(nullptr, i); }, min_ms), amount, "GB/s");
      add(name, shape + ", graph", graph_ms_per_call(fn, min_ms), amount, "GB/s");
    };
    {  // attention / FFN norm then q8_0 activations
      DeviceBuffer<float> x = random_device(n * d, 20), w = random_device(d, 21), h(n * d);
      DeviceBuffer<uint8_t> q(row_bytes(TensorType::Q8_0, d) * n);
      const double bytes = double(n * d * 8 + q.bytes());
      both("rms_norm + quantize q8_0", "2048 x " + tok, bytes, [&](cudaStream_t s, int) {
        cuda::rms_norm(x.get(), w.get(), h.get(), d, n, 1e-6f, s);
        cuda::quantize_activations_llama(TensorType::Q8_0, h.get(), q.get(), d, n, s);
      });
      both("rms_norm_quantize q8_0", "2048 x " + tok, bytes, [&](cudaStream_t s, int) {
        cuda::rms_norm_quantize(x.get(), w.get(), h.get(), TensorType::Q8_0, q.get(), d, n, 1e-6f, s);
      });
    }
    {  // q/k norm, RoPE, K/V store from one qkv matvec output
      const int64_t kv_dim = n_kv * hd, q_rows = n_head * hd, stride = q_rows + 2 * kv_dim, max_pos = 4096;
      DeviceBuffer<float> qkv = random_device(n * stride, 22), qn = random_device(hd, 23), kn = random_device(hd, 24);
      DeviceBuffer<float> q(n * q_rows), kt(n * kv_dim), vt(n * kv_dim), kc(max_pos * kv_dim), vc(max_pos * kv_dim);
      const int32_t pos_h = 1000;
      DeviceBuffer<int32_t> pos(1);
      pos.upload(&pos_h, 1);
      const double bytes = double(n * (stride + q_rows + 2 * kv_dim) * 4);
      const std::string shape = "32/4 heads x128, " + tok;
      // The unfused sequence on separate k/v scratch (the backend's layout before fusion).
      both("q/k norm+rope+kv store (6)", shape, bytes, [&](cudaStream_t s, int) {
        cuda::head_rms_norm(qkv.get(), stride, hd, qn.get(), q.get(), n, n_head, hd, 1e-6f, s);
        cuda::rope_neox_at(q.get(), n, n_head, q_rows, hd, hd, pos.get(), 1e6, s);
        cuda::head_rms_norm(qkv.get() + q_rows, stride, hd, kn.get(), kt.get(), n, n_kv, hd, 1e-6f, s);
        cuda::rope_neox_at(kt.get(), n, n_kv, kv_dim, hd, hd, pos.get(), 1e6, s);
        cuda::kv_store_at(kt.get(), kc.get(), n, kv_dim, pos.get(), max_pos, s);
        cuda::kv_store_at(vt.get(), vc.get(), n, kv_dim, pos.get(), max_pos, s);
      });
      cuda::QkNormRopeStoreArgs a;
      a.q = qkv.get();
      a.q_row_stride = stride;
      a.q_head_stride = hd;
      a.k = qkv.get() + q_rows;
      a.v = qkv.get() + q_rows + kv_dim;
      a.k_row_stride = a.v_row_stride = stride;
      a.q_norm = qn.get();
      a.k_norm = kn.get();
      a.rows = n;
      a.n_head = n_head;
      a.n_head_kv = n_kv;
      a.head_dim = hd;
      a.n_rot = hd;
      a.pos0_dev = pos.get();
      a.freq_base = 1e6;
      a.max_pos = max_pos;
      a.q_out = q.get();
      a.k_cache = kc.get();
      a.v_cache = vc.get();
      both("qk_norm_rope_store", shape, bytes, [&](cudaStream_t s, int) { cuda::qk_norm_rope_store(a, s); });
    }
    {  // MoE combine into x, then the next layer's norm and q8_0 activations
      DeviceBuffer<float> x = random_device(n * d, 27), slots = random_device(n * k * d, 28), w = random_device(n * k, 29);
      DeviceBuffer<float> nw = random_device(d, 30), h(n * d);
      DeviceBuffer<uint8_t> q(row_bytes(TensorType::Q8_0, d) * n);
      const double bytes = double((n * k * d + 3 * n * d) * 4 + q.bytes());
      both("combine + norm + quantize", "8x2048 x " + tok, bytes, [&](cudaStream_t s, int) {
        cuda::moe_combine_mixed(x.get(), slots.get(), nullptr, nullptr, w.get(), nullptr, nullptr, n, k, d, s);
        cuda::rms_norm(x.get(), nw.get(), h.get(), d, n, 1e-6f, s);
        cuda::quantize_activations_llama(TensorType::Q8_0, h.get(), q.get(), d, n, s);
      });
      both("moe_combine_rms_norm_quant", "8x2048 x " + tok, bytes, [&](cudaStream_t s, int) {
        cuda::moe_combine_rms_norm_quantize(x.get(), slots.get(), nullptr, nullptr, w.get(), nullptr, nullptr, n, k, d,
                                            nw.get(), h.get(), TensorType::Q8_0, q.get(), 1e-6f, s);
      });
    }
    {  // router: F32 matvec 128 x 2048 then softmax top-8 (weights L2-resident, as in decode)
      DeviceBuffer<float> rw = random_device(n_expert * d, 31, 0.05f), h = random_device(n * d, 32);
      DeviceBuffer<float> logits(n * n_expert), wt(n * k);
      DeviceBuffer<int32_t> ids(n * k);
      DeviceBuffer<uint32_t> arrivals(n);
      arrivals.fill_bytes(0);
      cuda::MatvecBatch b;
      b.count = static_cast<int>(n);
      b.act_stride_bytes = d * 4;
      b.out_stride = n_expert;
      const double bytes = double((n_expert + n) * d * 4);
      both("router matvec + top-8", "128x2048 f32, " + tok, bytes, [&](cudaStream_t s, int) {
        cuda::matvec_float_batched(TensorType::F32, rw.get(), n_expert, d, h.get(), logits.get(), b, s);
        cuda::route_softmax_top_k(logits.get(), n, n_expert, k, true, ids.get(), wt.get(), s);
      });
      both("router_fused", "128x2048 f32, " + tok, bytes, [&](cudaStream_t s, int) {
        cuda::router_fused(TensorType::F32, rw.get(), n_expert, d, h.get(), n, k, true, logits.get(), ids.get(), wt.get(),
                           arrivals.get(), s);
      });
    }
    {  // o projection (q8_0, 2048 x 4096) into the residual stream, weights cycled above L2
      const int64_t cols = n_head * hd;
      const size_t mat = row_bytes(TensorType::Q8_0, cols) * d;
      const size_t copies = (size_t{512} << 20) / mat;
      DeviceBuffer<uint8_t> w(mat * copies);
      CUDA_CHECK(cudaMemset(w.get(), 0x11, w.bytes()));
      DeviceBuffer<float> attn = random_device(n * cols, 25), x = random_device(n * d, 26), y(n * d);
      DeviceBuffer<uint8_t> act(row_bytes(TensorType::Q8_0, cols) * n);
      cuda::quantize_activations_llama(TensorType::Q8_0, attn.get(), act.get(), cols, n);
      cuda::MatvecBatch b;
      b.count = static_cast<int>(n);
      b.act_stride_bytes = static_cast<int64_t>(row_bytes(TensorType::Q8_0, cols));
      b.out_stride = d;
      const std::string shape = "q8_0 2048x4096, " + tok;
      both("matvec + residual_add", shape, double(mat), [&](cudaStream_t s, int i) {
        cuda::matvec_quantized_batched(TensorType::Q8_0, w.get() + (i % copies) * mat, d, cols, act.get(), y.get(), b, s);
        cuda::residual_add(x.get(), y.get(), n * d, s);
      });
      cuda::MatvecBatch acc = b;
      acc.accumulate = true;
      both("matvec accumulate", shape, double(mat), [&](cudaStream_t s, int i) {
        cuda::matvec_quantized_batched(TensorType::Q8_0, w.get() + (i % copies) * mat, d, cols, act.get(), x.get(), acc, s);
      });
    }
  }
}

void small_kernel_rows(double min_ms, const AddRow& add) {
  const int64_t d = kD, n_head = kHeads, hd = kHeadDim, ff = kFf, n_expert = kExperts, k = kTopK;
  // Float-weight matvec, one token, a 2048 x 2048 matrix from a set well above L2.
  for (TensorType t : {TensorType::F32, TensorType::F16, TensorType::BF16}) {
    const size_t mat = row_bytes(t, d) * d;
    const size_t copies = (size_t{512} << 20) / mat;
    DeviceBuffer<uint8_t> w(mat * copies);
    CUDA_CHECK(cudaMemset(w.get(), 0x3c, w.bytes()));
    DeviceBuffer<float> x = random_device(d, 1), y(d);
    cuda::MatvecBatch b;
    const double ms = ms_per_call([&](int i) {
      cuda::matvec_float_batched(t, w.get() + (i % copies) * mat, d, d, x.get(), y.get(), b);
    }, min_ms);
    add("matvec_float " + std::string(type_name(t)), "2048x2048, 1 token", ms, double(mat), "GB/s");
  }

  for (int64_t n : {int64_t{1}, int64_t{512}}) {
    const std::string tok = std::to_string(n) + (n == 1 ? " token" : " tokens");
    {  // q8_0 activations for a 2048-wide matrix
      DeviceBuffer<float> x = random_device(n * d, 2);
      DeviceBuffer<uint8_t> q(row_bytes(TensorType::Q8_0, d) * n);
      const double ms = ms_per_call([&](int) { cuda::quantize_activations_llama(TensorType::Q8_0, x.get(), q.get(), d, n); }, min_ms);
      add("quantize q8_0 (llama rule)", "2048 x " + tok, ms, double(n * d * 4 + q.bytes()), "GB/s");
    }
    {  // q/k norm and RoPE over a q projection of 32 heads
      DeviceBuffer<float> q = random_device(n * n_head * hd, 3);
      DeviceBuffer<float> w = random_device(hd, 4);
      double ms = ms_per_call([&](int) { cuda::head_rms_norm(q.get(), n_head * hd, hd, w.get(), q.get(), n, n_head, hd, 1e-6f); }, min_ms);
      add("head_rms_norm", "32x128 x " + tok, ms, double(2 * n * n_head * hd * 4), "GB/s");
      ms = ms_per_call([&](int i) { cuda::rope_neox(q.get(), n, n_head, n_head * hd, hd, hd, i, 1e6); }, min_ms);
      add("rope_neox", "32x128 x " + tok, ms, double(2 * n * n_head * hd * 4), "GB/s");
    }
    {  // router, SwiGLU over the k experts' hidden rows, MoE combine, residual add
      DeviceBuffer<float> logits = random_device(n * n_expert, 5), w(n * k);
      DeviceBuffer<int32_t> ids(n * k);
      double ms = ms_per_call([&](int) { cuda::route_softmax_top_k(logits.get(), n, n_expert, k, true, ids.get(), w.get()); }, min_ms);
      add("router softmax top-8", "128 experts x " + tok, ms, double(n * n_expert * 4), "GB/s");
      DeviceBuffer<float> g = random_device(n * k * ff, 6), u = random_device(n * k * ff, 7);
      ms = ms_per_call([&](int) { cuda::swiglu(g.get(), u.get(), n * k * ff); }, min_ms);
      add("swiglu", "8x768 x " + tok, ms, double(3 * n * k * ff * 4), "GB/s");
      DeviceBuffer<float> x = random_device(n * d, 8), slots = random_device(n * k * d, 9);
      ms = ms_per_call([&](int) { cuda::moe_combine(x.get(), slots.get(), w.get(), nullptr, nullptr, n, k, d); }, min_ms);
      add("moe_combine", "8x2048 x " + tok, ms, double((n * k * d + 2 * n * d) * 4), "GB/s");
      ms = ms_per_call([&](int) { cuda::residual_add(x.get(), slots.get(), n * d); }, min_ms);
      add("residual_add", "2048 x " + tok, ms, double(3 * n * d * 4), "GB/s");
    }
    if (n == 1) {  // greedy decode's token: the argmax over a 151936-word logits row (kernels/cuda/argmax.h),
                   // alone and with the non-finite report (moraine-bench's check_logits), per stream launch
                   // and inside a captured graph (the backend's decode step)
      const int64_t vocab = 151936;
      DeviceBuffer<float> row = random_device(vocab, 10);
      DeviceBuffer<int32_t> id(1), first_bad(1);
      DeviceBuffer<uint8_t> scratch(cuda::argmax_scratch_bytes(1));
      scratch.fill_bytes(0);
      for (int32_t* report : {static_cast<int32_t*>(nullptr), first_bad.get()}) {
        const auto call = [&](cudaStream_t s, int) {
          cuda::argmax_rows(row.get(), 1, vocab, id.get(), scratch.get(), s, report);
        };
        const std::string name = report == nullptr ? "argmax (greedy token)" : "argmax + non-finite report";
        const double stream_ms = ms_per_call([&](int i) { call(nullptr, i); }, min_ms);
        add(name, "151936 logits, stream", stream_ms, double(vocab * 4), "GB/s");
        add(name, "151936 logits, graph", graph_ms_per_call(call, min_ms), double(vocab * 4), "GB/s");
      }
    }
    {  // embedding rows from a q8_0 table of 151936 x 2048 (311 MB, well above L2)
      const int64_t vocab = 151936;
      const size_t rb = row_bytes(TensorType::Q8_0, d);
      DeviceBuffer<uint8_t> table(rb * vocab);
      CUDA_CHECK(cudaMemset(table.get(), 0x11, table.bytes()));
      std::vector<int32_t> ids_h(static_cast<size_t>(n));
      std::mt19937 rng(10);
      for (int32_t& id : ids_h) id = static_cast<int32_t>(rng() % vocab);
      DeviceBuffer<int32_t> ids(ids_h.size());
      ids.upload(ids_h.data(), ids_h.size());
      DeviceBuffer<float> out(n * d);
      const double ms = ms_per_call([&](int) { cuda::embed_rows(TensorType::Q8_0, table.get(), rb, d, ids.get(), n, out.get()); }, min_ms);
      add("embed_rows q8_0", "151936x2048, " + tok, ms, double(n * (rb + d * 4)), "GB/s");
    }
  }
}

void attention_decode_rows(double min_ms, const AddRow& add) {
  const int64_t n_head = kHeads, n_kv = kKvHeads, hd = kHeadDim;
  const cuda::AttentionShape s = bench_attention_shape();
  // Attention: decode over a long cache (bytes of K and V read), prefill from empty (FLOPs).
  // Decode cycles over copies of the cache well above the 60 MB L2 (as a real step finds it after
  // the other layers ran), for the kernel before GQA sharing (each K/V row read once per query
  // head), the shared one, and the graph-safe one (grid sized for the capacity, here the live
  // length, and for a 32K capacity at a shorter live length: the cost of the fixed grid).
  for (int64_t ctx : {int64_t{512}, int64_t{4096}, int64_t{32768}}) {
    const int64_t kv = ctx * n_kv * hd, cap = 32768;
    const int64_t copies = std::max<int64_t>(2, (int64_t{512} << 20) / (2 * kv * 4));
    DeviceBuffer<float> kc(static_cast<size_t>(copies * kv)), vc(static_cast<size_t>(copies * kv));
    // The same cache as IEEE halves (the backend's F16 KV cache), as many copies (half the bytes,
    // still well above L2).
    DeviceBuffer<__half> kc16(static_cast<size_t>(copies * kv)), vc16(static_cast<size_t>(copies * kv));
    {  // one random cache, replicated on the device (host generation of every copy takes seconds)
      DeviceBuffer<float> k1 = random_device(kv, 11), v1 = random_device(kv, 12);
      for (int64_t c = 0; c < copies; ++c) {
        CUDA_CHECK(cudaMemcpy(kc.get() + c * kv, k1.get(), k1.bytes(), cudaMemcpyDeviceToDevice));
        CUDA_CHECK(cudaMemcpy(vc.get() + c * kv, v1.get(), v1.bytes(), cudaMemcpyDeviceToDevice));
      }
      for (auto [from, to] : {std::pair{&k1, &kc16}, std::pair{&v1, &vc16}}) {
        std::vector<float> f(static_cast<size_t>(kv));
        from->download(f.data(), f.size());
        std::vector<__half> h(f.size());
        for (size_t i = 0; i < f.size(); ++i) h[i] = __float2half_rn(f[i]);
        for (int64_t c = 0; c < copies; ++c)
          CUDA_CHECK(cudaMemcpy(to->get() + c * kv, h.data(), h.size() * sizeof(__half), cudaMemcpyHostToDevice));
      }
    }
    DeviceBuffer<float> q = random_device(n_head * hd, 13), out(n_head * hd);
    const int64_t scratch = cuda::attention_at_scratch_floats(s, 1, cap);
    DeviceBuffer<float> sc(static_cast<size_t>(scratch));
    const int32_t past_h = static_cast<int32_t>(ctx - 1);
    DeviceBuffer<int32_t> past(1);
    past.upload(&past_h, 1);
    const std::string shape = "32/4 heads x128, ctx " + std::to_string(ctx);
    const double bytes = double(2 * kv * 4);
    double ms = ms_per_call([&](int i) {
      const int64_t c = i % copies;
      cuda::attention_unshared(s, q.get(), kc.get() + c * kv, vc.get() + c * kv, 1, ctx - 1, nullptr, 0, 0, out.get(),
                               sc.get(), scratch);
    }, min_ms);
    add("attention decode unshared", shape, ms, bytes, "GB/s");
    ms = ms_per_call([&](int i) {
      const int64_t c = i % copies;
      cuda::attention(s, q.get(), kc.get() + c * kv, vc.get() + c * kv, 1, ctx - 1, nullptr, 0, 0, out.get(), sc.get(),
                      scratch);
    }, min_ms);
    add("attention decode GQA-shared", shape, ms, bytes, "GB/s");
    ms = ms_per_call([&](int i) {
      const int64_t c = i % copies;
      cuda::attention_at(s, q.get(), kc.get() + c * kv, vc.get() + c * kv, 1, past.get(), ctx, nullptr, 0, 0,
                         out.get(), sc.get(), scratch);
    }, min_ms);
    add("attention_at (cap = ctx)", shape, ms, bytes, "GB/s");
    {  // flash decoding (attention_decode.h), what the backend runs for steps below 64 rows: 1 row
       // and 16 (the last 16 positions) with the grid sized for the live length, and 1 row with
       // the backend's grid (capacity 32768) at a shorter live length
      DeviceBuffer<float> q16 = random_device(16 * n_head * hd, 19), out16(16 * n_head * hd);
      for (int pass = 0; pass < (ctx < cap ? 2 : 1); ++pass) {
        const int64_t cap_d = pass == 0 ? ctx : cap;
        for (int64_t rows : {int64_t{1}, int64_t{16}}) {
          if (pass == 1 && rows != 1) continue;
          const int32_t first_h = static_cast<int32_t>(ctx - rows);
          DeviceBuffer<int32_t> first(1);
          first.upload(&first_h, 1);
          const int64_t dsf = cuda::attention_decode_scratch_floats(s, rows, cap_d);
          DeviceBuffer<float> dsc(static_cast<size_t>(dsf));
          ms = ms_per_call([&](int i) {
            const int64_t c = i % copies;
            cuda::attention_decode(s, q16.get(), kc.get() + c * kv, vc.get() + c * kv, rows, first.get(), 0, cap_d,
                                   nullptr, 0, 0, out16.get(), dsc.get(), dsf);
          }, min_ms);
          add("attention_decode " + std::to_string(rows) + (rows == 1 ? " row" : " rows"),
              shape + (cap_d == ctx ? "" : " (cap 32768)"), ms, bytes, "GB/s");
          ms = ms_per_call([&](int i) {
            const int64_t c = i % copies;
            cuda::attention_decode(s, q16.get(), kc16.get() + c * kv, vc16.get() + c * kv, rows, first.get(), 0, cap_d,
                                   nullptr, 0, 0, out16.get(), dsc.get(), dsf);
          }, min_ms);
          add("attention_decode " + std::to_string(rows) + (rows == 1 ? " row" : " rows") + " F16 KV",
              shape + (cap_d == ctx ? "" : " (cap 32768)"), ms, bytes / 2, "GB/s");
        }
      }
    }
    if (ctx < cap) {
      DeviceBuffer<float> kbig = random_device(cap * n_kv * hd, 17), vbig = random_device(cap * n_kv * hd, 18);
      ms = ms_per_call([&](int) {
        cuda::attention_at(s, q.get(), kbig.get(), vbig.get(), 1, past.get(), cap, nullptr, 0, 0, out.get(), sc.get(),
                           scratch);
      }, min_ms);
      add("attention_at (cap 32768)", shape + " (L2-warm)", ms, bytes, "GB/s");
    }
  }
}

void attention_prefill_rows(double min_ms, const AddRow& add) {
  const int64_t n_head = kHeads, n_kv = kKvHeads, hd = kHeadDim;
  const cuda::AttentionShape s = bench_attention_shape();
  // Prefill from empty: causal, query t sees t + 1 positions; 4 FLOPs per (position, dim) for
  // q.k and p.v. The per-row split-KV path (the decode kernel over the rows) only at 512: at
  // 8192 it takes seconds per call.
  for (int64_t n : {int64_t{512}, int64_t{8192}}) {
    DeviceBuffer<float> kc = random_device(n * n_kv * hd, 14), vc = random_device(n * n_kv * hd, 15);
    DeviceBuffer<float> q = random_device(n * n_head * hd, 16), out(n * n_head * hd);
    const double flops = 4.0 * n_head * hd * (n * (n + 1) / 2.0);
    const std::string shape = "32/4 heads x128, " + std::to_string(n) + " tokens";
    if (n == 512) {
      const int64_t scratch = cuda::attention_scratch_floats(s, 16, n);
      DeviceBuffer<float> sc(static_cast<size_t>(scratch));
      const double ms = ms_per_call([&](int) {
        cuda::attention(s, q.get(), kc.get(), vc.get(), n, 0, nullptr, 0, 0, out.get(), sc.get(), scratch);
      }, min_ms);
      add("attention prefill (per row)", shape, ms, flops, "TFLOP/s");
    }
    const double ms = ms_per_call([&](int) {
      cuda::attention_prefill(s, q.get(), kc.get(), vc.get(), n, 0, nullptr, 0, 0, out.get());
    }, min_ms);
    add("attention_prefill (tiled)", shape, ms, flops, "TFLOP/s");
    {  // the F16 KV cache (values of no consequence to the timing)
      DeviceBuffer<__half> kc16(static_cast<size_t>(n * n_kv * hd)), vc16(static_cast<size_t>(n * n_kv * hd));
      kc16.fill_bytes(0x3c), vc16.fill_bytes(0x3c);   // 0x3c3c: 1.06 in every element
      const double ms16 = ms_per_call([&](int) {
        cuda::attention_prefill(s, q.get(), kc16.get(), vc16.get(), n, 0, nullptr, 0, 0, out.get());
      }, min_ms);
      add("attention_prefill (tiled) F16 KV", shape, ms16, flops, "TFLOP/s");
      // The tensor-core variant (attention_prefill_tc.h) on the same cache: the row to compare.
      const double ms_tc = ms_per_call([&](int) {
        cuda::attention_prefill_tc(s, q.get(), kc16.get(), vc16.get(), n, 0, nullptr, 0, 0, out.get());
      }, min_ms);
      add("attention_prefill_tc F16 KV", shape, ms_tc, flops, "TFLOP/s");
    }
  }
}

}  // namespace

void run_backend_kernels_bench(double min_ms, double read_gbps, nlohmann::json* json) {
  std::vector<Line> lines;
  const AddRow add = [&](std::string k, std::string s, double ms, double amount, const char* unit) {
    lines.push_back({std::move(k), std::move(s), ms * 1e3, amount / (ms * 1e-3) / (unit[0] == 'G' ? 1e9 : 1e12), unit});
  };
  fused_decode_rows(min_ms, add);
  small_kernel_rows(min_ms, add);
  attention_decode_rows(min_ms, add);
  attention_prefill_rows(min_ms, add);

  if (json != nullptr) {
    for (const Line& l : lines)
      (*json)["backend_kernels"].push_back({{"kernel", l.kernel}, {"shape", l.shape}, {"us_per_call", l.us},
                                            {"rate", l.rate}, {"unit", l.unit}});
    return;
  }
  std::printf("\nbackend kernels (read kernel %.0f GB/s)\n%-28s %-32s %10s %12s\n", read_gbps, "kernel", "shape", "us/call", "rate");
  for (const Line& l : lines)
    std::printf("%-28s %-32s %10.2f %9.1f %s\n", l.kernel.c_str(), l.shape.c_str(), l.us, l.rate, l.unit);
}

}  // namespace moraine::kernel_bench
