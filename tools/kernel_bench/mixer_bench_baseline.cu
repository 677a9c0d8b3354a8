// The decode kernels of tools/kernel_bench/mixer_bench.cu as they were before the changes that
// bench measures (kernels/cuda/matvec_float.cu, router.cu, qk_norm_rope_store.cu at
// the commit before them), kept verbatim so one run can compare old and new side by side.
// Bench-only code: nothing else links it.
#include "tools/kernel_bench/mixer_bench_baseline.h"

#include <cmath>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/matvec_float_row.cuh"
#include "kernels/cuda/route_warp.cuh"

namespace moraine::kernel_bench::baseline {

namespace mf {
using namespace cuda::matvec_float_detail;
constexpr int kRowsPerCta = 8;

template <TensorType T>
__global__ void __launch_bounds__(32 * kRowsPerCta)
    matvec_float_kernel(const uint8_t* __restrict__ w, int64_t rows, int64_t n, const float* __restrict__ x,
                        float* __restrict__ y, int64_t w_stride, int64_t act_stride, int64_t out_stride,
                        const int32_t* __restrict__ ids, size_t elem_bytes, bool accumulate) {
  extern __shared__ float xs[];
  const int e = blockIdx.y;
  const float* xe = reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(x) + e * act_stride);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) xs[i] = round_activation<T>(xe[i]);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + warp;
  if (row >= rows) return;
  const int64_t mat = ids != nullptr ? ids[e] : e;
  const uint8_t* wr = w + mat * w_stride + row * n * static_cast<int64_t>(elem_bytes);
  const float acc = row_dot_warp<T>(wr, xs, n, lane);
  if (lane == 0) {
    float* out = y + e * out_stride + row;
    *out = accumulate ? __fadd_rn(*out, acc) : acc;  // residual_add's rounded addition
  }
}

}  // namespace mf

namespace rt {
using namespace cuda;
constexpr int kWarpsPerCta = 4;

// One warp per token; its probabilities in shared memory ([kWarpsPerCta][n_expert]); the
// per-token work is route_warp.cuh's (shared with the fused router, router_fused.cu).
__global__ void route_kernel(const float* __restrict__ logits, int64_t n, int64_t ne, int64_t k, bool renorm,
                             int32_t* __restrict__ chosen, float* __restrict__ weight) {
  extern __shared__ float prob_all[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + warp;
  if (t >= n) return;
  route_detail::route_token_warp(logits + t * ne, prob_all + warp * ne, ne, k, renorm, chosen + t * k, weight + t * k,
                                 lane);
}

}  // namespace rt

namespace qk {
constexpr int kWarpsPerCta = 4;

struct Params {
  const float* q;
  int64_t q_row_stride, q_head_stride;
  const float* k;
  int64_t k_row_stride;
  const float* v;
  int64_t v_row_stride;
  const float* q_norm;
  const float* k_norm;
  int64_t n_head, n_head_kv, hd, n_rot;
  const int32_t* pos0_dev;
  double freq_base;
  float eps;
  int64_t rows, max_pos;
  float* q_out;
  float* k_cache;
  float* v_cache;
};

__global__ void __launch_bounds__(32 * kWarpsPerCta) qk_norm_rope_store_kernel(const Params p) {
  extern __shared__ float table[];  // cos of pair i at table[i], sin at table[half + i]
  const int64_t half = p.n_rot / 2;
  const int64_t t = blockIdx.y;
  const int64_t pos0 = *p.pos0_dev;
  const bool rope_nan = pos0 < 0;                              // rope_neox_at's bad position
  const bool store = !rope_nan && pos0 + p.rows <= p.max_pos;  // kv_store_at's
  const int64_t head = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t hd = p.hd, kv_dim = p.n_head_kv * hd;
  const bool is_q = head < p.n_head;
  const int64_t kh = head - p.n_head;
  // Warps past the last head, and k heads when the cache is not written, have nothing to do but
  // must still reach the barrier below. `active` is uniform per warp (the shuffles need that).
  const bool active = head < p.n_head + p.n_head_kv && (is_q || store);
  const float* xh = nullptr;
  const float* w = nullptr;
  float* oh = nullptr;
  float inv = 0.0f;
  if (active) {
    if (is_q) {
      xh = p.q + t * p.q_row_stride + head * p.q_head_stride;
      w = p.q_norm;
      oh = p.q_out + (t * p.n_head + head) * hd;
    } else {
      xh = p.k + t * p.k_row_stride + kh * hd;
      w = p.k_norm;
      oh = p.k_cache + (pos0 + t) * kv_dim + kh * hd;
      const float* vh = p.v + t * p.v_row_stride + kh * hd;
      float* vo = p.v_cache + (pos0 + t) * kv_dim + kh * hd;
      for (int64_t i = lane; i < hd; i += 32) vo[i] = vh[i];
    }
    // The norm's scale before the barrier, so the head's loads overlap the table's math.
    double ss = 0.0;
    for (int64_t i = lane; i < hd; i += 32) {
      const double x = xh[i];
      ss += x * x;
    }
    for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float mean = __double2float_rn(__ddiv_rn(ss, static_cast<double>(hd)));
    inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, p.eps)));
  }
  if (!rope_nan) {
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
      const double theta = static_cast<double>(pos0 + t) *
                           pow(p.freq_base, -2.0 * static_cast<double>(i) / static_cast<double>(p.n_rot));
      const float c = static_cast<float>(cos(theta));
      const float s = static_cast<float>(sin(theta));
      table[i] = c;
      table[half + i] = s;
    }
  }
  __syncthreads();
  if (!active) return;
  for (int64_t i = lane; i < hd; i += 32) {
    if (i < half) {  // the pair (i, i + half)
      if (rope_nan) {
        oh[i] = oh[i + half] = __int_as_float(0x7fc00000);
        continue;
      }
      const float x0 = __fmul_rn(__fmul_rn(xh[i], inv), w[i]);
      const float x1 = __fmul_rn(__fmul_rn(xh[i + half], inv), w[i + half]);
      const float c = table[i], s = table[half + i];
      oh[i] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
      oh[i + half] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    } else if (i >= p.n_rot) {  // past the rotated dims: normed only
      oh[i] = __fmul_rn(__fmul_rn(xh[i], inv), w[i]);
    }
  }
}

}  // namespace qk

void matvec_f32(const float* w, int64_t rows, int64_t n, const float* x, float* y, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((rows + mf::kRowsPerCta - 1) / mf::kRowsPerCta), 1);
  mf::matvec_float_kernel<TensorType::F32><<<grid, 32 * mf::kRowsPerCta, static_cast<size_t>(n) * 4, stream>>>(
      reinterpret_cast<const uint8_t*>(w), rows, n, x, y, 0, 0, 0, nullptr, 4, false);
  CUDA_CHECK(cudaGetLastError());
}

void route(const float* logits, int64_t n, int64_t ne, int64_t k, bool renorm, int32_t* chosen, float* weight,
           cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(rt::kWarpsPerCta * ne) * sizeof(float);
  rt::route_kernel<<<static_cast<unsigned>((n + rt::kWarpsPerCta - 1) / rt::kWarpsPerCta), 32 * rt::kWarpsPerCta, smem,
                     stream>>>(logits, n, ne, k, renorm, chosen, weight);
  CUDA_CHECK(cudaGetLastError());
}

void qk_norm_rope_store(const cuda::QkNormRopeStoreArgs& a, cudaStream_t stream) {
  const qk::Params p{a.q,      a.q_row_stride, a.q_head_stride, a.k,         a.k_row_stride, a.v,       a.v_row_stride,
                     a.q_norm, a.k_norm,       a.n_head,        a.n_head_kv, a.head_dim,     a.n_rot,   a.pos0_dev,
                     a.freq_base, a.eps,       a.rows,          a.max_pos,   a.q_out,        a.k_cache, a.v_cache};
  const int64_t heads = a.n_head + a.n_head_kv;
  const dim3 grid(static_cast<unsigned>((heads + qk::kWarpsPerCta - 1) / qk::kWarpsPerCta), static_cast<unsigned>(a.rows));
  qk::qk_norm_rope_store_kernel<<<grid, 32 * qk::kWarpsPerCta, static_cast<size_t>(a.n_rot) * 4, stream>>>(p);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moraine::kernel_bench::baseline
