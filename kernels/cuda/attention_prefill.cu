#include "kernels/cuda/attention_prefill.h"

#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"

namespace moraine::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// A cache element as float: exact for a half.
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }

// Tile sizes for head dims up to HDM (128, 256 or 512): the query tile holds 8192 floats and the
// K and V tiles 4096 each (8192 at 512, where 8 positions would idle half the score threads),
// whatever the head dim, so shared memory stays at 68-99 KB (2-3 CTAs per SM).
template <int HDM>
struct Tile {
  static constexpr int kQueries = 8192 / HDM;                     // 64, 32, 16
  static constexpr int kPositions = HDM == 512 ? 16 : 4096 / HDM;  // 32, 16, 16
  // Scores: a 16 x 16 grid of threads, each kQ x kP of them (queries tq + 16 i, positions tk + 16 k).
  static constexpr int kQ = kQueries / 16, kP = kPositions / 16;
  // Softmax and P.V: warp w owns queries w * kQW + i; lane l owns dims l + 32 e.
  static constexpr int kQW = kQueries / kWarps, kDims = HDM / 32;
  // Q and K rows padded by one float: the score threads of a warp read 2 Q rows and 16 K rows at
  // the same dim, which then fall in distinct banks.
  static constexpr int kQStride = HDM + 1, kKStride = HDM + 1;
  static constexpr int kFloats = kQueries * kQStride + kPositions * kKStride + kPositions * HDM + kQueries * kPositions;
  static_assert(kQ >= 1 && kP >= 1 && kQW >= 1 && kPositions <= 32, "tile shape");
};

// One CTA per (tile of kQueries queries of kv head g, g). Queries of kv head g are numbered
// qq = t * group + (h - g * group), so a tile shares each K/V tile between the GQA group's heads
// and between rows. Online softmax per query: running max m and sum l, output rescaled by
// exp(m_old - m_new) whenever a KV tile raises the max. KV: the cache element (float or __half),
// widened to float when staged, so a half cache gives the float cache's bits for the same values.
// kOss (gpt-oss, a separate instantiation: the others' code is unchanged): sinks and the window.
template <int HDM, class KV, bool kOss = false>
__global__ void __launch_bounds__(kThreads)
    attention_prefill_kernel(const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc,
                             int64_t n_head, int64_t group, int64_t hd, int64_t kv_stride, float scale, int64_t n,
                             int64_t n_past, const float* __restrict__ gate, int64_t gate_row_stride,
                             int64_t gate_head_stride, const float* __restrict__ sinks, int64_t window,
                             float* __restrict__ out) {
  using T = Tile<HDM>;
  extern __shared__ float smem[];
  float* qs = smem;                                   // [kQueries][kQStride]
  float* ks = qs + T::kQueries * T::kQStride;         // [kPositions][kKStride]
  float* vs = ks + T::kPositions * T::kKStride;       // [kPositions][HDM]
  float* ss = vs + T::kPositions * HDM;               // [kQueries][kPositions]: scores, then p
  const int64_t g = blockIdx.y;
  // The last tiles see the most positions: launch them first so they do not trail the grid.
  const int64_t q0 = (static_cast<int64_t>(gridDim.x) - 1 - blockIdx.x) * T::kQueries;
  const int64_t total = n * group;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int tq = tid / 16, tk = tid % 16;

  for (int i = tid; i < T::kQueries * HDM; i += kThreads) {
    const int qq = i / HDM, d = i % HDM;
    const int64_t gq = q0 + qq;
    float v = 0.0f;
    if (gq < total && d < hd) v = q[((gq / group) * n_head + g * group + gq % group) * hd + d];
    qs[qq * T::kQStride + d] = v;
  }
  const int64_t n_kv = n_past + (min(q0 + T::kQueries, total) - 1) / group + 1;  // the tile's last query
  int64_t limit[T::kQ];  // positions visible to the score thread's queries (0 past the last query)
  int64_t from[T::kQ];   // and the first of them (a sliding window's; 0 without)
#pragma unroll
  for (int i = 0; i < T::kQ; ++i) {
    const int64_t gq = q0 + tq + 16 * i;
    limit[i] = gq < total ? n_past + gq / group + 1 : 0;
    from[i] = kOss && window > 0 ? max(int64_t{0}, limit[i] - window) : 0;
  }
  // A sliding window: the KV tiles start at the one holding the tile's first query's first position.
  const int64_t kb0 =
      kOss && window > 0 ? max(int64_t{0}, n_past + q0 / group + 1 - window) / T::kPositions * T::kPositions : 0;
  float m[T::kQW], l[T::kQW], acc[T::kQW][T::kDims];
  bool live[T::kQW];
#pragma unroll
  for (int i = 0; i < T::kQW; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
    live[i] = q0 + warp * T::kQW + i < total;
#pragma unroll
    for (int e = 0; e < T::kDims; ++e) acc[i][e] = 0.0f;
  }

  for (int64_t kb = kb0; kb < n_kv; kb += T::kPositions) {
    __syncthreads();  // the previous tile's K, V and p are consumed (and, first, Q is stored)
    for (int i = tid; i < T::kPositions * HDM; i += kThreads) {
      const int r = i / HDM, d = i % HDM;
      const int64_t j = kb + r;
      const bool in = j < n_kv && d < hd;  // never read past the filled cache; zeros stay finite
      const int64_t off = j * kv_stride + g * hd + d;
      ks[r * T::kKStride + d] = in ? widen(kc[off]) : 0.0f;
      vs[r * HDM + d] = in ? widen(vc[off]) : 0.0f;
    }
    __syncthreads();

    float a[T::kQ][T::kP];
#pragma unroll
    for (int i = 0; i < T::kQ; ++i)
#pragma unroll
      for (int k = 0; k < T::kP; ++k) a[i][k] = 0.0f;
#pragma unroll 4
    for (int64_t d = 0; d < hd; ++d) {
      float qv[T::kQ], kv[T::kP];
#pragma unroll
      for (int i = 0; i < T::kQ; ++i) qv[i] = qs[(tq + 16 * i) * T::kQStride + d];
#pragma unroll
      for (int k = 0; k < T::kP; ++k) kv[k] = ks[(tk + 16 * k) * T::kKStride + d];
#pragma unroll
      for (int i = 0; i < T::kQ; ++i)
#pragma unroll
        for (int k = 0; k < T::kP; ++k) a[i][k] = fmaf(qv[i], kv[k], a[i][k]);
    }
#pragma unroll
    for (int i = 0; i < T::kQ; ++i)
#pragma unroll
      for (int k = 0; k < T::kP; ++k)
        ss[(tq + 16 * i) * T::kPositions + tk + 16 * k] =
            kb + tk + 16 * k < limit[i] && (!kOss || kb + tk + 16 * k >= from[i]) ? a[i][k] * scale : -INFINITY;
    __syncthreads();

#pragma unroll
    for (int i = 0; i < T::kQW; ++i) {
      float* row = ss + (warp * T::kQW + i) * T::kPositions;
      if (!live[i]) {  // a query past the last row: p = 0 keeps its (unused) sums finite
        if (lane < T::kPositions) row[lane] = 0.0f;
        continue;
      }
      const float s = lane < T::kPositions ? row[lane] : -INFINITY;
      float tmax = s;
      for (int off = 16; off > 0; off /= 2) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
      // Finite without a window: the first KV tile holds position 0, visible to every live query.
      // In a sliding window a query's first tiles may all be masked: mn stays -inf, p 0, corr 1.
      const float mn = fmaxf(m[i], tmax);
      const float mn_e = kOss && mn == -INFINITY ? 0.0f : mn;
      const float p = expf(s - mn_e);  // 0 for a masked position
      float ps = p;
      for (int off = 16; off > 0; off /= 2) ps += __shfl_xor_sync(0xffffffffu, ps, off);
      const float corr = kOss && mn == -INFINITY ? 1.0f : expf(m[i] - mn);  // 0 on the first tile (m = -inf)
      l[i] = l[i] * corr + ps;
      m[i] = mn;
      if (lane < T::kPositions) row[lane] = p;
#pragma unroll
      for (int e = 0; e < T::kDims; ++e) acc[i][e] *= corr;
    }
    __syncwarp();
    const float* prow = ss + warp * T::kQW * T::kPositions;
#pragma unroll 4
    for (int j = 0; j < T::kPositions; ++j) {
      float p[T::kQW];
#pragma unroll
      for (int i = 0; i < T::kQW; ++i) p[i] = prow[i * T::kPositions + j];
#pragma unroll
      for (int e = 0; e < T::kDims; ++e) {
        const float v = vs[j * HDM + lane + 32 * e];
#pragma unroll
        for (int i = 0; i < T::kQW; ++i) acc[i][e] = fmaf(p[i], v, acc[i][e]);
      }
    }
  }

#pragma unroll
  for (int i = 0; i < T::kQW; ++i) {
    if (!live[i]) continue;
    const int64_t gq = q0 + warp * T::kQW + i, t = gq / group, h = g * group + gq % group;
    float inv = 1.0f / l[i], rescale = 1.0f;
    if (kOss && sinks != nullptr) {   // the sink's logit joins the softmax: its exp in the denominator only
      const float m_s = fmaxf(m[i], sinks[h]);
      rescale = expf(m[i] - m_s);
      inv = 1.0f / (l[i] * rescale + expf(sinks[h] - m_s));
    }
#pragma unroll
    for (int e = 0; e < T::kDims; ++e) {
      const int64_t d = lane + 32 * e;
      if (d >= hd) continue;
      float o = kOss && sinks != nullptr ? acc[i][e] * rescale * inv : acc[i][e] * inv;
      if (gate != nullptr) o *= 1.0f / (1.0f + expf(-gate[t * gate_row_stride + h * gate_head_stride + d]));
      out[(t * n_head + h) * hd + d] = o;
    }
  }
}

template <int HDM, class KV>
void launch(const AttentionShape& s, const float* q, const KV* k_cache, const KV* v_cache, int64_t n,
            int64_t n_past, const float* gate, int64_t gate_row_stride, int64_t gate_head_stride, float* out,
            cudaStream_t stream) {
  using T = Tile<HDM>;
  const int64_t group = s.n_head / s.n_head_kv;
  const int64_t tiles = (n * group + T::kQueries - 1) / T::kQueries;
  if (tiles > 0x7fffffff || s.n_head_kv > 65535)
    throw std::invalid_argument("attention_prefill: grid of " + std::to_string(tiles) + " x " +
                                std::to_string(s.n_head_kv) + " CTAs is too large");
  const int smem = static_cast<int>(T::kFloats * sizeof(float));
  // Above the default 48 KB: opt in (a host-side attribute, cheap enough per call).
  const bool oss = s.sinks != nullptr || s.window > 0;
  const auto kernel = oss ? attention_prefill_kernel<HDM, KV, true> : attention_prefill_kernel<HDM, KV, false>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(s.n_head_kv));
  kernel<<<grid, kThreads, smem, stream>>>(q, k_cache, v_cache, s.n_head, group, s.head_dim,
                                                                  s.kv_stride, s.scale, n, n_past, gate,
                                                                  gate_row_stride, gate_head_stride, s.sinks, s.window,
                                                                  out);
  CUDA_CHECK(cudaGetLastError());
}

template <class KV>
void attention_prefill_impl(const AttentionShape& s, const float* q, const KV* k_cache, const KV* v_cache, int64_t n,
                            int64_t n_past, const float* gate, int64_t gate_row_stride, int64_t gate_head_stride,
                            float* out, cudaStream_t stream) {
  if (s.n_head <= 0 || s.n_head_kv <= 0 || s.n_head % s.n_head_kv != 0 || s.head_dim <= 0 ||
      s.head_dim > kAttentionPrefillMaxHeadDim || s.kv_stride < s.n_head_kv * s.head_dim || n <= 0 || n_past < 0 ||
      s.window < 0)
    throw std::invalid_argument("attention_prefill: bad shape (n_head=" + std::to_string(s.n_head) +
                                ", n_head_kv=" + std::to_string(s.n_head_kv) + ", head_dim=" +
                                std::to_string(s.head_dim) + ", kv_stride=" + std::to_string(s.kv_stride) +
                                ", n=" + std::to_string(n) + ", n_past=" + std::to_string(n_past) + ")");
  if (s.head_dim <= 128)
    launch<128, KV>(s, q, k_cache, v_cache, n, n_past, gate, gate_row_stride, gate_head_stride, out, stream);
  else if (s.head_dim <= 256)
    launch<256, KV>(s, q, k_cache, v_cache, n, n_past, gate, gate_row_stride, gate_head_stride, out, stream);
  else
    launch<512, KV>(s, q, k_cache, v_cache, n, n_past, gate, gate_row_stride, gate_head_stride, out, stream);
}

}  // namespace

void attention_prefill(const AttentionShape& s, const float* q, const float* k_cache, const float* v_cache, int64_t n,
                       int64_t n_past, const float* gate, int64_t gate_row_stride, int64_t gate_head_stride,
                       float* out, cudaStream_t stream) {
  attention_prefill_impl(s, q, k_cache, v_cache, n, n_past, gate, gate_row_stride, gate_head_stride, out, stream);
}

void attention_prefill(const AttentionShape& s, const float* q, const __half* k_cache, const __half* v_cache, int64_t n,
                       int64_t n_past, const float* gate, int64_t gate_row_stride, int64_t gate_head_stride,
                       float* out, cudaStream_t stream) {
  attention_prefill_impl(s, q, k_cache, v_cache, n, n_past, gate, gate_row_stride, gate_head_stride, out, stream);
}

}  // namespace moraine::cuda
