// One warp per head, q heads then k heads of a token (grid.y = token); a k head's warp also
// copies that head of v. The CTA also fills a table of the token's RoPE cos/sin (n_rot / 2
// pairs, computed once per CTA instead of once per head and pair as rope.cu does; the same double
// expression, so the same floats). Each head then goes through head_rms_norm.cu's steps (lane
// strided double sum of squares, xor tree, rounded float scale) and rope.cu's rotation; a warp
// recomputes its normed elements where rope needs them instead of re-reading a stored copy, which
// gives the same bits since every step is an explicitly rounded operation.
#include "kernels/cuda/qk_norm_rope_store.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"

namespace moraine::cuda {
namespace {

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

}  // namespace

void qk_norm_rope_store(const QkNormRopeStoreArgs& a, cudaStream_t stream) {
  const std::string shape = "rows=" + std::to_string(a.rows) + ", n_head=" + std::to_string(a.n_head) +
                            ", n_head_kv=" + std::to_string(a.n_head_kv) + ", head_dim=" + std::to_string(a.head_dim) +
                            ", n_rot=" + std::to_string(a.n_rot) + ", max_pos=" + std::to_string(a.max_pos);
  if (a.rows <= 0 || a.rows > 65535 || a.n_head <= 0 || a.n_head_kv <= 0 || a.head_dim <= 0 || a.head_dim > 4096 ||
      a.n_rot <= 0 || a.n_rot % 2 != 0 || a.n_rot > a.head_dim || a.max_pos < a.rows)
    throw std::invalid_argument("qk_norm_rope_store: " + shape +
                                " (need rows in 1..65535, positive head counts, head_dim in 1..4096, an even n_rot"
                                " in 2..head_dim, max_pos >= rows)");
  if (a.q_head_stride < a.head_dim || a.q_row_stride < a.n_head * a.q_head_stride - (a.q_head_stride - a.head_dim) ||
      a.k_row_stride < a.n_head_kv * a.head_dim || a.v_row_stride < a.n_head_kv * a.head_dim)
    throw std::invalid_argument("qk_norm_rope_store: strides q row " + std::to_string(a.q_row_stride) + ", q head " +
                                std::to_string(a.q_head_stride) + ", k row " + std::to_string(a.k_row_stride) +
                                ", v row " + std::to_string(a.v_row_stride) + " too small for " + shape);
  if (a.q == nullptr || a.k == nullptr || a.v == nullptr || a.q_norm == nullptr || a.k_norm == nullptr ||
      a.pos0_dev == nullptr || a.q_out == nullptr || a.k_cache == nullptr || a.v_cache == nullptr)
    throw std::invalid_argument("qk_norm_rope_store: a null pointer among q, k, v, q_norm, k_norm, pos0_dev, q_out, "
                                "k_cache, v_cache (" + shape + ")");
  const Params p{a.q,      a.q_row_stride, a.q_head_stride, a.k,         a.k_row_stride, a.v,      a.v_row_stride,
                 a.q_norm, a.k_norm,       a.n_head,        a.n_head_kv, a.head_dim,     a.n_rot,  a.pos0_dev,
                 a.freq_base, a.eps,       a.rows,          a.max_pos,   a.q_out,        a.k_cache, a.v_cache};
  const int64_t heads = a.n_head + a.n_head_kv;
  const dim3 grid(static_cast<unsigned>((heads + kWarpsPerCta - 1) / kWarpsPerCta), static_cast<unsigned>(a.rows));
  const size_t smem = static_cast<size_t>(a.n_rot) * sizeof(float);  // n_rot/2 cos + n_rot/2 sin
  qk_norm_rope_store_kernel<<<grid, 32 * kWarpsPerCta, smem, stream>>>(p);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moraine::cuda
