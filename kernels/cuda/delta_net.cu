// Gated DeltaNet stages (kernels/cuda/delta_net.h). Where the reference rounds each float
// operation separately (conv taps, norms), the kernels use the _rn intrinsics so nvcc cannot
// contract them into FMAs: the conv output then differs from the reference only through expf in
// SiLU, and the norms only through the order of their sums.
#include "kernels/cuda/delta_net.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"

namespace moraine::cuda {
namespace {

constexpr int kMaxConvKernel = 16;
constexpr int kMaxHeadK = 128;
constexpr int kMaxHeadV = 256;

__device__ inline float silu(float x) { return __fdiv_rn(x, __fadd_rn(1.0f, expf(-x))); }

// The L2 norm of one q or k head (global or shared memory) by one warp; l2_norm_qk_kernel and
// the fused recurrence both call it, so fusing changes no bit.
__device__ inline void l2_normalize_head(float* v, int dk, float eps, bool is_q, float scale) {
  const int lane = threadIdx.x % 32;
  float vals[kMaxHeadK / 32];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxHeadK / 32; ++i) {
    const int d = lane + 32 * i;
    vals[i] = d < dk ? v[d] : 0.0f;
    ss = fmaf(vals[i], vals[i], ss);
  }
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ss, eps)));
#pragma unroll
  for (int i = 0; i < kMaxHeadK / 32; ++i) {
    const int d = lane + 32 * i;
    if (d < dk) {
      const float y = __fmul_rn(vals[i], inv);
      v[d] = is_q ? __fmul_rn(y, scale) : y;
    }
  }
}

// The gates, shared by gates_kernel and the fused recurrence for the same reason.
__device__ inline float gate_of(float alpha, float a, float dt_bias) {
  const float x = __fadd_rn(alpha, dt_bias);
  const float sp = x > 20.0f ? x : log1pf(expf(x));
  return __fmul_rn(a, sp);
}

__device__ inline float beta_of(float b) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-b))); }

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument(what); }

void require(bool ok, const char* fn, const std::string& what) {
  if (!ok) bad(std::string(fn) + ": " + what);
}

void check_n(const char* fn, int64_t n) {
  // 2^24 tokens keeps every grid dimension below its limit (conv: n / 16 CTAs along y).
  require(n >= 1 && n <= (int64_t{1} << 24), fn, "n=" + std::to_string(n) + " tokens (must be 1..2^24)");
}

// ---------------------------------------------------------------- conv + SiLU

constexpr int kConvThreads = 128;
constexpr int kConvTokensPerThread = 16;

// One thread per (channel, run of up to kConvTokensPerThread tokens); the K-1 previous inputs
// ride in registers. When the launch has a single run of tokens (decode, short prefill) each
// thread owns its channel's whole history and updates conv_state in place at the end; otherwise
// conv_state_update_kernel runs after (runs of later tokens read the old state).
__global__ void __launch_bounds__(kConvThreads)
    conv_silu_kernel(const float* __restrict__ w, float* state, const float* __restrict__ mixed,
                     float* __restrict__ out, int64_t channels, int kernel, int64_t n, bool update_state) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kConvThreads + threadIdx.x;
  if (c >= channels) return;
  const int hist = kernel - 1;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kConvTokensPerThread;
  const int64_t t1 = min(n, t0 + kConvTokensPerThread);
  float wc[kMaxConvKernel], win[kMaxConvKernel];
#pragma unroll
  for (int j = 0; j < kMaxConvKernel; ++j) {
    wc[j] = j < hist ? w[c * kernel + j] : 0.0f;
    win[j] = 0.0f;
    if (j < hist) {
      const int64_t tj = t0 - hist + j;  // input index of window slot j
      win[j] = tj >= 0 ? mixed[tj * channels + c] : state[(hist + tj) * channels + c];
    }
  }
  const float w_last = w[c * kernel + hist];
  for (int64_t t = t0; t < t1; ++t) {
    const float x = mixed[t * channels + c];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxConvKernel; ++j)
      if (j < hist) acc = __fadd_rn(acc, __fmul_rn(wc[j], win[j]));
    acc = __fadd_rn(acc, __fmul_rn(w_last, x));
    out[t * channels + c] = silu(acc);
#pragma unroll
    for (int j = 0; j < kMaxConvKernel; ++j) {
      if (j + 1 < hist) win[j] = win[j + 1 < kMaxConvKernel ? j + 1 : j];
      else if (j + 1 == hist) win[j] = x;
    }
  }
  if (update_state) {
#pragma unroll
    for (int j = 0; j < kMaxConvKernel; ++j)
      if (j < hist) state[j * channels + c] = win[j];
  }
}

// state <- the last K-1 inputs of [state rows | mixed rows], per channel (reads before writes).
__global__ void __launch_bounds__(kConvThreads)
    conv_state_update_kernel(float* state, const float* __restrict__ mixed, int64_t channels, int hist, int64_t n) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kConvThreads + threadIdx.x;
  if (c >= channels) return;
  float v[kMaxConvKernel];
#pragma unroll
  for (int j = 0; j < kMaxConvKernel; ++j) {
    v[j] = 0.0f;
    if (j < hist) {
      const int64_t tj = n - hist + j;
      v[j] = tj >= 0 ? mixed[tj * channels + c] : state[(hist + tj) * channels + c];
    }
  }
#pragma unroll
  for (int j = 0; j < kMaxConvKernel; ++j)
    if (j < hist) state[j * channels + c] = v[j];
}

// ---------------------------------------------------------------- L2 norm of q and k

constexpr int kNormThreads = 256;  // one warp per head row

__global__ void __launch_bounds__(kNormThreads)
    l2_norm_qk_kernel(float* x, int64_t conv_dim, int64_t n_k_heads, int dk, int64_t rows, float eps, float scale) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kNormThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return;  // whole warps leave together
  const int64_t per_token = 2 * n_k_heads;
  const int64_t t = row / per_token, h = row % per_token;  // h < n_k_heads: q head, else k head
  l2_normalize_head(x + t * conv_dim + h * dk, dk, eps, h < n_k_heads, scale);
}

// ---------------------------------------------------------------- gates

constexpr int kGateThreads = 256;

__global__ void __launch_bounds__(kGateThreads)
    gates_kernel(const float* __restrict__ ba, const float* __restrict__ a, const float* __restrict__ dt_bias,
                 float* __restrict__ beta, float* __restrict__ gate, int64_t n_k_heads, int64_t n_v_heads,
                 bool split, int64_t total) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kGateThreads + threadIdx.x;
  if (idx >= total) return;
  const int64_t t = idx / n_v_heads, hv = idx % n_v_heads;
  const float* row = ba + t * 2 * n_v_heads;
  const float b = row[delta_net_b_index(hv, n_k_heads, n_v_heads, split)];
  const float al = row[delta_net_alpha_index(hv, n_k_heads, n_v_heads, split)];
  beta[idx] = beta_of(b);
  gate[idx] = gate_of(al, a[hv], dt_bias[hv]);
}

// ---------------------------------------------------------------- recurrence

// Thread layout: kLanesPerColumn consecutive lanes share one state column j (one value dim) and
// split its d_k rows as i = r * kLanesPerColumn + lane, so a column's dot products end with two
// shuffles and the shared-memory reads of k[i], q[i] are conflict-free broadcasts.
constexpr int kLanesPerColumn = 4;
constexpr int kRowsPerLane = kMaxHeadK / kLanesPerColumn;  // state registers per thread
constexpr int kMaxColumnsPerCta = 128;
constexpr int kMaxRecurrenceThreads = kMaxColumnsPerCta * kLanesPerColumn;
constexpr int kMinColumnsPerCta = 32;  // >= 128 threads: 4 staged values per thread suffice
constexpr int kStagePerThread = (2 * kMaxHeadK + kMaxColumnsPerCta + 2 + kMinColumnsPerCta * kLanesPerColumn - 1) /
                                (kMinColumnsPerCta * kLanesPerColumn);

struct RecurrenceArgs {
  float* state;
  const float* qkv;
  const float* gate;
  const float* beta;
  float* out;
  // fused gated RMSNorm (kFuseNorm): z [n][value_dim], norm weight [d_v]
  const float* z;
  const float* norm_w;
  float eps;  // of both norms
  // fused L2 norm and gates (kFusePrep): qkv is the raw conv output, beta and gate come from
  // ba [n][2 * n_v_heads] with a and dt_bias [n_v_heads]; q is scaled by `scale`
  const float* ba;
  const float* a;
  const float* dt_bias;
  float scale;
  int64_t n, n_k_heads, n_v_heads, dk, dv, key_dim, conv_dim, value_dim;
  bool tiled, split_ba;  // DeltaNetShape's v_heads_tiled and split_ba
  int columns;  // per CTA
};

// One CTA per (value head, run of `columns` state columns); tokens in order. Token t+1's q, k,
// v slice, beta and gate are loaded into registers while token t computes and stored to the
// other shared buffer before the one barrier per token. With kFuseNorm (one CTA covers the whole
// head) the gated RMSNorm's sum of squares goes through shared memory and token t's output is
// written after that barrier. With kFusePrep the staged q and k are L2-normalised by warps 0
// and 1 between that barrier and a second one, and beta and gate are made from b and alpha as
// they are staged (decode then needs only the conv kernel before this one).
template <bool kFuseNorm, bool kFusePrep>
__global__ void __launch_bounds__(kMaxRecurrenceThreads)
    recurrence_kernel(RecurrenceArgs p) {
  __shared__ float s_q[2][kMaxHeadK], s_k[2][kMaxHeadK], s_v[2][kMaxColumnsPerCta], s_beta[2], s_gate[2];
  __shared__ double s_ss[2][kMaxRecurrenceThreads / 32];
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  const int lane_in_col = tid % kLanesPerColumn;
  const int col_local = tid / kLanesPerColumn;
  const int64_t hv = blockIdx.x;
  const int64_t g = delta_net_key_head(hv, p.n_k_heads, p.n_v_heads, p.tiled);
  const int64_t b_at = delta_net_b_index(hv, p.n_k_heads, p.n_v_heads, p.split_ba);
  const int64_t alpha_at = delta_net_alpha_index(hv, p.n_k_heads, p.n_v_heads, p.split_ba);
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * p.columns;
  const int64_t j = col0 + col_local;
  const bool active = col_local < p.columns && j < p.dv;
  const int ncols = static_cast<int>(min(static_cast<int64_t>(p.columns), p.dv - col0));
  const int dk = static_cast<int>(p.dk);

  for (int e = tid; e < 2 * kMaxHeadK; e += nthreads) {  // rows >= d_k stay 0 (state rows too)
    (&s_q[0][0])[e] = 0.0f;
    (&s_k[0][0])[e] = 0.0f;
  }
  __syncthreads();

  auto stage_load = [&](int64_t t, float* vals) {
    const float* row = p.qkv + t * p.conv_dim;
#pragma unroll
    for (int s = 0; s < kStagePerThread; ++s) {
      const int e = tid + s * nthreads;
      float v = 0.0f;
      if (e < dk) v = row[g * dk + e];
      else if (e < 2 * dk) v = row[p.key_dim + g * dk + (e - dk)];
      else if (e < 2 * dk + ncols) v = row[2 * p.key_dim + hv * p.dv + col0 + (e - 2 * dk)];
      else if (e == 2 * dk + ncols)  // b of this head, or beta
        v = kFusePrep ? p.ba[t * 2 * p.n_v_heads + b_at] : p.beta[t * p.n_v_heads + hv];
      else if (e == 2 * dk + ncols + 1)  // alpha, or gate
        v = kFusePrep ? p.ba[t * 2 * p.n_v_heads + alpha_at] : p.gate[t * p.n_v_heads + hv];
      vals[s] = v;
    }
  };
  auto stage_store = [&](int buf, const float* vals) {
#pragma unroll
    for (int s = 0; s < kStagePerThread; ++s) {
      const int e = tid + s * nthreads;
      if (e < dk) s_q[buf][e] = vals[s];
      else if (e < 2 * dk) s_k[buf][e - dk] = vals[s];
      else if (e < 2 * dk + ncols) s_v[buf][e - 2 * dk] = vals[s];
      else if (e == 2 * dk + ncols) s_beta[buf] = kFusePrep ? beta_of(vals[s]) : vals[s];
      else if (e == 2 * dk + ncols + 1) s_gate[buf] = kFusePrep ? gate_of(vals[s], p.a[hv], p.dt_bias[hv]) : vals[s];
    }
  };
  // After the barrier that published buffer `buf`: normalise its q and k, then barrier again.
  auto stage_normalize = [&](int buf) {
    if constexpr (kFusePrep) {
      if (tid / 32 == 0) l2_normalize_head(s_q[buf], dk, p.eps, true, p.scale);
      if (tid / 32 == 1) l2_normalize_head(s_k[buf], dk, p.eps, false, p.scale);
      __syncthreads();
    }
  };

  float* head_state = p.state + hv * p.dk * p.dv;
  float st[kRowsPerLane];
#pragma unroll
  for (int r = 0; r < kRowsPerLane; ++r) {
    const int i = r * kLanesPerColumn + lane_in_col;
    st[r] = active && i < dk ? head_state[static_cast<int64_t>(i) * p.dv + j] : 0.0f;
  }
  float norm_w = 0.0f;
  if constexpr (kFuseNorm) norm_w = active ? p.norm_w[j] : 0.0f;

  float staged[kStagePerThread];
  stage_load(0, staged);
  stage_store(0, staged);
  __syncthreads();
  stage_normalize(0);

  for (int64_t t = 0; t < p.n; ++t) {
    const int buf = static_cast<int>(t & 1);
    if (t + 1 < p.n) stage_load(t + 1, staged);
    float zj = 0.0f;
    if constexpr (kFuseNorm) zj = active ? p.z[t * p.value_dim + hv * p.dv + j] : 0.0f;

    const float decay = expf(s_gate[buf]);
    const float beta = s_beta[buf];
    // w = S^T k with S already decayed; four partial sums shorten the dependent FMA chain.
    float w4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < kRowsPerLane; ++r) {
      st[r] *= decay;
      w4[r % 4] = fmaf(st[r], s_k[buf][r * kLanesPerColumn + lane_in_col], w4[r % 4]);
    }
    float w = (w4[0] + w4[1]) + (w4[2] + w4[3]);
    w += __shfl_xor_sync(0xffffffffu, w, 1);
    w += __shfl_xor_sync(0xffffffffu, w, 2);
    const float u = beta * ((active ? s_v[buf][col_local] : 0.0f) - w);
    float o4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < kRowsPerLane; ++r) {
      const int i = r * kLanesPerColumn + lane_in_col;
      st[r] = fmaf(s_k[buf][i], u, st[r]);
      o4[r % 4] = fmaf(st[r], s_q[buf][i], o4[r % 4]);
    }
    float o = (o4[0] + o4[1]) + (o4[2] + o4[3]);
    o += __shfl_xor_sync(0xffffffffu, o, 1);
    o += __shfl_xor_sync(0xffffffffu, o, 2);

    if constexpr (!kFuseNorm) {
      if (active && lane_in_col == 0) p.out[t * p.value_dim + hv * p.dv + j] = o;
    } else {
      double ss = active && lane_in_col == 0 ? static_cast<double>(o) * o : 0.0;
      for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
      if (tid % 32 == 0) s_ss[buf][tid / 32] = ss;
    }
    if (t + 1 < p.n) stage_store(buf ^ 1, staged);
    __syncthreads();
    if constexpr (kFuseNorm) {
      // s_ss[buf] is rewritten at token t + 2, after the next barrier.
      double total = 0.0;
      for (int wi = 0; wi < nthreads / 32; ++wi) total += s_ss[buf][wi];
      if (active && lane_in_col == 0) {
        const float mean = __double2float_rn(__ddiv_rn(total, static_cast<double>(p.dv)));
        const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, p.eps)));
        const float y = __fmul_rn(__fmul_rn(o, inv), norm_w);
        p.out[t * p.value_dim + hv * p.dv + j] = __fmul_rn(y, silu(zj));
      }
    }
    if (t + 1 < p.n) stage_normalize(buf ^ 1);
  }

#pragma unroll
  for (int r = 0; r < kRowsPerLane; ++r) {
    const int i = r * kLanesPerColumn + lane_in_col;
    if (active && i < dk) head_state[static_cast<int64_t>(i) * p.dv + j] = st[r];
  }
}

// delta_net_mix fuses the L2 norm, the gates and the gated RMSNorm into the token loop only for
// calls this short, where launches dominate: a CTA that covers a whole head (for the norm) has
// 4x fewer CTAs per token step, and the fused L2 norm costs a second barrier per token. Measured
// on the H200 at Qwen3-Next's shape: decode (conv + fused loop) 12.8 us a token, vs 19.0 us with
// only the norm fused and about 24 us unfused (each stage launch 4.8-6.2 us); but an 8192-token
// prefill took 16.7 ms with the norm fused vs 8.6 ms for the 32-column loop alone.
constexpr int64_t kFuseMaxTokens = 4;

void launch_recurrence(const DeltaNetShape& s, RecurrenceArgs args, bool fuse_norm, bool fuse_prep,
                       cudaStream_t stream) {
  // Fusing the norm needs the whole head in one CTA; otherwise 32 columns per CTA spread the
  // heads over 4x more SMs (decode reads the state once: more SMs, more bandwidth).
  int columns = kMinColumnsPerCta;
  if (fuse_norm) columns = static_cast<int>((s.head_v_dim + 31) / 32 * 32);
  args.columns = columns;
  const dim3 grid(static_cast<unsigned>(s.n_v_heads), static_cast<unsigned>((s.head_v_dim + columns - 1) / columns));
  const int threads = columns * kLanesPerColumn;
  if (fuse_norm && fuse_prep)
    recurrence_kernel<true, true><<<grid, threads, 0, stream>>>(args);
  else if (fuse_norm)
    recurrence_kernel<true, false><<<grid, threads, 0, stream>>>(args);
  else if (fuse_prep)
    recurrence_kernel<false, true><<<grid, threads, 0, stream>>>(args);
  else
    recurrence_kernel<false, false><<<grid, threads, 0, stream>>>(args);
  CUDA_CHECK(cudaGetLastError());
}

RecurrenceArgs recurrence_args(const DeltaNetShape& s, float* ssm_state, const float* qkv, const float* gate,
                               const float* beta, float* out, int64_t n) {
  RecurrenceArgs a{};
  a.state = ssm_state;
  a.qkv = qkv;
  a.gate = gate;
  a.beta = beta;
  a.out = out;
  a.n = n;
  a.n_k_heads = s.n_k_heads;
  a.n_v_heads = s.n_v_heads;
  a.tiled = s.v_heads_tiled;
  a.split_ba = s.split_ba;
  a.dk = s.head_k_dim;
  a.dv = s.head_v_dim;
  a.key_dim = s.key_dim();
  a.conv_dim = s.conv_dim();
  a.value_dim = s.value_dim();
  return a;
}

// ---------------------------------------------------------------- gated RMSNorm

constexpr int kGatedNormThreads = 256;  // one warp per (token, value head)

// The sum of squares is added in exactly the fused recurrence kernel's order (groups of 8
// columns, each a butterfly over lanes 4 * column + {0..3} with only the first lane of a column
// non-zero, then the groups in order), so a head's output is the same bits whichever path made
// it (delta_net_mix fuses it for short calls only).
__global__ void __launch_bounds__(kGatedNormThreads)
    gated_rms_norm_kernel(float* o, const float* __restrict__ z, const float* __restrict__ w, int64_t dv,
                          int64_t rows, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kGatedNormThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  float* orow = o + row * dv;
  const float* zrow = z + row * dv;
  constexpr int kColumnsPerWarp = 32 / kLanesPerColumn;
  double total = 0.0;
  for (int64_t c0 = 0; c0 < dv; c0 += kColumnsPerWarp) {
    const int64_t j = c0 + lane / kLanesPerColumn;
    double ss = 0.0;
    if (lane % kLanesPerColumn == 0 && j < dv) {
      const double v = orow[j];
      ss = v * v;
    }
    for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    total += ss;
  }
  const float mean = __double2float_rn(__ddiv_rn(total, static_cast<double>(dv)));
  const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
  for (int64_t i = lane; i < dv; i += 32) {
    const float y = __fmul_rn(__fmul_rn(orow[i], inv), w[i]);
    orow[i] = __fmul_rn(y, silu(zrow[i]));
  }
}

// 1/sqrt(d_k) computed on the host as the reference does.
float q_scale(const DeltaNetShape& s) { return 1.0f / std::sqrt(static_cast<float>(s.head_k_dim)); }

unsigned blocks_for(int64_t items, int per_block) { return static_cast<unsigned>((items + per_block - 1) / per_block); }

}  // namespace

void check_delta_net_shape(const DeltaNetShape& s) {
  const auto field = [](const char* name, int64_t v, int64_t lo, int64_t hi) {
    if (v < lo || v > hi)
      bad(std::string("DeltaNetShape: ") + name + "=" + std::to_string(v) + " (must be " + std::to_string(lo) +
          ".." + std::to_string(hi) + ")");
  };
  field("n_k_heads", s.n_k_heads, 1, 65535);
  field("n_v_heads", s.n_v_heads, 1, 65535);  // a grid dimension of the chunked path
  field("head_k_dim", s.head_k_dim, 1, kMaxHeadK);
  field("head_v_dim", s.head_v_dim, 1, kMaxHeadV);
  field("conv_kernel", s.conv_kernel, 1, kMaxConvKernel);
  if (s.n_v_heads % s.n_k_heads != 0)
    bad("DeltaNetShape: n_v_heads=" + std::to_string(s.n_v_heads) + " is not a multiple of n_k_heads=" +
        std::to_string(s.n_k_heads));
}

void delta_net_conv_silu(const DeltaNetShape& s, const float* conv_w, float* conv_state, const float* mixed,
                         float* conv_out, int64_t n, cudaStream_t stream) {
  constexpr const char* fn = "delta_net_conv_silu";
  check_delta_net_shape(s);
  check_n(fn, n);
  require(conv_w && mixed && conv_out, fn, "conv_w, mixed and conv_out must be device pointers (one is null)");
  require(conv_state || s.conv_kernel == 1, fn, "conv_state is null but conv_kernel > 1");
  const int64_t channels = s.conv_dim();
  const int hist = static_cast<int>(s.conv_kernel) - 1;
  const unsigned runs = blocks_for(n, kConvTokensPerThread);
  const bool in_kernel_update = runs == 1;
  conv_silu_kernel<<<dim3(blocks_for(channels, kConvThreads), runs), kConvThreads, 0, stream>>>(
      conv_w, conv_state, mixed, conv_out, channels, static_cast<int>(s.conv_kernel), n, in_kernel_update && hist > 0);
  CUDA_CHECK(cudaGetLastError());
  if (!in_kernel_update && hist > 0) {
    conv_state_update_kernel<<<blocks_for(channels, kConvThreads), kConvThreads, 0, stream>>>(conv_state, mixed,
                                                                                             channels, hist, n);
    CUDA_CHECK(cudaGetLastError());
  }
}

void delta_net_l2_norm_qk(const DeltaNetShape& s, float* x, int64_t n, float eps, cudaStream_t stream) {
  constexpr const char* fn = "delta_net_l2_norm_qk";
  check_delta_net_shape(s);
  check_n(fn, n);
  require(x != nullptr, fn, "x is null");
  const int64_t rows = n * 2 * s.n_k_heads;
  const float scale = q_scale(s);
  l2_norm_qk_kernel<<<blocks_for(rows, kNormThreads / 32), kNormThreads, 0, stream>>>(
      x, s.conv_dim(), s.n_k_heads, static_cast<int>(s.head_k_dim), rows, eps, scale);
  CUDA_CHECK(cudaGetLastError());
}

void delta_net_gates(const DeltaNetShape& s, const float* ba, const float* a, const float* dt_bias, float* beta,
                     float* gate, int64_t n, cudaStream_t stream) {
  constexpr const char* fn = "delta_net_gates";
  check_delta_net_shape(s);
  check_n(fn, n);
  require(ba && a && dt_bias && beta && gate, fn, "ba, a, dt_bias, beta and gate must be device pointers (one is null)");
  const int64_t total = n * s.n_v_heads;
  gates_kernel<<<blocks_for(total, kGateThreads), kGateThreads, 0, stream>>>(ba, a, dt_bias, beta, gate, s.n_k_heads,
                                                                             s.n_v_heads, s.split_ba, total);
  CUDA_CHECK(cudaGetLastError());
}

void delta_net_recurrence(const DeltaNetShape& s, float* ssm_state, const float* qkv, const float* gate,
                          const float* beta, float* out, int64_t n, cudaStream_t stream) {
  constexpr const char* fn = "delta_net_recurrence";
  check_delta_net_shape(s);
  check_n(fn, n);
  require(ssm_state && qkv && gate && beta && out, fn,
          "ssm_state, qkv, gate, beta and out must be device pointers (one is null)");
  launch_recurrence(s, recurrence_args(s, ssm_state, qkv, gate, beta, out, n), false, false, stream);
}

void delta_net_gated_rms_norm(const DeltaNetShape& s, float* o, const float* z, const float* norm_w, int64_t n,
                              float eps, cudaStream_t stream) {
  constexpr const char* fn = "delta_net_gated_rms_norm";
  check_delta_net_shape(s);
  check_n(fn, n);
  require(o && z && norm_w, fn, "o, z and norm_w must be device pointers (one is null)");
  const int64_t rows = n * s.n_v_heads;
  gated_rms_norm_kernel<<<blocks_for(rows, kGatedNormThreads / 32), kGatedNormThreads, 0, stream>>>(
      o, z, norm_w, s.head_v_dim, rows, eps);
  CUDA_CHECK(cudaGetLastError());
}

int64_t delta_net_workspace_floats(const DeltaNetShape& s, int64_t n) {
  check_delta_net_shape(s);
  check_n("delta_net_workspace_floats", n);
  return delta_net_mix_workspace_floats(s, n);
}

void delta_net_mix(const DeltaNetShape& s, const DeltaNetWeightsDevice& w, const DeltaNetStateDevice& state,
                   const float* mixed, const float* z, const float* ba, int64_t n, float eps, float* workspace,
                   float* out, cudaStream_t stream) {
  constexpr const char* fn = "delta_net_mix";
  check_delta_net_shape(s);
  check_n(fn, n);
  require(w.conv_w && w.a && w.dt_bias && w.norm_w, fn, "a weight pointer is null (conv_w, a, dt_bias, norm_w)");
  require(state.ssm_state && (state.conv_state || s.conv_kernel == 1), fn, "a state pointer is null");
  require(mixed && z && ba && workspace && out, fn, "mixed, z, ba, workspace and out must be device pointers");
  float* conv_out = workspace;
  float* beta = conv_out + n * s.conv_dim();
  float* gate = beta + n * s.n_v_heads;
  delta_net_conv_silu(s, w.conv_w, state.conv_state, mixed, conv_out, n, stream);
  // The token loop for every length: the chunked form (delta_net_recurrence_chunked) is correct
  // but measured slower so far (8192 tokens: 12.5 ms vs 8.6 ms; 512: 0.76 vs 0.44 ms).
  if (n > kFuseMaxTokens) {
    delta_net_l2_norm_qk(s, conv_out, n, eps, stream);
    delta_net_gates(s, ba, w.a, w.dt_bias, beta, gate, n, stream);
    launch_recurrence(s, recurrence_args(s, state.ssm_state, conv_out, gate, beta, out, n), false, false, stream);
    delta_net_gated_rms_norm(s, out, z, w.norm_w, n, eps, stream);
    return;
  }
  // Short call: L2 norm and gates fused into the token loop, and the gated norm too when one CTA
  // can hold a head (d_v <= 128). Same bits as the path above (shared device functions, the
  // norm's squares added in the same order).
  RecurrenceArgs args = recurrence_args(s, state.ssm_state, conv_out, nullptr, nullptr, out, n);
  args.ba = ba;
  args.a = w.a;
  args.dt_bias = w.dt_bias;
  args.eps = eps;
  args.scale = q_scale(s);
  const bool fuse_norm = s.head_v_dim <= kMaxColumnsPerCta;
  if (fuse_norm) {
    args.z = z;
    args.norm_w = w.norm_w;
  }
  launch_recurrence(s, args, fuse_norm, true, stream);
  if (!fuse_norm) delta_net_gated_rms_norm(s, out, z, w.norm_w, n, eps, stream);
}

}  // namespace moraine::cuda
