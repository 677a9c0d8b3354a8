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
#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_decode.h"
#include "kernels/cuda/attention_prefill.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/embed_rows.h"
#include "kernels/cuda/head_rms_norm.h"
#include "kernels/cuda/matvec_float.h"
#include "kernels/cuda/moe_combine.h"
#include "kernels/cuda/quantize_activations_llama.h"
#include "kernels/cuda/residual_add.h"
#include "kernels/cuda/rope.h"
#include "kernels/cuda/router.h"
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

struct Line {
  std::string kernel, shape;
  double us, rate;
  const char* unit;  // "GB/s" or "TFLOP/s"
};

}  // namespace

void run_backend_kernels_bench(double min_ms, double read_gbps, nlohmann::json* json) {
  std::vector<Line> lines;
  auto add = [&](std::string k, std::string s, double ms, double amount, const char* unit) {
    lines.push_back({std::move(k), std::move(s), ms * 1e3, amount / (ms * 1e-3) / (unit[0] == 'G' ? 1e9 : 1e12), unit});
  };
  const int64_t d = 2048, n_head = 32, n_kv = 4, hd = 128, ff = 768, n_expert = 128, k = 8;

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

  // Attention: decode over a long cache (bytes of K and V read), prefill from empty (FLOPs).
  // Decode cycles over copies of the cache well above the 60 MB L2 (as a real step finds it after
  // the other layers ran), for the kernel before GQA sharing (each K/V row read once per query
  // head), the shared one, and the graph-safe one (grid sized for the capacity, here the live
  // length, and for a 32K capacity at a shorter live length: the cost of the fixed grid).
  cuda::AttentionShape s;
  s.n_head = n_head;
  s.n_head_kv = n_kv;
  s.head_dim = hd;
  s.kv_stride = n_kv * hd;
  s.scale = 0.088f;
  for (int64_t ctx : {int64_t{512}, int64_t{4096}, int64_t{32768}}) {
    const int64_t kv = ctx * n_kv * hd, cap = 32768;
    const int64_t copies = std::max<int64_t>(2, (int64_t{512} << 20) / (2 * kv * 4));
    DeviceBuffer<float> kc(static_cast<size_t>(copies * kv)), vc(static_cast<size_t>(copies * kv));
    {  // one random cache, replicated on the device (host generation of every copy takes seconds)
      DeviceBuffer<float> k1 = random_device(kv, 11), v1 = random_device(kv, 12);
      for (int64_t c = 0; c < copies; ++c) {
        CUDA_CHECK(cudaMemcpy(kc.get() + c * kv, k1.get(), k1.bytes(), cudaMemcpyDeviceToDevice));
        CUDA_CHECK(cudaMemcpy(vc.get() + c * kv, v1.get(), v1.bytes(), cudaMemcpyDeviceToDevice));
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
    {  // flash decoding (attention_decode.h), what the backend runs for short steps
      const int64_t dsf = cuda::attention_decode_scratch_floats(s, 1, ctx);
      DeviceBuffer<float> dsc(static_cast<size_t>(dsf));
      ms = ms_per_call([&](int i) {
        const int64_t c = i % copies;
        cuda::attention_decode(s, q.get(), kc.get() + c * kv, vc.get() + c * kv, 1, past.get(), 0, ctx, nullptr, 0, 0,
                               out.get(), dsc.get(), dsf);
      }, min_ms);
      add("attention_decode (cap = ctx)", shape, ms, bytes, "GB/s");
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
  }

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
