// `moraine-kernel-bench cuda --mixer-only`: the small kernels of a decode layer's attention and
// router at Qwen3-30B-A3B shapes (hidden 2048, 32/4 heads of 128, 128 experts top 8), each old
// (mixer_bench_baseline.cu: the versions before this change) against new (the public functions
// in kernels/cuda/), from CUDA graphs of many launches replayed, without PDL for both (the
// graphs' programmatic edges made full: plain_graph.h), then new with it. Weight matrices cycle
// through enough distinct copies that every read comes from HBM, as in decode (48 layers of
// weights do not fit the 60 MB L2).
// --mixer-ncu instead launches each kernel a few times plainly (one graph of full edges), for
// `ncu --metrics gpu__time_duration.sum` (the per-kernel numbers of issue #5).
#include "tools/kernel_bench/mixer_bench.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "common/formats/tensor_type.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/matvec_float.h"
#include "kernels/cuda/qk_norm_rope_store.h"
#include "kernels/cuda/router.h"
#include "tools/kernel_bench/cuda_timing.h"
#include "tools/kernel_bench/mixer_bench_baseline.h"
#include "tools/kernel_bench/plain_graph.h"

namespace moraine::kernel_bench {
namespace {

using cuda::DeviceBuffer;

std::vector<float> random_floats(std::mt19937& rng, size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// `copies` copies of one [rows][n] matrix of type t (one row pattern of 16 distinct rows,
// repeated), back to back: call i reads copy i % copies.
DeviceBuffer<uint8_t> make_pool(TensorType t, int64_t rows, int64_t n, int copies, std::mt19937& rng) {
  const size_t rb = row_bytes(t, n);
  std::vector<uint8_t> templ(16 * rb);
  const std::vector<float> v = random_floats(rng, static_cast<size_t>(16 * n), 0.05f);
  for (int r = 0; r < 16; ++r) quantize_row(t, v.data() + r * n, templ.data() + r * rb, n);
  std::vector<uint8_t> matrix(static_cast<size_t>(rows) * rb);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(matrix.data() + r * rb, templ.data() + (r % 16) * rb, rb);
  DeviceBuffer<uint8_t> pool(matrix.size() * static_cast<size_t>(copies));
  for (int c = 0; c < copies; ++c)
    CUDA_CHECK(cudaMemcpy(pool.get() + c * matrix.size(), matrix.data(), matrix.size(), cudaMemcpyHostToDevice));
  return pool;
}

int copies_for(size_t bytes) { return static_cast<int>(std::max<size_t>(4, (512u << 20) / bytes + 1)); }

// Microseconds per launch of fn(i, stream) from a graph of `per_graph` launches (i = 0..), replayed;
// with the PDL edges as captured (pdl) or made full.
double graph_us(const std::function<void(int, cudaStream_t)>& fn, int per_graph, double min_ms, bool pdl) {
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < per_graph; ++i) fn(i, s);
  CUDA_CHECK(cudaStreamEndCapture(s, &g));
  if (!pdl) make_edges_full(g);
  cudaGraphExec_t ge;
  CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  const double ms = ms_per_call([&](int) { CUDA_CHECK(cudaGraphLaunch(ge, nullptr)); }, min_ms);
  CUDA_CHECK(cudaGraphExecDestroy(ge));
  CUDA_CHECK(cudaGraphDestroy(g));
  CUDA_CHECK(cudaStreamDestroy(s));
  return ms * 1e3 / per_graph;
}

// The floor for a matrix of `words` 16-byte words: each thread streams its share with 16-byte
// loads, all in flight at once (grid sized for it); the XOR is stored only on an impossible value.
__global__ void read_floor_kernel(const uint4* __restrict__ src, size_t words, unsigned* sink) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  unsigned acc = 0;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = i + k * stride < words ? __ldg(src + i + k * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int k = 0; k < 4; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

struct Row {
  std::string name;
  double bytes;  // read per launch (weights + activations)
  std::function<void(int, cudaStream_t)> old_fn, new_fn;
  std::function<std::string()> compare;  // after one old and one new call on the same inputs
};

template <class T>
std::vector<T> download(const DeviceBuffer<T>& b, size_t n) {
  std::vector<T> h(n);
  b.download(h.data(), n);
  return h;
}

std::string compare_floats(const std::vector<float>& a, const std::vector<float>& b) {
  if (std::memcmp(a.data(), b.data(), a.size() * 4) == 0) return "bits same";
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::fabs(double(a[i]) - b[i]) / std::max(1e-30, std::fabs(double(a[i]))));
  char buf[64];
  std::snprintf(buf, sizeof buf, "max rel diff %.2g", worst);
  return buf;
}

// The rows' lambdas own their buffers; bufs keeps them all alive until the end as well.
using Bufs = std::shared_ptr<std::vector<std::shared_ptr<void>>>;

void matvec_rows(std::mt19937& rng, const Bufs& bufs, std::vector<Row>& rows) {
  // The Q8_0 matvecs: q|k|v stacked (5120 x 2048) and o (2048 x 4096), 1, 4 and 16 tokens; the
  // LM head (151936 x 2048), 1 token; beside a plain read of the same bytes. Old and new are the
  // same kernel (the staged one; its before/after numbers are in matvec.cu's comment).
  struct Mv {
    const char* what;
    int rows, n;
  };
  for (const Mv mv : {Mv{"q8_0 qkv 5120x2048", 5120, 2048}, Mv{"q8_0 o 2048x4096", 2048, 4096},
                      Mv{"q8_0 lm head 151936x2048", 151936, 2048}}) {
    const size_t mbytes = row_bytes(TensorType::Q8_0, mv.n) * static_cast<size_t>(mv.rows);
    const int copies = copies_for(mbytes);
    auto pool = std::make_shared<DeviceBuffer<uint8_t>>(make_pool(TensorType::Q8_0, mv.rows, mv.n, copies, rng));
    bufs->push_back(pool);
    const bool lm_head = mv.rows > 100000;  // one token only: the others' batches are the point
    for (int tokens : {1, 4, 16}) {
      if (lm_head && tokens > 1) continue;
      const size_t arb = row_bytes(TensorType::Q8_0, mv.n);
      std::vector<uint8_t> act(arb * tokens);
      const std::vector<float> x = random_floats(rng, static_cast<size_t>(mv.n) * tokens);
      for (int t = 0; t < tokens; ++t) quantize_row(TensorType::Q8_0, x.data() + t * mv.n, act.data() + t * arb, mv.n);
      auto dact = std::make_shared<DeviceBuffer<uint8_t>>(act.size());
      dact->upload(act.data(), act.size());
      auto y_old = std::make_shared<DeviceBuffer<float>>(static_cast<size_t>(mv.rows) * tokens);
      auto y_new = std::make_shared<DeviceBuffer<float>>(static_cast<size_t>(mv.rows) * tokens);
      bufs->push_back(dact);
      bufs->push_back(y_old);
      bufs->push_back(y_new);
      Row r;
      r.name = std::string(mv.what) + " x" + std::to_string(tokens);
      r.bytes = double(mbytes) + double(act.size());
      const int nr = mv.rows, nn = mv.n;
      auto matvec_into = [=](const std::shared_ptr<DeviceBuffer<float>>& y) {
        return [=](int i, cudaStream_t s) {
          cuda::MatvecBatch b;
          b.count = tokens;
          b.act_stride_bytes = static_cast<int64_t>(arb);
          b.out_stride = nr;
          cuda::matvec_quantized_batched(TensorType::Q8_0, pool->get() + (i % copies) * mbytes, nr, nn, dact->get(),
                                         y->get(), b, s);
        };
      };
      r.old_fn = matvec_into(y_old);
      r.new_fn = matvec_into(y_new);
      r.compare = [=] {
        return compare_floats(download(*y_old, size_t(nr) * tokens), download(*y_new, size_t(nr) * tokens));
      };
      rows.push_back(r);
    }
    if (!lm_head) {  // the plain read of the same bytes: what the matvec could reach
      auto sink = std::make_shared<DeviceBuffer<unsigned>>(1);
      bufs->push_back(sink);
      Row f;
      f.name = std::string("  floor: read ") + std::to_string(mbytes >> 10) + " KiB";
      f.bytes = double(mbytes);
      const size_t words = mbytes / 16;
      const unsigned grid = static_cast<unsigned>(std::min<size_t>((words + 1023) / 1024, 132 * 8));
      f.old_fn = f.new_fn = [=](int i, cudaStream_t s) {
        read_floor_kernel<<<grid, 256, 0, s>>>(reinterpret_cast<const uint4*>(pool->get() + (i % copies) * mbytes), words,
                                               sink->get());
        CUDA_CHECK(cudaGetLastError());
      };
      f.compare = [] { return std::string("-"); };
      rows.push_back(f);
    }
  }
}

// The F32 router matvec, 128 x 2048, and the softmax top 8 of 128.
void router_rows(std::mt19937& rng, const Bufs& bufs, std::vector<Row>& rows) {
  {  // The F32 router matvec, 128 x 2048.
    const int nr = 128, nn = 2048;
    const size_t mbytes = size_t{4} * nr * nn;
    const int copies = copies_for(mbytes);
    auto pool = std::make_shared<DeviceBuffer<uint8_t>>(make_pool(TensorType::F32, nr, nn, copies, rng));
    const std::vector<float> x = random_floats(rng, nn);
    auto dx = std::make_shared<DeviceBuffer<float>>(nn);
    dx->upload(x.data(), x.size());
    auto y_old = std::make_shared<DeviceBuffer<float>>(nr), y_new = std::make_shared<DeviceBuffer<float>>(nr);
    bufs->insert(bufs->end(), {pool, dx, y_old, y_new});
    Row r;
    r.name = "f32 router 128x2048";
    r.bytes = double(mbytes) + 4.0 * nn;
    r.old_fn = [=](int i, cudaStream_t s) {
      baseline::matvec_f32(reinterpret_cast<const float*>(pool->get() + (i % copies) * mbytes), nr, nn, dx->get(),
                           y_old->get(), s);
    };
    r.new_fn = [=](int i, cudaStream_t s) {
      cuda::MatvecBatch b;
      cuda::matvec_float_batched(TensorType::F32, pool->get() + (i % copies) * mbytes, nr, nn, dx->get(), y_new->get(),
                                 b, s);
    };
    r.compare = [=] { return compare_floats(download(*y_old, nr), download(*y_new, nr)); };
    rows.push_back(r);
  }

  for (int tokens : {1, 16}) {  // softmax + top 8 of 128
    const int ne = 128, k = 8;
    const std::vector<float> lg = random_floats(rng, static_cast<size_t>(ne) * tokens);
    auto dl = std::make_shared<DeviceBuffer<float>>(lg.size());
    dl->upload(lg.data(), lg.size());
    auto c_old = std::make_shared<DeviceBuffer<int32_t>>(size_t(k) * tokens), c_new = std::make_shared<DeviceBuffer<int32_t>>(size_t(k) * tokens);
    auto w_old = std::make_shared<DeviceBuffer<float>>(size_t(k) * tokens), w_new = std::make_shared<DeviceBuffer<float>>(size_t(k) * tokens);
    bufs->insert(bufs->end(), {dl, c_old, c_new, w_old, w_new});
    Row r;
    r.name = "route 128 top8 x" + std::to_string(tokens);
    r.bytes = 4.0 * ne * tokens;
    r.old_fn = [=](int, cudaStream_t s) { baseline::route(dl->get(), tokens, ne, k, true, c_old->get(), w_old->get(), s); };
    r.new_fn = [=](int, cudaStream_t s) { cuda::route_softmax_top_k(dl->get(), tokens, ne, k, true, c_new->get(), w_new->get(), s); };
    r.compare = [=] {
      const bool ids = download(*c_old, size_t(k) * tokens) == download(*c_new, size_t(k) * tokens);
      return std::string(ids ? "ids same, " : "IDS DIFFER, ") +
             compare_floats(download(*w_old, size_t(k) * tokens), download(*w_new, size_t(k) * tokens));
    };
    rows.push_back(r);
  }
}

void qk_norm_rope_store_rows(std::mt19937& rng, const Bufs& bufs, std::vector<Row>& rows) {
  for (int tokens : {1, 16}) {  // qk_norm_rope_store, 32/4 heads of 128, position 517
    const int64_t nh = 32, nkv = 4, hd = 128, max_pos = 4096;
    const int64_t qkv_row = (nh + 2 * nkv) * hd;
    const std::vector<float> qkv = random_floats(rng, static_cast<size_t>(qkv_row * tokens));
    const std::vector<float> norms = random_floats(rng, 2 * hd);
    auto dqkv = std::make_shared<DeviceBuffer<float>>(qkv.size());
    dqkv->upload(qkv.data(), qkv.size());
    auto dn = std::make_shared<DeviceBuffer<float>>(norms.size());
    dn->upload(norms.data(), norms.size());
    const int32_t pos = 517;
    auto dpos = std::make_shared<DeviceBuffer<int32_t>>(1);
    dpos->upload(&pos, 1);
    std::vector<std::shared_ptr<DeviceBuffer<float>>> outs;
    for (int i = 0; i < 2; ++i) {  // old, new: q_out, k cache, v cache
      outs.push_back(std::make_shared<DeviceBuffer<float>>(static_cast<size_t>(tokens * nh * hd)));
      outs.push_back(std::make_shared<DeviceBuffer<float>>(static_cast<size_t>(max_pos * nkv * hd)));
      outs.push_back(std::make_shared<DeviceBuffer<float>>(static_cast<size_t>(max_pos * nkv * hd)));
      for (size_t j = 1; j <= 3; ++j) outs[outs.size() - j]->fill_bytes(0);
    }
    bufs->insert(bufs->end(), {dqkv, dn, dpos});
    for (auto& o : outs) bufs->push_back(o);
    auto args = [=](int which) {
      cuda::QkNormRopeStoreArgs a;
      a.q = dqkv->get();
      a.q_row_stride = qkv_row;
      a.q_head_stride = hd;
      a.k = dqkv->get() + nh * hd;
      a.k_row_stride = qkv_row;
      a.v = dqkv->get() + (nh + nkv) * hd;
      a.v_row_stride = qkv_row;
      a.q_norm = dn->get();
      a.k_norm = dn->get() + hd;
      a.rows = tokens;
      a.n_head = nh;
      a.n_head_kv = nkv;
      a.head_dim = hd;
      a.n_rot = hd;
      a.pos0_dev = dpos->get();
      a.freq_base = 1e6;
      a.max_pos = max_pos;
      a.q_out = outs[3 * which]->get();
      a.k_cache = outs[3 * which + 1]->get();
      a.v_cache = outs[3 * which + 2]->get();
      return a;
    };
    Row r;
    r.name = "qk_norm_rope_store x" + std::to_string(tokens);
    r.bytes = 4.0 * qkv_row * tokens;
    r.old_fn = [=](int, cudaStream_t s) { baseline::qk_norm_rope_store(args(0), s); };
    r.new_fn = [=](int, cudaStream_t s) { cuda::qk_norm_rope_store(args(1), s); };
    r.compare = [=] {
      const size_t nq = static_cast<size_t>(tokens * nh * hd), nc = static_cast<size_t>(max_pos * nkv * hd);
      std::string q = compare_floats(download(*outs[0], nq), download(*outs[3], nq));
      std::string k = compare_floats(download(*outs[1], nc), download(*outs[4], nc));
      std::string v = compare_floats(download(*outs[2], nc), download(*outs[5], nc));
      return "q " + q + ", k " + k + ", v " + v;
    };
    rows.push_back(r);
  }
}

}  // namespace

void run_mixer_bench(double min_ms, bool ncu_mode, nlohmann::json* json) {
  std::mt19937 rng(5);
  std::vector<Row> rows;
  const Bufs bufs = std::make_shared<std::vector<std::shared_ptr<void>>>();
  matvec_rows(rng, bufs, rows);
  router_rows(rng, bufs, rows);
  qk_norm_rope_store_rows(rng, bufs, rows);

  if (ncu_mode) {  // plain launches for ncu: 3 of each, old then new (other copies), without PDL
    for (size_t k = 0; k < rows.size(); ++k) {
      std::printf("mixer ncu row %zu: %s\n", k, rows[k].name.c_str());
      run_plain([&](cudaStream_t s) {
        for (int i = 0; i < 3; ++i) rows[k].old_fn(i, s);
        for (int i = 3; i < 6; ++i) rows[k].new_fn(i, s);
      });
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    std::printf("mixer ncu mode: %zu kernels x 3 launches, old then new\n", rows.size());
    return;
  }

  if (json == nullptr)
    std::printf("\n%-26s %9s %9s %9s %8s %8s %8s  %s\n", "mixer kernel (graph)", "old us", "new us", "new+pdl", "old GB/s",
                "new GB/s", "speedup", "old vs new output");
  for (const Row& r : rows) {
    r.old_fn(0, nullptr);
    r.new_fn(0, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::string cmp = r.compare();
    constexpr int kPerGraph = 128;  // router: 128 distinct MB per replay, more than the L2
    const double t_old = graph_us(r.old_fn, kPerGraph, min_ms, false);
    const double t_new = graph_us(r.new_fn, kPerGraph, min_ms, false);
    const double t_pdl = graph_us(r.new_fn, kPerGraph, min_ms, true);
    if (json != nullptr) {
      (*json)["mixer"][r.name] = {{"old_us", t_old}, {"new_us", t_new}, {"new_pdl_us", t_pdl}, {"bytes", r.bytes},
                                  {"compare", cmp}};
    } else {
      std::printf("%-26s %9.2f %9.2f %9.2f %8.0f %8.0f %7.2fx  %s\n", r.name.c_str(), t_old, t_new, t_pdl,
                  r.bytes / t_old * 1e-3, r.bytes / t_new * 1e-3, t_old / t_new, cmp.c_str());
    }
  }
  run_mixer_chain_bench(min_ms, json);
}

}  // namespace moraine::kernel_bench
