// moraine-kernel-bench cuda. Every call reads a different copy of the matrix (or a different
// random choice of 8 experts out of a pool) from a set of --set-mib distinct bytes, so no weight
// is L2-resident when it is read again: the numbers are HBM numbers, as in decode. Weights are a
// few quantized template rows replicated on the device (quantizing a GiB on the CPU is slow and
// the kernels' speed does not depend on the values).
#include "tools/kernel_bench/cuda_bench.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <random>
#include <stdexcept>

#include "common/formats/quant.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/quantize_activations.h"
#include "tools/kernel_bench/moe_fused_bench.h"
#include "tools/kernel_bench/delta_net_bench.h"
#include "tools/kernel_bench/backend_kernels_bench.h"
#include "tools/kernel_bench/gemm_prefill_bench.h"
#include "tools/kernel_bench/pdl_chain_bench.h"
#include "tools/kernel_bench/mixer_bench.h"
#include "tools/kernel_bench/template_rows.h"

namespace moraine::kernel_bench {
namespace {

using cuda::DeviceBuffer;

// Streams the buffer once with 16-byte loads, 4 in flight per thread; the XOR of everything is
// written only when it hits an impossible value, so the loads cannot be dropped.
__global__ void read_kernel(const uint4* __restrict__ src, size_t words, unsigned* sink) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  unsigned acc = 0;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < words; i += 4 * stride) {
    const uint4 a = __ldg(src + i), b = __ldg(src + i + stride), c = __ldg(src + i + 2 * stride),
                d = __ldg(src + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < words; i += stride) {
    const uint4 a = __ldg(src + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

class EventTimer {
 public:
  EventTimer() {
    CUDA_CHECK(cudaEventCreate(&start_));
    CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~EventTimer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;
  void start() { CUDA_CHECK(cudaEventRecord(start_)); }
  double stop_ms() {
    CUDA_CHECK(cudaEventRecord(stop_));
    CUDA_CHECK(cudaEventSynchronize(stop_));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
    return ms;
  }

 private:
  cudaEvent_t start_{}, stop_{};
};

// Runs fn(i) for i = 0.. until min_ms has passed (iteration count fixed from a first probe);
// returns milliseconds per call.
template <class Fn>
double time_calls(Fn&& fn, double min_ms) {
  for (int i = 0; i < 3; ++i) fn(i);
  EventTimer t;
  int calls = 8;
  for (;;) {
    t.start();
    for (int i = 0; i < calls; ++i) fn(i);
    const double ms = t.stop_ms();
    if (ms >= min_ms || calls >= (1 << 22)) return ms / calls;
    calls = static_cast<int>(std::min<double>(1 << 22, calls * std::max(2.0, 1.2 * min_ms / std::max(ms, 1e-3))));
  }
}

struct Bandwidth {
  double read_gbps, copy_gbps;
};

Bandwidth measure_bandwidth(double min_ms) {
  const size_t bytes = size_t{4} << 30;  // 4 GiB: 70x the L2
  DeviceBuffer<uint4> a(bytes / 16), b(bytes / 16);
  DeviceBuffer<unsigned> sink(1);
  CUDA_CHECK(cudaMemset(a.get(), 1, bytes));
  int device = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const double read_ms = time_calls(
      [&](int) {
        read_kernel<<<sms * 8, 512>>>(a.get(), bytes / 16, sink.get());
        CUDA_CHECK(cudaGetLastError());
      },
      min_ms);
  const double copy_ms = time_calls(
      [&](int) { CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice)); }, min_ms);
  return {static_cast<double>(bytes) / read_ms / 1e6, 2.0 * static_cast<double>(bytes) / copy_ms / 1e6};
}

struct Shape {
  const char* name;
  int64_t rows, n;
  int experts;  // matrices per call (selected out of a pool); 1 for a plain matrix
};

// A device region of `copies` matrices of rows x n, each made of quantized template rows.
DeviceBuffer<uint8_t> make_pool(TensorType t, int64_t rows, int64_t n, size_t copies) {
  constexpr int kTemplateRows = 64;
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  const size_t rb = row_bytes(t, n);
  std::vector<uint8_t> templ(rb * kTemplateRows);
  std::vector<float> f(static_cast<size_t>(n));
  for (int r = 0; r < kTemplateRows; ++r) {
    for (float& v : f) v = dist(rng);
    template_row(t, f.data(), n, templ.data() + static_cast<size_t>(r) * rb, rng);
  }
  std::vector<uint8_t> matrix(rb * static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(templ.data() + static_cast<size_t>(r % kTemplateRows) * rb, rb, matrix.data() + static_cast<size_t>(r) * rb);
  DeviceBuffer<uint8_t> pool(matrix.size() * copies);
  pool.upload(matrix.data(), matrix.size());
  for (size_t c = 1; c < copies; ++c)
    CUDA_CHECK(cudaMemcpy(pool.get() + c * matrix.size(), pool.get(), matrix.size(), cudaMemcpyDeviceToDevice));
  return pool;
}

struct Point {
  std::string format, shape;
  int64_t rows, n;
  int experts;
  double bytes_per_call, us_per_call, gbps;
};

Point bench_point(TensorType t, const Shape& s, const CudaBenchOptions& opt) {
  const size_t mat_bytes = row_bytes(t, s.n) * static_cast<size_t>(s.rows);
  const size_t copies = std::max<size_t>(static_cast<size_t>(2 * s.experts),
                                         (static_cast<size_t>(opt.set_mib) << 20) / mat_bytes);
  DeviceBuffer<uint8_t> pool = make_pool(t, s.rows, s.n, copies);

  const TensorType at = dot_activation_type(t);
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(s.n * s.experts));
  for (float& v : x) v = dist(rng);
  DeviceBuffer<float> dx(x.size());
  dx.upload(x.data(), x.size());
  DeviceBuffer<uint8_t> act(row_bytes(at, s.n) * static_cast<size_t>(s.experts));
  cuda::quantize_activations(at, dx.get(), act.get(), s.n, s.experts);
  DeviceBuffer<float> y(static_cast<size_t>(s.rows * s.experts));

  // Expert choices for many calls: s.experts distinct ids per call, drawn from the whole pool.
  constexpr int kChoiceSets = 4096;
  std::vector<int32_t> ids(static_cast<size_t>(kChoiceSets * s.experts));
  std::vector<int32_t> all(copies);
  for (size_t i = 0; i < copies; ++i) all[i] = static_cast<int32_t>(i);
  for (int c = 0; c < kChoiceSets; ++c) {
    std::shuffle(all.begin(), all.end(), rng);
    std::copy_n(all.begin(), s.experts, ids.begin() + static_cast<ptrdiff_t>(c) * s.experts);
  }
  DeviceBuffer<int32_t> dids(ids.size());
  dids.upload(ids.data(), ids.size());

  cuda::MatvecBatch batch;
  batch.count = s.experts;
  batch.weight_stride_bytes = static_cast<int64_t>(mat_bytes);
  batch.act_stride_bytes = static_cast<int64_t>(row_bytes(at, s.n));
  batch.out_stride = s.rows;
  const double ms = time_calls(
      [&](int i) {
        if (s.experts == 1) {
          cuda::matvec_quantized(t, pool.get() + (static_cast<size_t>(i) % copies) * mat_bytes, s.rows, s.n, act.get(), y.get());
        } else {
          batch.expert_ids = dids.get() + (i % kChoiceSets) * s.experts;
          cuda::matvec_quantized_batched(t, pool.get(), s.rows, s.n, act.get(), y.get(), batch);
        }
      },
      opt.min_ms);
  const double bytes = static_cast<double>(mat_bytes) * s.experts;
  return {std::string(type_name(t)), s.name, s.rows, s.n, s.experts, bytes, ms * 1e3, bytes / ms / 1e6};
}

}  // namespace

void add_cuda_subcommand(CLI::App& app, CudaBenchOptions& opt) {
  CLI::App* sub = app.add_subcommand("cuda", "decode matrix-vector kernels on the GPU: GB/s vs measured HBM bandwidth");
  sub->add_flag("--json", opt.json, "print one JSON object instead of a table");
  sub->add_option("--set-mib", opt.set_mib, "distinct weight MiB cycled per point (keep >> L2)")->check(CLI::Range(64, 65536));
  sub->add_option("--formats", opt.formats, "weight formats")->delimiter(',');
  sub->add_option("--min-ms", opt.min_ms, "timed milliseconds per point")->check(CLI::Range(1.0, 10000.0));
  sub->add_flag("--gemm-only", opt.gemm_only, "only the prefill GEMM section (gemm_prefill: cuBLAS on expanded weights)");
  sub->add_flag("--gemm-experts-only", opt.gemm.experts_only, "with --gemm-only: skip the dense shapes");
  sub->add_option("--gemm-profile", opt.gemm.profile_tokens,
                  "with --gemm-only: only the expert layer's default path at N tokens, one line (for a profiler)")
      ->check(CLI::Range(1LL, 65536LL));
  sub->add_flag("--moe-only", opt.moe_only, "only the fused MoE layer bench (moe_fused), after the bandwidth measure");
  sub->add_flag("--backend-only", opt.backend_only, "only the backend kernels section, after the bandwidth measure");
  sub->add_flag("--pdl-only", opt.pdl_only, "only the decode-chain section, PDL off vs on (pdl_chain_bench.h)");
  sub->add_flag("--mixer-only", opt.mixer_only, "only the attention/router small kernels, old vs new (mixer_bench.h)");
  sub->add_flag("--mixer-ncu", opt.mixer_ncu, "with --mixer-only: a few plain launches of each kernel, for ncu");
  sub->add_option("--moe-variants", opt.moe.variants, "fused MoE forms to time: all, or names of moe_fused_bench.cu's table")
      ->delimiter(',');
  sub->add_option("--moe-tokens", opt.moe.tokens, "fused MoE tokens per call (default 1,8)")->delimiter(',');
  sub->add_option("--moe-select", opt.moe.only, "fused MoE rows of one SHAPE,FORMAT only (e.g. qwen3-30b-a3b,q4_k)")
      ->delimiter(',')->expected(2);
  sub->add_flag("--moe-host-weights", opt.moe.host_weights,
                "fused MoE experts in mapped pinned host memory: the kernels read them over PCIe");
}

int run_cuda_bench(const CudaBenchOptions& opt) {
  std::string why;
  if (!cuda::device_available(&why)) throw std::runtime_error("no CUDA device: " + why);
  std::vector<TensorType> types;
  for (const std::string& f : opt.formats) {
    const auto t = type_from_name(f);
    if (!t || !cuda::matvec_supported(*t))
      throw std::invalid_argument("--formats: '" + f + "' has no CUDA matvec kernel (kernels/cuda/matvec.h lists them)");
    types.push_back(*t);
  }
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  if (opt.gemm_only) {  // compute-bound: no bandwidth measure needed
    std::printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    nlohmann::json j;
    run_gemm_prefill_bench(opt.min_ms, opt.gemm, opt.json ? &j : nullptr);
    if (opt.json) std::cout << j.dump(2) << "\n";
    return 0;
  }
  if (opt.mixer_only) {  // latency-bound small kernels: no bandwidth measure needed
    nlohmann::json j;
    run_mixer_bench(opt.min_ms, opt.mixer_ncu, opt.json ? &j : nullptr);
    if (opt.json) std::cout << j.dump(2) << "\n";
    return 0;
  }
  if (opt.pdl_only) {  // launch gaps: no bandwidth measure needed
    nlohmann::json j;
    run_pdl_chain_bench(opt.min_ms, opt.json ? &j : nullptr);
    if (opt.json) std::cout << j.dump(2) << "\n";
    return 0;
  }
  const Bandwidth bw = measure_bandwidth(opt.min_ms);
  if (opt.backend_only) {
    nlohmann::json j;
    run_backend_kernels_bench(opt.min_ms, bw.read_gbps, opt.json ? &j : nullptr);
    if (opt.json) std::cout << j.dump(2) << "\n";
    return 0;
  }
  if (opt.moe_only) {
    if (!opt.json) {
      std::printf("device %s, %d SMs; weight set %d MiB per point; read kernel %.0f GB/s\n", prop.name,
                  prop.multiProcessorCount, opt.set_mib, bw.read_gbps);
      run_moe_fused_bench(opt.min_ms, opt.set_mib, bw.read_gbps, nullptr, opt.moe);
      return 0;
    }
    nlohmann::json j;
    j["device"] = prop.name;
    j["read_gbps"] = bw.read_gbps;
    run_moe_fused_bench(opt.min_ms, opt.set_mib, bw.read_gbps, &j, opt.moe);
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  // Qwen3-30B-A3B shapes: attention/expert down (2048 x 768), a dense 4096 x 4096, and the 8
  // routed experts' gate (768 rows of 2048) in one launch.
  const Shape shapes[] = {{"2048x768", 2048, 768, 1}, {"4096x4096", 4096, 4096, 1}, {"8x(768x2048)", 768, 2048, 8}};
  std::vector<Point> points;
  for (TensorType t : types)
    for (const Shape& s : shapes) points.push_back(bench_point(t, s, opt));

  if (opt.json) {
    nlohmann::json j;
    j["device"] = prop.name;
    j["sms"] = prop.multiProcessorCount;
    j["l2_bytes"] = prop.l2CacheSize;
    j["read_gbps"] = bw.read_gbps;
    j["copy_gbps_read_plus_write"] = bw.copy_gbps;
    j["set_mib"] = opt.set_mib;
    for (const Point& p : points)
      j["results"].push_back({{"format", p.format}, {"shape", p.shape}, {"rows", p.rows}, {"n", p.n},
                              {"matrices", p.experts}, {"bytes_per_call", p.bytes_per_call},
                              {"us_per_call", p.us_per_call}, {"gbps", p.gbps},
                              {"share_of_read", p.gbps / bw.read_gbps}});
    run_delta_net_bench(opt.min_ms, &j);
    run_moe_fused_bench(opt.min_ms, opt.set_mib, bw.read_gbps, &j, opt.moe);
    run_backend_kernels_bench(opt.min_ms, bw.read_gbps, &j);
    run_gemm_prefill_bench(opt.min_ms, GemmBenchSelection{}, &j);
    run_pdl_chain_bench(opt.min_ms, &j);
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::printf("device %s, %d SMs, L2 %d MB; weight set %d MiB per point\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, opt.set_mib);
  std::printf("measured: read kernel %.0f GB/s, device copy %.0f GB/s (read + write)\n", bw.read_gbps, bw.copy_gbps);
  std::printf("%-6s %-14s %12s %10s %10s %8s\n", "format", "shape", "bytes/call", "us/call", "GB/s", "of read");
  for (const Point& p : points)
    std::printf("%-6s %-14s %12.0f %10.2f %10.0f %7.0f%%\n", p.format.c_str(), p.shape.c_str(), p.bytes_per_call,
                p.us_per_call, p.gbps, 100.0 * p.gbps / bw.read_gbps);
  run_delta_net_bench(opt.min_ms, nullptr);
  run_moe_fused_bench(opt.min_ms, opt.set_mib, bw.read_gbps, nullptr, opt.moe);
  run_backend_kernels_bench(opt.min_ms, bw.read_gbps, nullptr);
  run_gemm_prefill_bench(opt.min_ms, GemmBenchSelection{}, nullptr);
  run_pdl_chain_bench(opt.min_ms, nullptr);
  return 0;
}

}  // namespace moraine::kernel_bench
