// Chunked (WY) form of the gated delta rule for prefill (delta_net_recurrence_chunked in
// kernels/cuda/delta_net.h). Per value head and chunk of L <= 64 tokens with start state S0,
// G_t = g_1 + ... + g_t (within the chunk), D_t = exp(G_t); G and every exp(G_t - G_s) are
// taken in double and rounded once to float: expf of a float G would carry G's rounding
// (|G| u, |G| up to 64 |g|) into every decay factor.
//   S_t = D_t S0 + sum_{s<=t} exp(G_t - G_s) k_s u_s^T              (unrolling the recurrence)
//   u_t = beta_t (v_t - D_t S0^T k_t - sum_{s<t} exp(G_t - G_s) (k_s.k_t) u_s)
// so with A[t][s] = beta_t exp(G_t - G_s) k_t.k_s (s < t) and (I + A) X = B solved by forward
// substitution:  W = X(B = beta D k),  Uhat = X(B = beta v),  U = Uhat - W S0,
//   O = (D q) S0 + P U   with P[t][s] = exp(G_t - G_s) q_t.k_s (s <= t),
//   S_L = D_L S0 + sum_s exp(G_L - G_s) k_s u_s^T.
// chunk_prep_kernel computes W, Uhat, P, D and exp(G_L - G_s) for every (chunk, head) at once;
// chunk_state_kernel walks the chunks in order per (head, 32 state columns): the only
// sequential part, three small matrix products per chunk instead of 64 dependent token steps.
//
// Measured (H200, Qwen3-Next shape, 32 v heads of 128 x 128): 12.5 ms for 8192 tokens and
// 117 us for one chunk of 64, against 8.6 ms and 59 us for the token loop, so delta_net_mix does
// not use this yet. The kernels were not timed apart; by count the prep kernel is a few us a
// wave, so the time is chunk_state_kernel's (about 90 us a chunk): its 123 KB of shared memory
// allow one 4-warp CTA per SM, so each scheduler has a single warp and every shared-memory
// load's latency is exposed in the scalar inner loops. What should fix that:
// contiguous rows per lane (float4 loads), several tokens per loop step for independent
// accumulators, and tensor-core (TF32 or split-BF16) products for W S0, Q S0 and K^T U.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/delta_net.h"

namespace moraine::cuda {
namespace {

constexpr int kChunk = 64;
constexpr int kPrepThreads = 256;
constexpr int kMaxDim = 128;  // d_k and d_v of the chunked path
// Tokens per pass: bounds the workspace (W, Uhat, P per chunk) at any prompt length; 2048
// tokens are 32 chunks x the heads, enough CTAs to fill the GPU for the prep kernel.
constexpr int64_t kSegmentTokens = 2048;

// Chunk state kernel layout: as the token recurrence, 4 lanes per state column, each lane
// holding rows i = r * 4 + lane.
constexpr int kLanes = 4;
constexpr int kRows = kMaxDim / kLanes;
constexpr int kColumns = 32;
constexpr int kStateThreads = kColumns * kLanes;
constexpr int kUStride = kColumns + 1;  // padded: lanes of one column read different rows
constexpr int kAStride = kChunk + 4;    // rows 16-byte aligned for float4 reads

struct ChunkArgs {
  const float* qkv;
  const float* gate;
  const float* beta;
  float* w;     // [chunks][n_v_heads][kChunk][dk]
  float* uhat;  // [chunks][n_v_heads][kChunk][dv]
  float* p;     // [chunks][n_v_heads][kChunk][kChunk]
  float* d;     // [chunks][n_v_heads][kChunk]  exp(G_t)
  float* e;     // [chunks][n_v_heads][kChunk]  exp(G_last - G_t)
  float* state;
  float* out;
  int64_t n, n_k_heads, n_v_heads, dk, dv, key_dim, conv_dim, value_dim;
  bool tiled;  // DeltaNetShape::v_heads_tiled
};

size_t prep_smem_bytes(int dk, int dv) {
  return sizeof(double) * kChunk + sizeof(float) * (kChunk * kAStride + 2 * kChunk * (dk + 1) + kChunk * dv + kChunk);
}

size_t state_smem_bytes(int dk) {
  return sizeof(float) * (3 * kChunk * dk + kChunk * kUStride + kChunk * kChunk + kChunk);
}

__global__ void __launch_bounds__(kPrepThreads) chunk_prep_kernel(ChunkArgs a) {
  extern __shared__ double smem_d[];
  const int dk = static_cast<int>(a.dk), dv = static_cast<int>(a.dv);
  const int64_t chunk = blockIdx.x, hv = blockIdx.y, g = delta_net_key_head(hv, a.n_k_heads, a.n_v_heads, a.tiled);
  const int64_t t0 = chunk * kChunk;
  const int L = static_cast<int>(min(static_cast<int64_t>(kChunk), a.n - t0));
  double* G = smem_d;                                     // [kChunk]
  float* As = reinterpret_cast<float*>(G + kChunk);       // [kChunk][kAStride] (16-byte aligned)
  float* qs = As + kChunk * kAStride;                     // [kChunk][dk + 1], later W
  float* ks = qs + kChunk * (dk + 1);                     // [kChunk][dk + 1]
  float* vs = ks + kChunk * (dk + 1);                     // [kChunk][dv], later Uhat
  float* bs = vs + kChunk * dv;                           // [kChunk] beta
  const int tid = threadIdx.x;

  // Rows from L on are zero: the substitution below always runs all kChunk rows.
  for (int e = tid; e < kChunk * dk; e += kPrepThreads) {
    const int t = e / dk, i = e % dk;
    const float* row = a.qkv + (t0 + t) * a.conv_dim;
    qs[t * (dk + 1) + i] = t < L ? row[g * dk + i] : 0.0f;
    ks[t * (dk + 1) + i] = t < L ? row[a.key_dim + g * dk + i] : 0.0f;
  }
  for (int e = tid; e < kChunk * dv; e += kPrepThreads) {
    const int t = e / dv, j = e % dv;
    vs[t * dv + j] = t < L ? a.qkv[(t0 + t) * a.conv_dim + 2 * a.key_dim + hv * dv + j] : 0.0f;
  }
  if (tid < kChunk) bs[tid] = tid < L ? a.beta[(t0 + tid) * a.n_v_heads + hv] : 0.0f;
  if (tid == 0) {
    double acc = 0.0;
    for (int t = 0; t < L; ++t) {
      acc += static_cast<double>(a.gate[(t0 + t) * a.n_v_heads + hv]);
      G[t] = acc;
    }
    for (int t = L; t < kChunk; ++t) G[t] = acc;
  }
  __syncthreads();

  // A (strictly lower, zero outside L x L) into shared memory, P (lower with diagonal) straight
  // out. Each thread makes a 4 x 4 tile t = tb + 16 a, s = sb + 16 b: the ks rows a warp reads
  // at one i are 16 consecutive rows of stride d_k + 1, so different banks.
  float* p_out = a.p + (chunk * a.n_v_heads + hv) * kChunk * kChunk;
  {
    const int tb = tid / 16, sb = tid % 16;
    float kk[4][4], qk[4][4];
#pragma unroll
    for (int x = 0; x < 4; ++x)
#pragma unroll
      for (int y = 0; y < 4; ++y) kk[x][y] = qk[x][y] = 0.0f;
    for (int i = 0; i < dk; ++i) {
      float kt[4], qt[4], k_s[4];
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        kt[x] = ks[(tb + 16 * x) * (dk + 1) + i];
        qt[x] = qs[(tb + 16 * x) * (dk + 1) + i];
        k_s[x] = ks[(sb + 16 * x) * (dk + 1) + i];
      }
#pragma unroll
      for (int x = 0; x < 4; ++x)
#pragma unroll
        for (int y = 0; y < 4; ++y) {
          kk[x][y] = fmaf(kt[x], k_s[y], kk[x][y]);
          qk[x][y] = fmaf(qt[x], k_s[y], qk[x][y]);
        }
    }
#pragma unroll
    for (int x = 0; x < 4; ++x)
#pragma unroll
      for (int y = 0; y < 4; ++y) {
        const int t = tb + 16 * x, s = sb + 16 * y;
        float pv = 0.0f, av = 0.0f;
        if (s <= t && t < L) {
          const float f = __double2float_rn(exp(G[t] - G[s]));
          pv = f * qk[x][y];
          if (s < t) av = (bs[t] * f) * kk[x][y];
        }
        if (t < L && s < L) p_out[t * kChunk + s] = pv;
        As[t * kAStride + s] = av;
      }
  }
  __syncthreads();

  // Right-hand sides in place: q's rows become beta D k (for W), v's rows beta v (for Uhat).
  for (int e = tid; e < L * dk; e += kPrepThreads) {
    const int t = e / dk, i = e % dk;
    const float bd = bs[t] * __double2float_rn(exp(G[t]));
    qs[t * (dk + 1) + i] = bd * ks[t * (dk + 1) + i];
  }
  for (int e = tid; e < L * dv; e += kPrepThreads) {
    const int t = e / dv;
    vs[e] = bs[t] * vs[e];
  }
  __syncthreads();

  // (I + A) X = B by forward substitution, one thread per column of [W | Uhat]: a column
  // depends only on itself, so no barrier between rows; the column sits in registers (the
  // loops are unrolled over all kChunk rows; rows from L on are 0 = 0) and A's rows are read
  // four at a time.
  for (int col = tid; col < dk + dv; col += kPrepThreads) {
    float* x = col < dk ? qs + col : vs + (col - dk);
    const int stride = col < dk ? dk + 1 : dv;
    float xr[kChunk];
#pragma unroll
    for (int t = 0; t < kChunk; ++t) xr[t] = x[t * stride];
#pragma unroll
    for (int t = 1; t < kChunk; ++t) {
      const float* at = As + t * kAStride;
      float acc = xr[t];
#pragma unroll
      for (int s4 = 0; s4 < t; s4 += 4) {
        const float4 a4 = *reinterpret_cast<const float4*>(at + s4);
        acc = fmaf(-a4.x, xr[s4], acc);
        if (s4 + 1 < t) acc = fmaf(-a4.y, xr[s4 + 1], acc);
        if (s4 + 2 < t) acc = fmaf(-a4.z, xr[s4 + 2], acc);
        if (s4 + 3 < t) acc = fmaf(-a4.w, xr[s4 + 3], acc);
      }
      xr[t] = acc;
    }
#pragma unroll
    for (int t = 0; t < kChunk; ++t) x[t * stride] = xr[t];
  }
  __syncthreads();

  const int64_t base = chunk * a.n_v_heads + hv;
  for (int e = tid; e < L * dk; e += kPrepThreads) {
    const int t = e / dk, i = e % dk;
    a.w[base * kChunk * dk + e] = qs[t * (dk + 1) + i];
  }
  for (int e = tid; e < L * dv; e += kPrepThreads) a.uhat[base * kChunk * dv + e] = vs[e];
  if (tid < L) {
    a.d[base * kChunk + tid] = __double2float_rn(exp(G[tid]));
    a.e[base * kChunk + tid] = __double2float_rn(exp(G[L - 1] - G[tid]));
  }
}

// One CTA per (value head, 32 state columns), chunks in order; the state slice lives in
// registers. Per chunk: U = Uhat - W S0, then O = D (Q S0) + P U, then S = D_L S0 + Ktilde^T U.
__global__ void __launch_bounds__(kStateThreads) chunk_state_kernel(ChunkArgs a) {
  extern __shared__ float smem_f[];
  const int dk = static_cast<int>(a.dk), dv = static_cast<int>(a.dv);
  float* Ws = smem_f;                  // [kChunk][dk]
  float* Qs = Ws + kChunk * dk;        // [kChunk][dk]
  float* Ks = Qs + kChunk * dk;        // [kChunk][dk], rows scaled by exp(G_L - G_s)
  float* Us = Ks + kChunk * dk;        // [kChunk][kUStride]
  float* Ps = Us + kChunk * kUStride;  // [kChunk][kChunk]
  float* Ds = Ps + kChunk * kChunk;    // [kChunk]
  const int tid = threadIdx.x;
  const int lane = tid % kLanes, col = tid / kLanes;
  const int64_t hv = blockIdx.x, g = delta_net_key_head(hv, a.n_k_heads, a.n_v_heads, a.tiled);
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kColumns;
  const int64_t j = col0 + col;
  const bool active = j < dv;
  const int ncols = static_cast<int>(min(static_cast<int64_t>(kColumns), dv - col0));

  float* head_state = a.state + hv * a.dk * a.dv;
  float st[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = r * kLanes + lane;
    st[r] = active && i < dk ? head_state[static_cast<int64_t>(i) * dv + j] : 0.0f;
  }

  const int64_t chunks = (a.n + kChunk - 1) / kChunk;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t t0 = c * kChunk;
    const int L = static_cast<int>(min(static_cast<int64_t>(kChunk), a.n - t0));
    const int64_t base = c * a.n_v_heads + hv;
    __syncthreads();  // the previous chunk is done with shared memory
    for (int e = tid; e < L * dk; e += kStateThreads) {
      const int t = e / dk, i = e % dk;
      const float* row = a.qkv + (t0 + t) * a.conv_dim;
      Ws[e] = a.w[base * kChunk * dk + e];
      Qs[e] = row[g * dk + i];
      Ks[e] = a.e[base * kChunk + t] * row[a.key_dim + g * dk + i];
    }
    for (int e = tid; e < L * kColumns; e += kStateThreads) {
      const int t = e / kColumns, jl = e % kColumns;
      Us[t * kUStride + jl] = jl < ncols ? a.uhat[base * kChunk * dv + t * dv + col0 + jl] : 0.0f;
    }
    for (int e = tid; e < L * L; e += kStateThreads) {
      const int t = e / L, s = e % L;
      Ps[t * kChunk + s] = a.p[base * kChunk * kChunk + t * kChunk + s];
    }
    if (tid < L) Ds[tid] = a.d[base * kChunk + tid];
    __syncthreads();

    // U = Uhat - W S0
    for (int t = 0; t < L; ++t) {
      const float* wt = Ws + t * dk;
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int i = r * kLanes + lane;
        if (i < dk) acc[r % 4] = fmaf(wt[i], st[r], acc[r % 4]);
      }
      float part = (acc[0] + acc[1]) + (acc[2] + acc[3]);
      part += __shfl_xor_sync(0xffffffffu, part, 1);
      part += __shfl_xor_sync(0xffffffffu, part, 2);
      if (lane == 0) Us[t * kUStride + col] -= part;  // inactive columns stay 0 - 0
    }
    __syncthreads();

    // O = D (Q S0) + P U; lane l adds the P U terms of s = l, l + 4, ...
    for (int t = 0; t < L; ++t) {
      const float* qt = Qs + t * dk;
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int i = r * kLanes + lane;
        if (i < dk) acc[r % 4] = fmaf(qt[i], st[r], acc[r % 4]);
      }
      float part = Ds[t] * ((acc[0] + acc[1]) + (acc[2] + acc[3]));
      const float* pt = Ps + t * kChunk;
      for (int s = lane; s <= t; s += kLanes) part = fmaf(pt[s], Us[s * kUStride + col], part);
      part += __shfl_xor_sync(0xffffffffu, part, 1);
      part += __shfl_xor_sync(0xffffffffu, part, 2);
      if (lane == 0 && active) a.out[(t0 + t) * a.value_dim + hv * dv + j] = part;
    }

    // S = D_L S0 + Ktilde^T U
    const float d_last = Ds[L - 1];
#pragma unroll
    for (int r = 0; r < kRows; ++r) st[r] *= d_last;
    for (int t = 0; t < L; ++t) {
      const float ut = Us[t * kUStride + col];
      const float* kt = Ks + t * dk;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int i = r * kLanes + lane;
        if (i < dk) st[r] = fmaf(kt[i], ut, st[r]);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = r * kLanes + lane;
    if (active && i < dk) head_state[static_cast<int64_t>(i) * dv + j] = st[r];
  }
}

int64_t segment_floats(const DeltaNetShape& s, int64_t tokens) {
  const int64_t chunks = (tokens + kChunk - 1) / kChunk;
  return chunks * s.n_v_heads * kChunk * (s.head_k_dim + s.head_v_dim + kChunk + 2);
}

}  // namespace

bool delta_net_chunked_supported(const DeltaNetShape& s) {
  return s.head_k_dim <= kMaxDim && s.head_v_dim <= kMaxDim;
}

int64_t delta_net_chunked_workspace_floats(const DeltaNetShape& s, int64_t n) {
  check_delta_net_shape(s);
  if (n < 1) throw std::invalid_argument("delta_net_chunked_workspace_floats: n=" + std::to_string(n) + " (must be >= 1)");
  return segment_floats(s, std::min(n, kSegmentTokens));
}

void delta_net_recurrence_chunked(const DeltaNetShape& s, float* ssm_state, const float* qkv, const float* gate,
                                  const float* beta, float* out, int64_t n, float* workspace, cudaStream_t stream) {
  const std::string fn = "delta_net_recurrence_chunked: ";
  check_delta_net_shape(s);
  if (n < 1 || n > (int64_t{1} << 24)) throw std::invalid_argument(fn + "n=" + std::to_string(n) + " tokens (must be 1..2^24)");
  if (!delta_net_chunked_supported(s))
    throw std::invalid_argument(fn + "head_k_dim=" + std::to_string(s.head_k_dim) + ", head_v_dim=" +
                                std::to_string(s.head_v_dim) + " (the chunked path takes dims up to 128)");
  if (!ssm_state || !qkv || !gate || !beta || !out || !workspace)
    throw std::invalid_argument(fn + "ssm_state, qkv, gate, beta, out and workspace must be device pointers (one is null)");
  const int dk = static_cast<int>(s.head_k_dim), dv = static_cast<int>(s.head_v_dim);
  const size_t prep_smem = prep_smem_bytes(dk, dv), state_smem = state_smem_bytes(dk);
  CUDA_CHECK(cudaFuncSetAttribute(chunk_prep_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(prep_smem)));
  CUDA_CHECK(cudaFuncSetAttribute(chunk_state_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(state_smem)));
  const int64_t seg_cap = std::min(n, kSegmentTokens);
  const int64_t cap_chunks = (seg_cap + kChunk - 1) / kChunk;
  for (int64_t t0 = 0; t0 < n; t0 += kSegmentTokens) {
    const int64_t len = std::min(kSegmentTokens, n - t0);
    ChunkArgs a{};
    a.qkv = qkv + t0 * s.conv_dim();
    a.gate = gate + t0 * s.n_v_heads;
    a.beta = beta + t0 * s.n_v_heads;
    a.w = workspace;
    a.uhat = a.w + cap_chunks * s.n_v_heads * kChunk * dk;
    a.p = a.uhat + cap_chunks * s.n_v_heads * kChunk * dv;
    a.d = a.p + cap_chunks * s.n_v_heads * kChunk * kChunk;
    a.e = a.d + cap_chunks * s.n_v_heads * kChunk;
    a.state = ssm_state;
    a.out = out + t0 * s.value_dim();
    a.n = len;
    a.n_k_heads = s.n_k_heads;
    a.n_v_heads = s.n_v_heads;
    a.tiled = s.v_heads_tiled;
    a.dk = dk;
    a.dv = dv;
    a.key_dim = s.key_dim();
    a.conv_dim = s.conv_dim();
    a.value_dim = s.value_dim();
    const unsigned chunks = static_cast<unsigned>((len + kChunk - 1) / kChunk);
    chunk_prep_kernel<<<dim3(chunks, static_cast<unsigned>(s.n_v_heads)), kPrepThreads, prep_smem, stream>>>(a);
    CUDA_CHECK(cudaGetLastError());
    chunk_state_kernel<<<dim3(static_cast<unsigned>(s.n_v_heads), static_cast<unsigned>((dv + kColumns - 1) / kColumns)),
                         kStateThreads, state_smem, stream>>>(a);
    CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace moraine::cuda
