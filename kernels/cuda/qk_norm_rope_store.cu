// One warp per head, q heads then k heads of a token (grid.y = token); a k head's warp also
// copies that head of v. The CTA also fills a table of the token's RoPE cos/sin (n_rot / 2
// pairs, computed once per CTA instead of once per head and pair as rope.cu does; the same double
// expression, so the same floats). Each head then goes through head_rms_norm.cu's steps (lane
// strided double sum of squares, xor tree, rounded float scale) and rope.cu's rotation; a warp
// recomputes its normed elements where rope needs them instead of re-reading a stored copy, which
// gives the same bits since every step is an explicitly rounded operation.
#include "kernels/cuda/qk_norm_rope_store.h"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"

namespace moraine::cuda {
namespace {

constexpr int kWarpsPerCta = 4;
constexpr int kPerLane = 4;  // elements per lane in flight at once: a 128-dim head in one go
constexpr int kChunk = 32 * kPerLane;

// KV: the cache element (float, or __half: each stored value rounded to nearest even).
template <class KV>
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
  KV* k_cache;
  KV* v_cache;
  const float* q_bias;   // the normed form's (glm4moe: bias, then q/k norm); nullable
  const float* k_bias;
  const float* v_bias;
};

// x[i] + b[i], one rounded add as the reference adds a projection's bias; x[i] itself without one.
__device__ __forceinline__ float add_bias(const float* x, const float* b, int64_t i) {
  return b != nullptr ? __fadd_rn(x[i], b[i]) : x[i];
}

__device__ __forceinline__ void put(float* p, float x) { *p = x; }
__device__ __forceinline__ void put(__half* p, float x) { *p = __float2half_rn(x); }

// One lane's inputs for the rotation of a chunk: elements i = c + lane + 32 j of the head and
// their rope partners i + half (zero where the lane has nothing to write).
struct RopeChunk {
  float x0[kPerLane], x1[kPerLane], w0[kPerLane], w1[kPerLane];
};

__device__ __forceinline__ void load_rope_chunk(RopeChunk& r, const float* xh, const float* bh, const float* w, int64_t c,
                                                int lane, int64_t half, int64_t n_rot, int64_t hd) {
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int64_t i = c + lane + 32 * j;
    const bool pair = i < half, tail = i >= n_rot && i < hd;
    r.x0[j] = pair || tail ? add_bias(xh, bh, i) : 0.0f;
    r.w0[j] = pair || tail ? w[i] : 0.0f;
    r.x1[j] = pair ? add_bias(xh, bh, i + half) : 0.0f;
    r.w1[j] = pair ? w[i + half] : 0.0f;
  }
}

// rope.cu's rotation of the normed pair (head_rms_norm.cu's rounded scale, then the weight), or
// the normed value alone past the rotated dims; NaN in the rotated dims for a negative position.
// O: float (q_out, a float cache) or __half (a half cache: the float result rounded once).
template <class O>
__device__ __forceinline__ void store_rope_chunk(const RopeChunk& r, O* oh, const float* table, float inv,
                                                 bool rope_nan, int64_t c, int lane, int64_t half, int64_t n_rot,
                                                 int64_t hd) {
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int64_t i = c + lane + 32 * j;
    if (i < half) {  // the pair (i, i + half)
      if (rope_nan) {
        put(oh + i, __int_as_float(0x7fc00000));
        put(oh + i + half, __int_as_float(0x7fc00000));
        continue;
      }
      const float n0 = __fmul_rn(__fmul_rn(r.x0[j], inv), r.w0[j]);
      const float n1 = __fmul_rn(__fmul_rn(r.x1[j], inv), r.w1[j]);
      const float cs = table[i], sn = table[half + i];
      put(oh + i, __fsub_rn(__fmul_rn(n0, cs), __fmul_rn(n1, sn)));
      put(oh + i + half, __fadd_rn(__fmul_rn(n0, sn), __fmul_rn(n1, cs)));
    } else if (i >= n_rot && i < hd) {  // past the rotated dims: normed only
      put(oh + i, __fmul_rn(__fmul_rn(r.x0[j], inv), r.w0[j]));
    }
  }
}

template <class KV>
__global__ void __launch_bounds__(32 * kWarpsPerCta) qk_norm_rope_store_kernel(const Params<KV> p) {
  extern __shared__ float table[];  // cos of pair i at table[i], sin at table[half + i]
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
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
  const bool in_head = head < p.n_head + p.n_head_kv;
  const bool active = in_head && (is_q || store);
  const float* xh = is_q ? p.q + t * p.q_row_stride + head * p.q_head_stride : p.k + t * p.k_row_stride + kh * hd;
  const float* vh = p.v + t * p.v_row_stride + kh * hd;
  const float* w = is_q ? p.q_norm : p.k_norm;
  const float* bh = is_q ? (p.q_bias != nullptr ? p.q_bias + head * hd : nullptr)
                         : (p.k_bias != nullptr ? p.k_bias + kh * hd : nullptr);
  const float* vbh = p.v_bias != nullptr ? p.v_bias + kh * hd : nullptr;
  // The head's first kChunk elements, a k head's v and the rotation's inputs for that chunk
  // (the norm weights: one more L2 round trip after the barrier otherwise) go in flight first,
  // in registers, with no dependence on the position: their latency overlaps the position load
  // and the table's math below. The previous version loaded one element per lane per loop step
  // (and copied v with a store between loads): about ten dependent memory round trips per warp.
  // H200, Qwen3-30B-A3B heads, one token: 4.8 -> 3.6 us ncu-timed (graph-replayed 4.0 -> 2.8).
  float x_first[kPerLane], v_first[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int64_t i = lane + 32 * j;
    x_first[j] = in_head && i < hd ? add_bias(xh, bh, i) : 0.0f;
    v_first[j] = in_head && !is_q && i < hd ? add_bias(vh, vbh, i) : 0.0f;
  }
  RopeChunk first_chunk;
  if (in_head) load_rope_chunk(first_chunk, xh, bh, w, 0, lane, half, p.n_rot, hd);
  // The table, entry k by thread k: cos of pair k for k < half, sin of pair k - half above (one
  // double trigonometric function per thread instead of two in a row on half the threads). The
  // frequency (pow) does not depend on the position, so it is computed while the position load
  // is in flight.
  for (int64_t k = threadIdx.x; k < 2 * half; k += blockDim.x) {
    const int64_t i = k < half ? k : k - half;
    const double freq = pow(p.freq_base, -2.0 * static_cast<double>(i) / static_cast<double>(p.n_rot));
    if (!rope_nan) {
      const double theta = static_cast<double>(pos0 + t) * freq;
      table[k] = static_cast<float>(k < half ? cos(theta) : sin(theta));
    }
  }
  float* oq = nullptr;   // a q head's output, or
  KV* ok = nullptr;      // a k head's cache row
  float inv = 0.0f;
  if (active) {
    if (is_q) {
      oq = p.q_out + (t * p.n_head + head) * hd;
    } else {
      ok = p.k_cache + (pos0 + t) * kv_dim + kh * hd;
      KV* vo = p.v_cache + (pos0 + t) * kv_dim + kh * hd;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        if (lane + 32 * j < hd) put(vo + lane + 32 * j, v_first[j]);
      }
      for (int64_t c = kChunk; c < hd; c += kChunk) {
        float vv[kPerLane];
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) vv[j] = c + lane + 32 * j < hd ? add_bias(vh, vbh, c + lane + 32 * j) : 0.0f;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
          if (c + lane + 32 * j < hd) put(vo + c + lane + 32 * j, vv[j]);
        }
      }
    }
    // head_rms_norm's sum: per lane over i = lane, lane + 32, ... in order, then the xor tree.
    double ss = 0.0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (lane + 32 * j < hd) {
        const double x = x_first[j];
        ss += x * x;
      }
    }
    for (int64_t c = kChunk; c < hd; c += kChunk) {
      float xv[kPerLane];
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) xv[j] = c + lane + 32 * j < hd ? add_bias(xh, bh, c + lane + 32 * j) : 0.0f;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        if (c + lane + 32 * j < hd) {
          const double x = xv[j];
          ss += x * x;
        }
      }
    }
    for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float mean = __double2float_rn(__ddiv_rn(ss, static_cast<double>(hd)));
    inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, p.eps)));
  }
  __syncthreads();
  if (!active) return;
  // Each chunk's loads first, then its stores (the compiler cannot know that oh aliases nothing
  // read here, and would otherwise wait for each load after the previous store).
  auto store_head = [&](auto* oh) {
    store_rope_chunk(first_chunk, oh, table, inv, rope_nan, 0, lane, half, p.n_rot, hd);
    for (int64_t c = kChunk; c < hd; c += kChunk) {
      RopeChunk r;
      load_rope_chunk(r, xh, bh, w, c, lane, half, p.n_rot, hd);
      store_rope_chunk(r, oh, table, inv, rope_nan, c, lane, half, p.n_rot, hd);
    }
  };
  if (is_q) store_head(oq);
  else store_head(ok);
}

// The plain form (no q / k norm, gpt-oss): one warp per head as above; x = raw + bias (one rounded
// add, as the reference adds the projection's bias), rotated by the table, stored. The table is
// rope.cu's double expression, or YaRN's (reference::rope_neox_yarn: every double operation
// explicitly rounded, so no contraction into fma changes it).
struct PlainExtras {
  const float* q_bias;
  const float* k_bias;
  const float* v_bias;
  RopeYarn yarn;
};

template <class KV>
__global__ void __launch_bounds__(32 * kWarpsPerCta) qk_rope_store_plain_kernel(const Params<KV> p, const PlainExtras e) {
  extern __shared__ float table[];
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t half = p.n_rot / 2;
  const int64_t t = blockIdx.y;
  const int64_t pos0 = *p.pos0_dev;
  const bool rope_nan = pos0 < 0;
  const bool store = !rope_nan && pos0 + p.rows <= p.max_pos;
  const int64_t head = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t hd = p.hd, kv_dim = p.n_head_kv * hd;
  for (int64_t k = threadIdx.x; k < 2 * half && !rope_nan; k += blockDim.x) {
    const int64_t i = k < half ? k : k - half;
    const double freq = pow(p.freq_base, -2.0 * static_cast<double>(i) / static_cast<double>(p.n_rot));
    double theta = static_cast<double>(pos0 + t) * freq;
    if (e.yarn.on) {
      const double y = __ddiv_rn(__dsub_rn(static_cast<double>(i), e.yarn.low), fmax(0.001, __dsub_rn(e.yarn.high, e.yarn.low)));
      const double ramp = __dsub_rn(1.0, fmin(1.0, fmax(0.0, y)));   // 1: keep the unscaled frequency
      theta = __dadd_rn(__dmul_rn(__ddiv_rn(theta, e.yarn.factor), __dsub_rn(1.0, ramp)), __dmul_rn(theta, ramp));
      table[k] = static_cast<float>(__dmul_rn(k < half ? cos(theta) : sin(theta), e.yarn.mscale));
    } else {
      table[k] = static_cast<float>(k < half ? cos(theta) : sin(theta));
    }
  }
  __syncthreads();
  const bool is_q = head < p.n_head;
  const int64_t kh = head - p.n_head;
  if (head >= p.n_head + p.n_head_kv || (!is_q && !store)) return;
  const float* xh = is_q ? p.q + t * p.q_row_stride + head * p.q_head_stride : p.k + t * p.k_row_stride + kh * hd;
  const float* b = is_q ? (e.q_bias != nullptr ? e.q_bias + head * hd : nullptr)
                        : (e.k_bias != nullptr ? e.k_bias + kh * hd : nullptr);
  auto rotate_into = [&](auto* oh) {
    for (int64_t i = lane; i < half; i += 32) {
      if (rope_nan) {
        put(oh + i, __int_as_float(0x7fc00000));
        put(oh + i + half, __int_as_float(0x7fc00000));
        continue;
      }
      const float x0 = add_bias(xh, b, i), x1 = add_bias(xh, b, i + half);
      const float cs = table[i], sn = table[half + i];
      put(oh + i, __fsub_rn(__fmul_rn(x0, cs), __fmul_rn(x1, sn)));
      put(oh + i + half, __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, cs)));
    }
    for (int64_t i = p.n_rot + lane; i < hd; i += 32) put(oh + i, add_bias(xh, b, i));
  };
  if (is_q) {
    rotate_into(p.q_out + (t * p.n_head + head) * hd);
    return;
  }
  rotate_into(p.k_cache + (pos0 + t) * kv_dim + kh * hd);
  const float* vh = p.v + t * p.v_row_stride + kh * hd;
  const float* vb = e.v_bias != nullptr ? e.v_bias + kh * hd : nullptr;
  KV* vo = p.v_cache + (pos0 + t) * kv_dim + kh * hd;
  for (int64_t i = lane; i < hd; i += 32) put(vo + i, add_bias(vh, vb, i));
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
  const bool f32_cache = a.k_cache != nullptr && a.v_cache != nullptr;
  const bool f16_cache = a.k_cache_f16 != nullptr && a.v_cache_f16 != nullptr;
  const bool plain = a.q_norm == nullptr && a.k_norm == nullptr;
  if (!plain && a.yarn.on)
    throw std::invalid_argument("qk_norm_rope_store: YaRN only without q_norm and k_norm (" + shape + ")");
  if (a.yarn.on && !(a.yarn.factor > 0.0))
    throw std::invalid_argument("qk_norm_rope_store: YaRN factor must be positive (" + shape + ")");
  if (a.q == nullptr || a.k == nullptr || a.v == nullptr || (!plain && (a.q_norm == nullptr || a.k_norm == nullptr)) ||
      a.pos0_dev == nullptr || a.q_out == nullptr || f32_cache == f16_cache)
    throw std::invalid_argument("qk_norm_rope_store: a null pointer among q, k, v, q_norm, k_norm, pos0_dev, q_out, "
                                "or not exactly one of (k_cache, v_cache) and (k_cache_f16, v_cache_f16) set (" +
                                shape + ")");
  const int64_t heads = a.n_head + a.n_head_kv;
  const dim3 grid(static_cast<unsigned>((heads + kWarpsPerCta - 1) / kWarpsPerCta), static_cast<unsigned>(a.rows));
  const size_t smem = static_cast<size_t>(a.n_rot) * sizeof(float);  // n_rot/2 cos + n_rot/2 sin
  auto go = [&](auto* k_cache, auto* v_cache) {
    using KV = std::remove_pointer_t<decltype(k_cache)>;
    const Params<KV> p{a.q,      a.q_row_stride, a.q_head_stride, a.k,         a.k_row_stride, a.v,      a.v_row_stride,
                       a.q_norm, a.k_norm,       a.n_head,        a.n_head_kv, a.head_dim,     a.n_rot,  a.pos0_dev,
                       a.freq_base, a.eps,       a.rows,          a.max_pos,   a.q_out,        k_cache,  v_cache,
                       a.q_bias,    a.k_bias,    a.v_bias};
    if (plain) {
      const PlainExtras e{a.q_bias, a.k_bias, a.v_bias, a.yarn};
      launch_kernel(qk_rope_store_plain_kernel<KV>, grid, dim3(32 * kWarpsPerCta), smem, stream, p, e);
      return;
    }
    launch_kernel(qk_norm_rope_store_kernel<KV>, grid, dim3(32 * kWarpsPerCta), smem, stream, p);
  };
  if (f32_cache) go(a.k_cache, a.v_cache);
  else go(a.k_cache_f16, a.v_cache_f16);
}

}  // namespace moraine::cuda
