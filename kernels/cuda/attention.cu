#include "kernels/cuda/attention.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"

namespace moraine::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

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

// Partial record per (query row, head, chunk): [max, sum, out[head_dim]].
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

__global__ void attention_merge_kernel(const float* __restrict__ part, int64_t n_head, int64_t hd, int64_t n_past,
                                       int64_t max_chunks, const float* __restrict__ gate, int64_t gate_row_stride,
                                       int64_t gate_head_stride, float* __restrict__ out) {
  const int64_t qi = blockIdx.x;
  const int64_t t = qi / n_head, h = qi % n_head;
  const int64_t chunks = (n_past + t + 1 + kAttentionChunk - 1) / kAttentionChunk;
  const float* base = part + qi * max_chunks * (hd + 2);
  float m = -INFINITY;
  for (int64_t c = 0; c < chunks; ++c) m = fmaxf(m, base[c * (hd + 2)]);
  float l = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) l += base[c * (hd + 2) + 1] * expf(base[c * (hd + 2)] - m);
  const float inv = 1.0f / l;
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float o = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) o += base[c * (hd + 2) + 2 + d] * expf(base[c * (hd + 2)] - m);
    o *= inv;
    if (gate != nullptr) o *= 1.0f / (1.0f + expf(-gate[t * gate_row_stride + h * gate_head_stride + d]));
    out[qi * hd + d] = o;
  }
}

}  // namespace

int64_t attention_scratch_floats(const AttentionShape& s, int64_t n, int64_t n_ctx) {
  const int64_t chunks = (n_ctx + kAttentionChunk - 1) / kAttentionChunk;
  return n * s.n_head * chunks * (s.head_dim + 2);
}

void attention(const AttentionShape& s, const float* q, const float* k_cache, const float* v_cache, int64_t n,
               int64_t n_past, const float* gate, int64_t gate_row_stride, int64_t gate_head_stride, float* out,
               float* scratch, int64_t scratch_floats, cudaStream_t stream) {
  const std::string where = " (n_head=" + std::to_string(s.n_head) + ", n_head_kv=" + std::to_string(s.n_head_kv) +
                            ", head_dim=" + std::to_string(s.head_dim) + ", n=" + std::to_string(n) +
                            ", n_past=" + std::to_string(n_past) + ")";
  if (s.n_head <= 0 || s.n_head_kv <= 0 || s.n_head % s.n_head_kv != 0 || s.head_dim <= 0 ||
      s.head_dim > kAttentionMaxHeadDim || s.kv_stride < s.n_head_kv * s.head_dim || n <= 0 || n_past < 0)
    throw std::invalid_argument("attention: bad shape" + where);
  const int64_t n_ctx = n_past + n;
  const int64_t max_chunks = (n_ctx + kAttentionChunk - 1) / kAttentionChunk;
  const int64_t per_row = attention_scratch_floats(s, 1, n_ctx);
  if (scratch_floats < per_row)
    throw std::invalid_argument("attention: scratch of " + std::to_string(scratch_floats) + " floats, need at least " +
                                std::to_string(per_row) + where);
  if (s.n_head > 0x7fffffff / kAttentionChunk) throw std::invalid_argument("attention: too many heads" + where);
  // Records are laid out with the stride of the longest row of the call (max_chunks), whatever
  // the pass: a row's own chunks and their merge are the same in every pass.
  const int64_t rows_per_pass = std::min<int64_t>(n, std::min<int64_t>(scratch_floats / per_row, 0x7fffffff / s.n_head));
  const size_t smem = static_cast<size_t>(s.head_dim + kAttentionChunk) * sizeof(float);
  const int64_t qd = s.n_head * s.head_dim;
  for (int64_t t0 = 0; t0 < n; t0 += rows_per_pass) {
    const int64_t m = std::min(rows_per_pass, n - t0);
    const dim3 grid(static_cast<unsigned>(m * s.n_head), static_cast<unsigned>(max_chunks));
    attention_chunk_kernel<<<grid, kThreads, smem, stream>>>(q + t0 * qd, k_cache, v_cache, s.n_head,
                                                             s.n_head / s.n_head_kv, s.head_dim, s.kv_stride, s.scale,
                                                             n_past + t0, max_chunks, scratch);
    CUDA_CHECK(cudaGetLastError());
    attention_merge_kernel<<<static_cast<unsigned>(m * s.n_head), 128, 0, stream>>>(
        scratch, s.n_head, s.head_dim, n_past + t0, max_chunks, gate != nullptr ? gate + t0 * gate_row_stride : nullptr,
        gate_row_stride, gate_head_stride, out + t0 * qd);
    CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace moraine::cuda
