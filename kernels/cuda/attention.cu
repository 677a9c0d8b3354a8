#include "kernels/cuda/attention.h"

#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"

namespace moraine::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
// Queries whose output a thread accumulates at once in the P.V phase of the shared kernel: a V
// element is loaded once per block of this many queries (8 = Qwen3's 32 q heads over 4 kv heads).
constexpr int kQueryBlock = 8;
// Shared-memory floats of the shared kernel's query records (q and scores), kept under the 48 KB
// that needs no opt-in so the launch stays a plain, capturable kernel launch.
constexpr int64_t kSharedQueryFloats = 11264;
constexpr unsigned kNaNBits = 0x7fc00000u;

// Where the position count comes from: the host value, or (graph-safe) a device int32 checked
// against the capacity the launch was sized for.
struct PastSource {
  int64_t host = 0;
  const int32_t* dev = nullptr;
  int64_t max_ctx = 0;
};

// A cache element as float: exact for a half.
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }

// Live n_past, or -1 when the device value is outside 0 .. max_ctx - n.
__device__ __forceinline__ int64_t live_n_past(const PastSource& src, int64_t n) {
  if (src.dev == nullptr) return src.host;
  const int64_t p = *src.dev;
  return p < 0 || p + n > src.max_ctx ? -1 : p;
}

__device__ __forceinline__ float block_reduce(float v, float* red, bool is_max) {
  for (int off = 16; off > 0; off /= 2) {
    const float o = __shfl_xor_sync(0xffffffffu, v, off);
    v = is_max ? fmaxf(v, o) : v + o;
  }
  __syncthreads();  // red may still be read from the previous reduction
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < kWarps; ++w) r = is_max ? fmaxf(r, red[w]) : r + red[w];
  return r;
}

// The kernel before GQA sharing (attention_unshared): one CTA per (query row, head, chunk). Its
// arithmetic is the spec the shared kernel reproduces bit for bit. Partial record per (query row,
// head, chunk): [max, sum, out[head_dim]].
__global__ void __launch_bounds__(kThreads)
    attention_chunk_kernel(const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc,
                           int64_t n_head, int64_t group, int64_t hd, int64_t kv_stride, float scale,
                           int64_t n_past, int64_t max_chunks, float* __restrict__ part) {
  extern __shared__ float smem[];
  float* qs = smem;                       // [hd]
  float* sc = qs + hd;                    // [kAttentionChunk]
  __shared__ float red[kWarps];
  const int64_t qi = blockIdx.x;          // t * n_head + h
  const int64_t chunk = blockIdx.y;
  const int64_t t = qi / n_head, h = qi % n_head, g = h / group;
  const int64_t n_kv = n_past + t + 1;
  float* rec = part + (qi * max_chunks + chunk) * (hd + 2);
  const int64_t j0 = chunk * kAttentionChunk;
  if (j0 >= n_kv) return;  // the merge reads only chunks below ceil(n_kv / chunk)
  const int64_t cnt = min(kAttentionChunk, n_kv - j0);
  for (int64_t d = threadIdx.x; d < hd; d += kThreads) qs[d] = q[qi * hd + d];
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t j = warp; j < cnt; j += kWarps) {
    const float* kj = kc + (j0 + j) * kv_stride + g * hd;
    float s = 0.0f;
    for (int64_t d = lane; d < hd; d += 32) s = fmaf(qs[d], kj[d], s);
    for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) sc[j] = s * scale;
  }
  __syncthreads();
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < cnt; j += kThreads) mx = fmaxf(mx, sc[j]);
  mx = block_reduce(mx, red, true);
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < cnt; j += kThreads) {
    const float p = expf(sc[j] - mx);
    sc[j] = p;
    sum += p;
  }
  sum = block_reduce(sum, red, false);  // its barriers also publish sc
  for (int64_t d = threadIdx.x; d < hd; d += kThreads) {
    float o = 0.0f;
    for (int64_t j = 0; j < cnt; ++j) o = fmaf(sc[j], vc[(j0 + j) * kv_stride + g * hd + d], o);
    rec[2 + d] = o;
  }
  if (threadIdx.x == 0) {
    rec[0] = mx;
    rec[1] = sum;
  }
}

// GQA-shared chunk kernel: one CTA per (kv head g, slice of its queries, chunk). The queries of kv
// head g are numbered qq = t * group + (h - g * group) over the pass's rows; a slice is a run of
// up to `per_cta` of them. K row j is loaded once (into registers, a warp per position) and dotted
// with every query; V element (j, d) once per block of kQueryBlock queries. Each query's numbers
// follow attention_chunk_kernel's exact order: the dot as lane-strided fma chains plus the same
// xor tree; the max (order-free); the sum as 128 per-thread partials (positions tid, tid + 128),
// each warp's xor tree, then warps 0..3 added in order; the output as one fma chain over the
// chunk's positions in order. The records land where attention_chunk_kernel puts them. KV: the
// cache element (float or __half), widened exactly on load, so a half cache gives the float
// cache's bits for the same values.
// kOss (gpt-oss, a separate instantiation: the others' code is unchanged): the sliding window.
template <class KV, bool kOss = false>
__global__ void __launch_bounds__(kThreads)
    attention_chunk_shared_kernel(const float* __restrict__ q, const KV* __restrict__ kc,
                                  const KV* __restrict__ vc, int64_t n_head, int64_t group, int64_t hd,
                                  int64_t kv_stride, float scale, PastSource past, int64_t n_rows, int64_t per_cta,
                                  int64_t slices, int64_t max_chunks, int64_t window, float* __restrict__ part) {
  extern __shared__ float smem[];
  const int64_t g = blockIdx.x / slices, q0 = (blockIdx.x % slices) * per_cta;
  const int64_t chunk = blockIdx.y, j0 = chunk * kAttentionChunk;
  const int64_t n_past = live_n_past(past, n_rows);
  const int64_t nq = min(per_cta, n_rows * group - q0);
  if (n_past < 0 || nq <= 0) return;
  // Rows grow along qq, so the slice's last query sees the most positions.
  const int64_t cmax = min(kAttentionChunk, n_past + (q0 + nq - 1) / group + 1 - j0);
  if (cmax <= 0) return;  // past every query's live length: the merge reads no record here
  // A sliding window (window > 0): query qq sees positions from n_past + qq / group + 1 - window on,
  // growing along qq; a chunk wholly below the slice's first query's is read by no merge.
  if (kOss && window > 0 && j0 + kAttentionChunk <= n_past + q0 / group + 1 - window) return;
  float* qs = smem;                        // [nq][hd]
  float* sc = qs + per_cta * hd;           // [nq][kAttentionChunk]
  __shared__ int cnt[kSharedQueryFloats / (kAttentionChunk + 1)];
  __shared__ int first[kOss ? kSharedQueryFloats / (kAttentionChunk + 1) : 1];   // the window's first position - j0 (<= 0: none masked)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t i = threadIdx.x; i < nq * hd; i += kThreads) {
    const int64_t qq = q0 + i / hd, t = qq / group, h = g * group + qq % group;
    qs[i] = q[(t * n_head + h) * hd + i % hd];
  }
  for (int64_t i = threadIdx.x; i < nq; i += kThreads) {
    cnt[i] = static_cast<int>(min(kAttentionChunk, n_past + (q0 + i) / group + 1 - j0));  // <= 0: no positions
    if constexpr (kOss) {
      const int64_t f = n_past + (q0 + i) / group + 1 - window - j0;
      first[i] = window > 0 ? static_cast<int>(max(int64_t{-1}, min(int64_t{kAttentionChunk}, f))) : -1;
    }
  }
  __syncthreads();

  // Scores: warp w takes positions w, w + 4, ...; lane l holds K dims l, l + 32, ... in registers
  // (the next position's loaded while this one is used), dotted with kQueryBlock queries at once
  // so their fma chains and xor trees interleave instead of waiting on each other.
  constexpr int kMaxPerLane = static_cast<int>(kAttentionMaxHeadDim / 32);
  float kr[kMaxPerLane] = {}, kn[kMaxPerLane] = {};
  if (warp < cmax) {
    const KV* kj = kc + (j0 + warp) * kv_stride + g * hd;
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) kr[e] = lane + 32 * e < hd ? widen(kj[lane + 32 * e]) : 0.0f;
  }
  for (int64_t j = warp; j < cmax; j += kWarps) {
    if (j + kWarps < cmax) {
      const KV* kj = kc + (j0 + j + kWarps) * kv_stride + g * hd;
#pragma unroll
      for (int e = 0; e < kMaxPerLane; ++e) kn[e] = lane + 32 * e < hd ? widen(kj[lane + 32 * e]) : 0.0f;
    }
    for (int64_t ib = 0; ib < nq; ib += kQueryBlock) {
      const int64_t last = min(ib + kQueryBlock, nq) - 1;
      // The block's last query sees the most positions; a later block may still see j (the
      // counts grow along the queries), so skip this block only. Warp-uniform.
      if (j >= cnt[last]) continue;
      float sv[kQueryBlock];
#pragma unroll
      for (int i = 0; i < kQueryBlock; ++i) sv[i] = 0.0f;
#pragma unroll
      for (int e = 0; e < kMaxPerLane; ++e) {
        if (lane + 32 * e >= hd) break;
#pragma unroll
        for (int i = 0; i < kQueryBlock; ++i)
          if (ib + i <= last) sv[i] = fmaf(qs[(ib + i) * hd + lane + 32 * e], kr[e], sv[i]);
      }
      // Only the block's real queries: a short block (one query when the grid is split to one
      // query per CTA) must not pay eight xor trees per position. Warp-uniform.
#pragma unroll
      for (int off = 16; off > 0; off /= 2) {
#pragma unroll
        for (int i = 0; i < kQueryBlock; ++i)
          if (ib + i <= last) sv[i] += __shfl_xor_sync(0xffffffffu, sv[i], off);
      }
      if (lane == 0) {
#pragma unroll
        for (int i = 0; i < kQueryBlock; ++i)
          if (ib + i <= last && j < cnt[ib + i])
            sc[(ib + i) * kAttentionChunk + j] = !kOss || j >= first[ib + i] ? sv[i] * scale : -INFINITY;
      }
    }
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) kr[e] = kn[e];
  }
  __syncthreads();

  // Max and sum of exponentials: warp w takes queries w, w + 4, ...
  for (int64_t i = warp; i < nq; i += kWarps) {
    const int64_t c = cnt[i];
    if (c <= 0) continue;
    float* si = sc + i * kAttentionChunk;
    float mx = -INFINITY;
    for (int64_t j = lane; j < c; j += 32) mx = fmaxf(mx, si[j]);
    for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    // A chunk wholly outside the query's window: every p is 0 (not NaN), the record's max -inf.
    const float mx_e = kOss && mx == -INFINITY ? 0.0f : mx;
    float sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) {  // the partials of attention_chunk_kernel's warp w
      float part_w = 0.0f;
      for (int64_t j = 32 * w + lane; j < c; j += kThreads) {
        const float p = expf(si[j] - mx_e);
        si[j] = p;
        part_w += p;
      }
      for (int off = 16; off > 0; off /= 2) {
        const float o = __shfl_xor_sync(0xffffffffu, part_w, off);
        part_w = part_w + o;
      }
      sum = w == 0 ? part_w : sum + part_w;
    }
    if (lane == 0) {
      const int64_t qq = q0 + i, t = qq / group, h = g * group + qq % group;
      float* rec = part + ((t * n_head + h) * max_chunks + chunk) * (hd + 2);
      rec[0] = mx;
      rec[1] = sum;
    }
  }
  __syncthreads();

  // Unnormalised output: a thread takes (dim d, block of kQueryBlock queries) pairs.
  const int64_t blocks = (nq + kQueryBlock - 1) / kQueryBlock;
  for (int64_t w = threadIdx.x; w < hd * blocks; w += kThreads) {
    const int64_t d = w % hd, b0 = (w / hd) * kQueryBlock;
    const int64_t bn = min(static_cast<int64_t>(kQueryBlock), nq - b0);
    const int64_t jn = cnt[b0 + bn - 1];
    float o[kQueryBlock];
    int c[kQueryBlock];
#pragma unroll
    for (int i = 0; i < kQueryBlock; ++i) {
      o[i] = 0.0f;
      c[i] = i < bn ? cnt[b0 + i] : 0;
    }
    const KV* vd = vc + j0 * kv_stride + g * hd + d;
    const float* sb = sc + b0 * kAttentionChunk;
    // Unrolled so that many V loads are in flight: the fma chains must stay sequential in j.
#pragma unroll 16
    for (int64_t j = 0; j < jn; ++j) {
      const float v = widen(vd[j * kv_stride]);
#pragma unroll
      for (int i = 0; i < kQueryBlock; ++i)
        if (j < c[i]) o[i] = fmaf(sb[i * kAttentionChunk + j], v, o[i]);
    }
#pragma unroll
    for (int i = 0; i < kQueryBlock; ++i) {
      if (c[i] <= 0) continue;
      const int64_t qq = q0 + b0 + i, t = qq / group, h = g * group + qq % group;
      part[((t * n_head + h) * max_chunks + chunk) * (hd + 2) + 2 + d] = o[i];
    }
  }
}

template <bool kOss = false>   // sinks and the window (gpt-oss): a separate instantiation
__global__ void attention_merge_kernel(const float* __restrict__ part, int64_t n_head, int64_t hd, PastSource past,
                                       int64_t n_rows, int64_t max_chunks, const float* __restrict__ gate,
                                       int64_t gate_row_stride, int64_t gate_head_stride, const float* __restrict__ sinks,
                                       int64_t window, float* __restrict__ out) {
  const int64_t qi = blockIdx.x;
  const int64_t t = qi / n_head, h = qi % n_head;
  const int64_t n_past = live_n_past(past, n_rows);
  if (n_past < 0) {  // a device position outside the launch's capacity: visible, never out of bounds
    for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) out[qi * hd + d] = __uint_as_float(kNaNBits);
    return;
  }
  const int64_t chunks = (n_past + t + 1 + kAttentionChunk - 1) / kAttentionChunk;
  // A sliding window: the chunks below the one holding the window's first position have no records.
  const int64_t c0 = kOss && window > 0 ? max(int64_t{0}, n_past + t + 1 - window) / kAttentionChunk : 0;
  const float* base = part + qi * max_chunks * (hd + 2);
  float m = -INFINITY;
  for (int64_t c = c0; c < chunks; ++c) m = fmaxf(m, base[c * (hd + 2)]);
  if (kOss && sinks != nullptr) m = fmaxf(m, sinks[h]);
  float l = 0.0f;
  for (int64_t c = c0; c < chunks; ++c) l += base[c * (hd + 2) + 1] * expf(base[c * (hd + 2)] - m);
  if (kOss && sinks != nullptr) l += expf(sinks[h] - m);   // the sink's share of the mass, no value row
  const float inv = 1.0f / l;
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float o = 0.0f;
    for (int64_t c = c0; c < chunks; ++c) o += base[c * (hd + 2) + 2 + d] * expf(base[c * (hd + 2)] - m);
    o *= inv;
    if (gate != nullptr) o *= 1.0f / (1.0f + expf(-gate[t * gate_row_stride + h * gate_head_stride + d]));
    out[qi * hd + d] = o;
  }
}

auto merge_kernel(const AttentionShape& s) {
  return s.sinks != nullptr || s.window > 0 ? attention_merge_kernel<true> : attention_merge_kernel<false>;
}

std::string describe(const AttentionShape& s, int64_t n, const std::string& past) {
  return " (n_head=" + std::to_string(s.n_head) + ", n_head_kv=" + std::to_string(s.n_head_kv) +
         ", head_dim=" + std::to_string(s.head_dim) + ", kv_stride=" + std::to_string(s.kv_stride) +
         ", n=" + std::to_string(n) + ", " + past + ")";
}

void check_shape(const char* what, const AttentionShape& s, int64_t n, const std::string& where) {
  if (s.n_head <= 0 || s.n_head_kv <= 0 || s.n_head % s.n_head_kv != 0 || s.head_dim <= 0 ||
      s.head_dim > kAttentionMaxHeadDim || s.kv_stride < s.n_head_kv * s.head_dim || n <= 0)
    throw std::invalid_argument(std::string(what) + ": bad shape" + where);
  if (s.n_head > 0x7fffffff / kAttentionChunk) throw std::invalid_argument(std::string(what) + ": too many heads" + where);
  if (s.window < 0) throw std::invalid_argument(std::string(what) + ": negative sliding window" + where);
}

// Queries per CTA of the shared kernel for `queries` queries per kv head over `chunks` chunks:
// as many as shared memory holds, but split further while the grid would leave the SMs idle (a
// short context has few chunks: 4 kv heads x 2 chunks at 512 positions is 8 CTAs for 132 SMs).
// The split changes no query's arithmetic, only how many times a K/V row is read.
int64_t queries_per_cta(const AttentionShape& s, int64_t queries, int64_t chunks) {
  int64_t cap = std::max<int64_t>(1, kSharedQueryFloats / (s.head_dim + kAttentionChunk));
  if (cap >= kQueryBlock) cap = cap / kQueryBlock * kQueryBlock;
  int device = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  int64_t per = std::min(cap, queries);
  while (per > 1 && s.n_head_kv * chunks * ((queries + per - 1) / per) < 2 * static_cast<int64_t>(sms))
    per = per > kQueryBlock ? per - kQueryBlock : per / 2;
  return per;
}

template <class KV>
void launch_shared(const AttentionShape& s, const float* q, const KV* k_cache, const KV* v_cache, int64_t rows,
                   const PastSource& past, int64_t live_chunks, int64_t max_chunks, float* scratch,
                   cudaStream_t stream) {
  const int64_t group = s.n_head / s.n_head_kv, queries = rows * group;
  const int64_t per = queries_per_cta(s, queries, live_chunks);
  const int64_t slices = (queries + per - 1) / per;
  if (s.n_head_kv * slices > 0x7fffffff || max_chunks > 65535)
    throw std::invalid_argument("attention: grid of " + std::to_string(s.n_head_kv * slices) + " x " +
                                std::to_string(max_chunks) + " CTAs is too large");
  const size_t smem = static_cast<size_t>(per * (s.head_dim + kAttentionChunk)) * sizeof(float);
  const dim3 grid(static_cast<unsigned>(s.n_head_kv * slices), static_cast<unsigned>(max_chunks));
  const auto kernel = s.sinks != nullptr || s.window > 0 ? attention_chunk_shared_kernel<KV, true>
                                                         : attention_chunk_shared_kernel<KV, false>;
  kernel<<<grid, kThreads, smem, stream>>>(q, k_cache, v_cache, s.n_head, group, s.head_dim, s.kv_stride, s.scale, past,
                                           rows, per, slices, max_chunks, s.window, scratch);
  CUDA_CHECK(cudaGetLastError());
}

// `attention` and `attention_unshared` (float caches only): rows in passes through the scratch.
template <class KV>
void attention_host(bool shared, const AttentionShape& s, const float* q, const KV* k_cache, const KV* v_cache,
                    int64_t n, int64_t n_past, const float* gate, int64_t gate_row_stride, int64_t gate_head_stride,
                    float* out, float* scratch, int64_t scratch_floats, cudaStream_t stream) {
  const char* what = shared ? "attention" : "attention_unshared";
  const std::string where = describe(s, n, "n_past=" + std::to_string(n_past));
  check_shape(what, s, n, where);
  if (n_past < 0) throw std::invalid_argument(std::string(what) + ": negative n_past" + where);
  if (!shared && (s.sinks != nullptr || s.window > 0))
    throw std::invalid_argument("attention_unshared: no sinks or sliding window (the spec kernel predates them)" + where);
  const int64_t n_ctx = n_past + n;
  const int64_t max_chunks = (n_ctx + kAttentionChunk - 1) / kAttentionChunk;
  const int64_t per_row = attention_scratch_floats(s, 1, n_ctx);
  if (scratch_floats < per_row)
    throw std::invalid_argument(std::string(what) + ": scratch of " + std::to_string(scratch_floats) +
                                " floats, need at least " + std::to_string(per_row) + where);
  // Records are laid out with the stride of the longest row of the call (max_chunks), whatever
  // the pass: a row's own chunks and their merge are the same in every pass.
  const int64_t rows_per_pass = std::min<int64_t>(n, std::min<int64_t>(scratch_floats / per_row, 0x7fffffff / s.n_head));
  const size_t smem = static_cast<size_t>(s.head_dim + kAttentionChunk) * sizeof(float);
  const int64_t qd = s.n_head * s.head_dim;
  for (int64_t t0 = 0; t0 < n; t0 += rows_per_pass) {
    const int64_t m = std::min(rows_per_pass, n - t0);
    PastSource past;
    past.host = n_past + t0;
    if (shared) {
      launch_shared(s, q + t0 * qd, k_cache, v_cache, m, past, max_chunks, max_chunks, scratch, stream);
    } else if constexpr (sizeof(KV) == sizeof(float)) {
      const dim3 grid(static_cast<unsigned>(m * s.n_head), static_cast<unsigned>(max_chunks));
      attention_chunk_kernel<<<grid, kThreads, smem, stream>>>(q + t0 * qd, k_cache, v_cache, s.n_head,
                                                               s.n_head / s.n_head_kv, s.head_dim, s.kv_stride,
                                                               s.scale, n_past + t0, max_chunks, scratch);
      CUDA_CHECK(cudaGetLastError());
    } else {
      throw std::invalid_argument("attention_unshared: float caches only");
    }
    merge_kernel(s)<<<static_cast<unsigned>(m * s.n_head), 128, 0, stream>>>(
        scratch, s.n_head, s.head_dim, past, m, max_chunks, gate != nullptr ? gate + t0 * gate_row_stride : nullptr,
        gate_row_stride, gate_head_stride, s.sinks, s.window, out + t0 * qd);
    CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace

void attention(const AttentionShape& s, const float* q, const float* k_cache, const float* v_cache, int64_t n,
               int64_t n_past, const float* gate, int64_t gate_row_stride, int64_t gate_head_stride, float* out,
               float* scratch, int64_t scratch_floats, cudaStream_t stream) {
  attention_host(true, s, q, k_cache, v_cache, n, n_past, gate, gate_row_stride, gate_head_stride, out, scratch,
                 scratch_floats, stream);
}

void attention_unshared(const AttentionShape& s, const float* q, const float* k_cache, const float* v_cache,
                        int64_t n, int64_t n_past, const float* gate, int64_t gate_row_stride,
                        int64_t gate_head_stride, float* out, float* scratch, int64_t scratch_floats,
                        cudaStream_t stream) {
  attention_host(false, s, q, k_cache, v_cache, n, n_past, gate, gate_row_stride, gate_head_stride, out, scratch,
                 scratch_floats, stream);
}

namespace {

template <class KV>
void attention_at_impl(const AttentionShape& s, const float* q, const KV* k_cache, const KV* v_cache, int64_t n,
                       const int32_t* n_past_dev, int64_t max_ctx, const float* gate, int64_t gate_row_stride,
                       int64_t gate_head_stride, float* out, float* scratch, int64_t scratch_floats,
                       cudaStream_t stream) {
  const std::string where = describe(s, n, "max_ctx=" + std::to_string(max_ctx));
  check_shape("attention_at", s, n, where);
  if (n > kAttentionAtMaxRows || max_ctx < n || n_past_dev == nullptr)
    throw std::invalid_argument("attention_at: need 1 <= n <= " + std::to_string(kAttentionAtMaxRows) +
                                ", max_ctx >= n and a device n_past pointer" + where);
  const int64_t need = attention_at_scratch_floats(s, n, max_ctx);
  if (scratch_floats < need)
    throw std::invalid_argument("attention_at: scratch of " + std::to_string(scratch_floats) +
                                " floats, need at least " + std::to_string(need) + where);
  PastSource past;
  past.dev = n_past_dev;
  past.max_ctx = max_ctx;
  const int64_t max_chunks = (max_ctx + kAttentionChunk - 1) / kAttentionChunk;
  // The grid covers max_ctx, so the query split is sized for it (a fixed launch for every step).
  launch_shared(s, q, k_cache, v_cache, n, past, max_chunks, max_chunks, scratch, stream);
  merge_kernel(s)<<<static_cast<unsigned>(n * s.n_head), 128, 0, stream>>>(
      scratch, s.n_head, s.head_dim, past, n, max_chunks, gate, gate_row_stride, gate_head_stride, s.sinks, s.window, out);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void attention_at(const AttentionShape& s, const float* q, const float* k_cache, const float* v_cache, int64_t n,
                  const int32_t* n_past_dev, int64_t max_ctx, const float* gate, int64_t gate_row_stride,
                  int64_t gate_head_stride, float* out, float* scratch, int64_t scratch_floats, cudaStream_t stream) {
  attention_at_impl(s, q, k_cache, v_cache, n, n_past_dev, max_ctx, gate, gate_row_stride, gate_head_stride, out,
                    scratch, scratch_floats, stream);
}

void attention_at(const AttentionShape& s, const float* q, const __half* k_cache, const __half* v_cache, int64_t n,
                  const int32_t* n_past_dev, int64_t max_ctx, const float* gate, int64_t gate_row_stride,
                  int64_t gate_head_stride, float* out, float* scratch, int64_t scratch_floats, cudaStream_t stream) {
  attention_at_impl(s, q, k_cache, v_cache, n, n_past_dev, max_ctx, gate, gate_row_stride, gate_head_stride, out,
                    scratch, scratch_floats, stream);
}

void attention(const AttentionShape& s, const float* q, const __half* k_cache, const __half* v_cache, int64_t n,
               int64_t n_past, const float* gate, int64_t gate_row_stride, int64_t gate_head_stride, float* out,
               float* scratch, int64_t scratch_floats, cudaStream_t stream) {
  attention_host(true, s, q, k_cache, v_cache, n, n_past, gate, gate_row_stride, gate_head_stride, out, scratch,
                 scratch_floats, stream);
}

}  // namespace moraine::cuda
