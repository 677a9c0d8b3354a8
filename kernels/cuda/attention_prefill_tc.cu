// Tensor-core prefill attention (attention_prefill_tc.h); tests/cuda/attention_prefill_tc_test.cpp
// and the hd128 / hd256 cases of cuda_backend_golden_test check it (H200, session 10).
//
// A CTA of 4 warps takes kv head g and 64 queries of it, numbered as in attention_prefill.cu
// (qq = t * group + head within the group, so the GQA group and the rows share each K/V tile);
// warp w owns queries 16w .. 16w + 15. Per KV tile of kBc positions (double-buffered in shared
// memory by cp.async): S = Q K^T by mma (q_hi and q_lo into one accumulator, fresh per tile), the
// online softmax in F32 on S's fragments (each lane holds rows g and g + 8, a row spread over the
// 4 lanes of a quad), P split into halves in registers as mma A fragments, and per 16 output dims
// the tile's P.V into a fresh accumulator that is then added to O after O's rescale: the long
// chain over all positions is one F32 add per tile, the mma chains stay within a tile.
//
// P is scaled by 2^15 before the split (exact; p <= 1 so p 2^15 <= 32768 < 65504), which moves
// half's subnormal range (below 2^-14) down to p < 2^-29: the p_lo of a small p keeps its relative
// precision. The output is multiplied back by 2^-15 (exact). q's range is not known: each CTA
// scales its Q tile by the power of two that brings its max |q| to [2^14, 2^15) (see below).
//
// Fragment maps: kernels/cuda/mma_ptx.cuh.
// Q (A, rows = queries, k = dims) and K (B, n = positions, k = dims) are dim-contiguous rows in
// shared memory, read by ldmatrix; V (B, k = positions, n = dims) too, read by ldmatrix.trans.
#include "kernels/cuda/attention_prefill_tc.h"

#include <cuda_fp16.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/mma_ptx.cuh"

namespace moraine::cuda {
namespace {

using namespace ptx;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kQueries = 16 * kWarps;  // queries per CTA
constexpr float kPScale = 32768.0f;    // 2^15, see the top
constexpr float kPUnscale = 1.0f / 32768.0f;

// Positions per KV tile: 64 at head_dim 128 (S and P take 64 registers, O 64), 32 at 256 (O takes
// 128). Shared memory: Q hi/lo 64 rows + K and V 2 x kBc rows, each row head_dim + 8 halves (the 8
// rows of an ldmatrix then start in distinct bank quads): 102 KB at 128 (2 CTAs per SM), 132 KB at 256.
// ptxas (sm_90, CUDA 13.0): 168 registers at 128 (16 B of spills), 255 and ~90 B of spills at 256.
// Timed at 128 (32/4 heads, H200, moraine-kernel-bench cuda --backend-only): 76 us at 512 tokens,
// 4.69 ms at 8192 (117 TFLOP/s; the F32 tiled kernel 26.8 ms); 256 not timed alone.
template <int HD>
struct TcTile {
  static constexpr int kBc = HD == 128 ? 64 : 32;
  static constexpr int kStride = HD + 8;
  static constexpr int kHalves = 2 * kQueries * kStride + 4 * kBc * kStride;
  static_assert(HD % 16 == 0 && kBc % 16 == 0, "tile shape");
};

// x = hi + lo + e with hi = half(x), lo = half(x - hi) (x - hi is exact in F32):
// |e| <= 2^-11 |x - hi| <= 2^-22 (1 + 2^-10) |x| while x - hi is a normal half, else <= 2^-25
// (< 2^-14 if the mma flushes the subnormal lo: not documented, so the test's bound allows it).
__device__ __forceinline__ void split(float x, __half& hi, __half& lo) {
  hi = __float2half_rn(x);
  lo = __float2half_rn(x - __half2float(hi));
}
// Two splits as the hi and lo registers of an A fragment (the first value in the low 16 bits: the
// lower column).
__device__ __forceinline__ void split_pair(float x0, float x1, unsigned& hi, unsigned& lo) {
  __half h0, l0, h1, l1;
  split(x0, h0, l0);
  split(x1, h1, l1);
  const __half2 h = __halves2half2(h0, h1), l = __halves2half2(l0, l1);
  hi = *reinterpret_cast<const unsigned*>(&h);
  lo = *reinterpret_cast<const unsigned*>(&l);
}

// Q scaled by a power of two 2^e (exact) that puts the tile's max |q| in [2^14, 2^15), then split
// into halves: q_hi never overflows, and the split's absolute part (where q_lo falls in half's
// subnormal range: 2^-25, or 2^-14 should the tensor cores flush subnormal inputs) is at most
// 2^-14 2^-e <= 2^-28 max|q| in q's units. e is clamped to
// [-113, 126] so 2^e and 2^-e are normal floats (the -113 end takes any finite q; the 126 end
// only changes max|q| < 2^-111). Scores are multiplied back by 2^-e. Rows past the last query
// are zeros: finite scores, never written.
// Returns 2^-e. warp_max: kWarps floats of shared memory.
template <int HD>
__device__ __forceinline__ float stage_q_split(const float* __restrict__ q, int64_t n_head, int64_t group, int64_t q0,
                                               int64_t total, int64_t g, __half* qhi, __half* qlo, float* warp_max) {
  constexpr int kStride = TcTile<HD>::kStride;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  auto q_at = [&](int i) {
    const int qq = i / HD, d = i % HD;
    const int64_t gq = q0 + qq;
    return gq < total ? q[((gq / group) * n_head + g * group + gq % group) * HD + d] : 0.0f;
  };
  float qmax = 0.0f;
  for (int i = tid; i < kQueries * HD; i += kThreads) qmax = fmaxf(qmax, fabsf(q_at(i)));
  for (int off = 16; off > 0; off /= 2) qmax = fmaxf(qmax, __shfl_xor_sync(0xffffffffu, qmax, off));
  if (lane == 0) warp_max[warp] = qmax;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) qmax = fmaxf(qmax, warp_max[w]);
  int qexp = 0;
  frexpf(qmax, &qexp);  // qmax in [2^(qexp-1), 2^qexp); 0 gives 0
  const int e = max(-113, min(126, 15 - qexp));
  const float q_up = __int_as_float((127 + e) << 23);
  for (int i = tid; i < kQueries * HD; i += kThreads) {
    const int qq = i / HD, d = i % HD;
    split(q_at(i) * q_up, qhi[qq * kStride + d], qlo[qq * kStride + d]);
  }
  return __int_as_float((127 - e) << 23);
}

// The online softmax of one KV tile on a warp's S fragments (c0, c1 are row quad_row, c2, c3
// row quad_row + 8): positions at or past the row's limit masked, the scores scaled back by q_down
// (2^-e first: exact) and then by scale, m and l carried on, corr the factor for the rows'
// earlier O; s becomes P.
// kOss (gpt-oss): positions below from[r] (the row's sliding window) masked too; a row whose tile is
// all masked keeps m = -inf, p = 0 and corr = 1.
template <int kNt, bool kOss = false>
__device__ __forceinline__ void online_softmax(float (&s)[kNt][4], int64_t kb, int quad_col, const int64_t (&limit)[2],
                                               const int64_t (&from)[2], float q_down, float scale, float (&m)[2],
                                               float (&l)[2], float (&corr)[2]) {
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < kNt; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int r = c / 2;
      const int64_t pos = kb + j * 8 + 2 * quad_col + (c & 1);
      s[j][c] = pos < limit[r] && (!kOss || pos >= from[r]) ? s[j][c] * q_down * scale : -INFINITY;
      mx[r] = fmaxf(mx[r], s[j][c]);
    }
  float ps[2] = {0.0f, 0.0f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    // Finite: the first tile holds position 0, visible to every row.
    const float mn = fmaxf(m[r], mx[r]);
    corr[r] = kOss && mn == -INFINITY ? 1.0f : expf(m[r] - mn);  // 0 on the first tile (m = -inf)
    m[r] = mn;
  }
  float m_e[2] = {m[0], m[1]};   // kOss: 0 for a row with nothing seen yet (every p then exp(-inf) = 0)
  if constexpr (kOss)
#pragma unroll
    for (int r = 0; r < 2; ++r) m_e[r] = m[r] == -INFINITY ? 0.0f : m[r];
#pragma unroll
  for (int j = 0; j < kNt; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float p = expf(s[j][c] - m_e[c / 2]);  // 0 for a masked position
      ps[c / 2] += p;
      s[j][c] = p;
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    ps[r] += __shfl_xor_sync(0xffffffffu, ps[r], 1);
    ps[r] += __shfl_xor_sync(0xffffffffu, ps[r], 2);
    l[r] = l[r] * corr[r] + ps[r];
  }
}

// kOss (gpt-oss, a separate instantiation: the others' code is unchanged): sinks and the window.
template <int HD, bool kOss = false>
__global__ void __launch_bounds__(kThreads)
    attention_prefill_tc_kernel(const float* __restrict__ q, const __half* __restrict__ kc,
                                const __half* __restrict__ vc, int64_t n_head, int64_t group, int64_t kv_stride,
                                float scale, int64_t n, int64_t n_past, const float* __restrict__ gate,
                                int64_t gate_row_stride, int64_t gate_head_stride, const float* __restrict__ sinks,
                                int64_t window, float* __restrict__ out) {
  using T = TcTile<HD>;
  constexpr int kBc = T::kBc, kStride = T::kStride, kNt = kBc / 8, kDt = HD / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* const qhi = reinterpret_cast<__half*>(smem_raw);  // [kQueries][kStride]
  __half* const qlo = qhi + kQueries * kStride;              // [kQueries][kStride]
  __half* const ks = qlo + kQueries * kStride;               // [2][kBc][kStride]
  __half* const vs = ks + 2 * kBc * kStride;                 // [2][kBc][kStride]

  const int64_t g = blockIdx.y;
  // The last tiles see the most positions: launch them first so they do not trail the grid.
  const int64_t q0 = (static_cast<int64_t>(gridDim.x) - 1 - blockIdx.x) * kQueries;
  const int64_t total = n * group;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, quad_row = lane / 4, quad_col = lane % 4;
  const int64_t n_kv = n_past + (min(q0 + kQueries, total) - 1) / group + 1;  // the tile's last query

  // K and V positions kb .. kb + kBc - 1 into buffer buf; positions past n_kv are zeros (never read
  // past the filled cache), and masked below.
  auto stage = [&](int64_t kb, int buf) {
    constexpr int kChunks = HD / 8;  // 16-byte pieces of a row
    for (int i = tid; i < kBc * kChunks; i += kThreads) {
      const int r = i / kChunks, c = (i % kChunks) * 8;
      const int64_t j = kb + r;
      const bool in = j < n_kv;
      const int64_t off = (in ? j : 0) * kv_stride + g * HD + c;
      copy_16_or_zero(ks + (buf * kBc + r) * kStride + c, kc + off, in);
      copy_16_or_zero(vs + (buf * kBc + r) * kStride + c, vc + off, in);
    }
    commit_group();
  };
  // A sliding window: the KV tiles start at the one holding the CTA's first query's first position.
  const int64_t kb0 = kOss && window > 0 ? max(int64_t{0}, n_past + q0 / group + 1 - window) / kBc * kBc : 0;
  stage(kb0, 0);

  __shared__ float warp_max[kWarps];
  const float q_down = stage_q_split<HD>(q, n_head, group, q0, total, g, qhi, qlo, warp_max);

  // This lane's two rows (quad_row and quad_row + 8 of the warp's 16): positions visible to each.
  // A row past the last query sees every staged position, so its max stays finite.
  int64_t limit[2], from[2] = {0, 0};
  bool live[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t gq = q0 + warp * 16 + quad_row + 8 * r;
    live[r] = gq < total;
    limit[r] = live[r] ? n_past + gq / group + 1 : n_kv;
    if constexpr (kOss) from[r] = live[r] && window > 0 ? max(int64_t{0}, limit[r] - window) : 0;
  }
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[kDt][4];
#pragma unroll
  for (int i = 0; i < kDt; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) o[i][c] = 0.0f;

  const __half* const q_lane_hi = qhi + (warp * 16 + lane % 16) * kStride + (lane / 16) * 8;
  const __half* const q_lane_lo = qlo + (warp * 16 + lane % 16) * kStride + (lane / 16) * 8;
  const int k_lane_off = ((lane % 8) + (lane / 16) * 8) * kStride + ((lane / 8) % 2) * 8;
  const int v_lane_off = ((lane % 8) + ((lane / 8) % 2) * 8) * kStride + (lane / 16) * 8;

  int buf = 0;
  for (int64_t kb = kb0; kb < n_kv; kb += kBc, buf ^= 1) {
    if (kb + kBc < n_kv) {  // the next tile into the other buffer (free: the loop's last barrier)
      stage(kb + kBc, buf ^ 1);
      wait_group<1>();
    } else {
      wait_group<0>();
    }
    __syncthreads();  // this tile (and, first, Q) visible to every warp
    const __half* const kt = ks + buf * kBc * kStride;
    const __half* const vt = vs + buf * kBc * kStride;

    // S = Q K^T for the warp's 16 rows x kBc positions: q_hi.K + q_lo.K.
    float s[kNt][4];
#pragma unroll
    for (int j = 0; j < kNt; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[j][c] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      unsigned ah[4], al[4];
      ldmatrix_x4(ah, q_lane_hi + kk * 16);
      ldmatrix_x4(al, q_lane_lo + kk * 16);
#pragma unroll
      for (int j = 0; j < kNt / 2; ++j) {
        unsigned b[4];
        ldmatrix_x4(b, kt + j * 16 * kStride + k_lane_off + kk * 16);
        mma_f16(s[2 * j], ah, b[0], b[1]);
        mma_f16(s[2 * j], al, b[0], b[1]);
        mma_f16(s[2 * j + 1], ah, b[2], b[3]);
        mma_f16(s[2 * j + 1], al, b[2], b[3]);
      }
    }

    // Online softmax on the fragments: s becomes P (0 at masked positions), m and l move on.
    float corr[2];
    online_softmax<kNt, kOss>(s, kb, quad_col, limit, from, q_down, scale, m, l, corr);

    // P 2^15 as hi and lo A fragments: k step kk covers positions 16 kk .. 16 kk + 15 = S tiles 2kk, 2kk+1.
    unsigned ph[kBc / 16][4], pl[kBc / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      split_pair(s[2 * kk][0] * kPScale, s[2 * kk][1] * kPScale, ph[kk][0], pl[kk][0]);
      split_pair(s[2 * kk][2] * kPScale, s[2 * kk][3] * kPScale, ph[kk][1], pl[kk][1]);
      split_pair(s[2 * kk + 1][0] * kPScale, s[2 * kk + 1][1] * kPScale, ph[kk][2], pl[kk][2]);
      split_pair(s[2 * kk + 1][2] * kPScale, s[2 * kk + 1][3] * kPScale, ph[kk][3], pl[kk][3]);
    }

    // O = O corr + P V, 16 dims at a time through a fresh accumulator per tile.
#pragma unroll
    for (int dt = 0; dt < HD / 16; ++dt) {
      float t0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, t1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int kk = 0; kk < kBc / 16; ++kk) {
        unsigned b[4];
        ldmatrix_x4_trans(b, vt + kk * 16 * kStride + v_lane_off + dt * 16);
        mma_f16(t0, ph[kk], b[0], b[1]);
        mma_f16(t0, pl[kk], b[0], b[1]);
        mma_f16(t1, ph[kk], b[2], b[3]);
        mma_f16(t1, pl[kk], b[2], b[3]);
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        o[2 * dt][c] = o[2 * dt][c] * corr[c / 2] + t0[c];
        o[2 * dt + 1][c] = o[2 * dt + 1][c] * corr[c / 2] + t1[c];
      }
    }
    __syncthreads();  // every warp is done with this buffer before the next stage overwrites it
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!live[r]) continue;
    const int64_t gq = q0 + warp * 16 + quad_row + 8 * r, t = gq / group, h = g * group + gq % group;
    float inv = 1.0f / l[r], rescale = 1.0f;
    if (kOss && sinks != nullptr) {   // the sink's logit joins the softmax: its exp in the denominator only
      const float m_s = fmaxf(m[r], sinks[h]);
      rescale = expf(m[r] - m_s);
      inv = 1.0f / (l[r] * rescale + expf(sinks[h] - m_s));
    }
#pragma unroll
    for (int i = 0; i < kDt; ++i)
#pragma unroll
      for (int c = 2 * r; c < 2 * r + 2; ++c) {
        const int64_t d = i * 8 + 2 * quad_col + (c & 1);
        float v = kOss && sinks != nullptr ? o[i][c] * rescale * inv * kPUnscale : o[i][c] * inv * kPUnscale;
        if (gate != nullptr) v *= 1.0f / (1.0f + expf(-gate[t * gate_row_stride + h * gate_head_stride + d]));
        out[(t * n_head + h) * HD + d] = v;
      }
  }
}

template <int HD>
void launch(const AttentionShape& s, const float* q, const __half* k_cache, const __half* v_cache, int64_t n,
            int64_t n_past, const float* gate, int64_t gate_row_stride, int64_t gate_head_stride, float* out,
            cudaStream_t stream) {
  const int64_t group = s.n_head / s.n_head_kv;
  const int64_t tiles = (n * group + kQueries - 1) / kQueries;
  if (tiles > 0x7fffffff || s.n_head_kv > 65535)
    throw std::invalid_argument("attention_prefill_tc: grid of " + std::to_string(tiles) + " x " +
                                std::to_string(s.n_head_kv) + " CTAs is too large");
  const int smem = static_cast<int>(TcTile<HD>::kHalves * sizeof(__half));
  // Above the default 48 KB: opt in (a host-side attribute, cheap enough per call).
  const auto kernel = s.sinks != nullptr || s.window > 0 ? attention_prefill_tc_kernel<HD, true>
                                                         : attention_prefill_tc_kernel<HD, false>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(s.n_head_kv));
  kernel<<<grid, kThreads, smem, stream>>>(q, k_cache, v_cache, s.n_head, group, s.kv_stride, s.scale, n, n_past, gate,
                                           gate_row_stride, gate_head_stride, s.sinks, s.window, out);
  CUDA_CHECK(cudaGetLastError());
}

bool aligned_16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool attention_prefill_tc_supports(const AttentionShape& s, const __half* k_cache, const __half* v_cache) {
  return (s.head_dim == 128 || s.head_dim == 256) && s.kv_stride % 8 == 0 && aligned_16(k_cache) &&
         aligned_16(v_cache) && s.window >= 0;
}

void attention_prefill_tc(const AttentionShape& s, const float* q, const __half* k_cache, const __half* v_cache,
                          int64_t n, int64_t n_past, const float* gate, int64_t gate_row_stride,
                          int64_t gate_head_stride, float* out, cudaStream_t stream) {
  if (s.n_head <= 0 || s.n_head_kv <= 0 || s.n_head % s.n_head_kv != 0 || s.head_dim <= 0 ||
      s.kv_stride < s.n_head_kv * s.head_dim || n <= 0 || n_past < 0)
    throw std::invalid_argument("attention_prefill_tc: bad shape (n_head=" + std::to_string(s.n_head) +
                                ", n_head_kv=" + std::to_string(s.n_head_kv) + ", head_dim=" +
                                std::to_string(s.head_dim) + ", kv_stride=" + std::to_string(s.kv_stride) +
                                ", n=" + std::to_string(n) + ", n_past=" + std::to_string(n_past) + ")");
  if (!attention_prefill_tc_supports(s, k_cache, v_cache))
    throw std::invalid_argument("attention_prefill_tc: unsupported (head_dim=" + std::to_string(s.head_dim) +
                                " must be 128 or 256, kv_stride=" + std::to_string(s.kv_stride) +
                                " a multiple of 8, both caches 16-byte aligned, window >= 0); use attention_prefill");
  if (s.head_dim == 128)
    launch<128>(s, q, k_cache, v_cache, n, n_past, gate, gate_row_stride, gate_head_stride, out, stream);
  else
    launch<256>(s, q, k_cache, v_cache, n, n_past, gate, gate_row_stride, gate_head_stride, out, stream);
}

}  // namespace moraine::cuda
