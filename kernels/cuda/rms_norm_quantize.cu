// One CTA per row, as rms_norm.cu: the sum of squares runs over the very same 256-thread
// strided loop (thread tid takes elements tid, tid + 256, ... in that order), warp tree and
// in-order sum of the 8 warp partials (so the same double), then h and its activation blocks.
//
// Q8_0 blocks are 32 elements, so block warp + 8j of a row is exactly the 32 elements thread
// (warp, lane) read as its j-th element in the sum: up to 16 per thread stay in registers and
// each warp quantizes its blocks in one unrolled pass. Measured on the H200 (run A) the first
// version, which re-read x and quantized one block after another, took 4.5 us per 2048-wide row
// in a graph against 3.2 us for the unfused pair: the serial chain per warp was the cost. Q8_K
// blocks (256 elements, 8 consecutive per lane) do not line up with the sum's elements, so they
// re-read x (written by this CTA before the barrier, or never written) from global memory.
//
// Launched with PDL (launch.h) like the pair it replaces: the first version went out as a plain
// launch, so in a graph of PDL kernels it also paid the full launch edge the pair overlapped.
//
// The MoE-combine variant first computes each element of x as moe_combine_kernel does (same
// rounded operations in the same order), writes it back, and uses it as the norm's input.
#include "kernels/cuda/rms_norm_quantize.h"

#include <stdexcept>
#include <string>

#include "common/formats/block_layouts.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/rms_norm_block.cuh"
#include "kernels/cuda/quantize_block.cuh"

namespace moraine::cuda {
namespace {

constexpr int kThreads = 256;  // must stay rms_norm.cu's: it fixes the reduction tree
constexpr int kWarps = kThreads / 32;

enum class Act { None, Q8_0, Q8_K };

// The MoE combine before the norm (moe_combine.h); `on` false: x is read as it is.
struct Combine {
  bool on = false;
  const float* slots = nullptr;
  const float* host_rows = nullptr;
  const int32_t* host_row_of = nullptr;
  const float* weight = nullptr;
  const float* shared = nullptr;
  const float* gate_logit = nullptr;
  int64_t k = 0;
};

// x[t][i] + the combined expert rows: moe_combine_kernel's expression, operation for operation.
__device__ __forceinline__ float combined(const Combine& c, float x, int64_t t, int64_t i, int64_t d) {
  float acc = 0.0f;
  for (int64_t s = 0; s < c.k; ++s) {
    const int64_t slot = t * c.k + s;
    const int32_t alt = c.host_row_of != nullptr ? c.host_row_of[slot] : -1;
    const float y = alt >= 0 ? c.host_rows[alt * d + i] : c.slots[slot * d + i];
    acc = __fadd_rn(acc, __fmul_rn(c.weight[slot], y));
  }
  if (c.shared != nullptr) {
    const float g = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-c.gate_logit[t])));
    acc = __fadd_rn(acc, __fmul_rn(g, c.shared[t * d + i]));
  }
  return __fadd_rn(x, acc);
}

// h = x * inv (* w), exactly rms_norm_kernel's expression.
__device__ __forceinline__ float normed(float x, float inv, const float* __restrict__ w, int64_t i) {
  const float v = __fmul_rn(x, inv);
  return w != nullptr ? __fmul_rn(v, w[i]) : v;
}

// kCached > 0: each thread keeps its (at most kCached) elements of the sum in registers (n <=
// kCached * 256); 0: any n, re-read from x. x may alias h: a thread writes h only at elements it
// owns, after the CTA-wide barrier; the Q8_K pass reads x at elements only its own lane writes.
template <int kCached, Act kAct>
__global__ void __launch_bounds__(kThreads)
    norm_quantize_kernel(float* x, const Combine c, const float* __restrict__ w, float* h, void* __restrict__ act,
                         int64_t n, float eps) {
  __shared__ double partial[kWarps];
  const int64_t t = blockIdx.x;
  float* xr = x + t * n;
  float* hr = h + t * n;
  float cached[kCached > 0 ? kCached : 1];
  // The norm weights (no kernel of a step writes them) load before the wait on the previous
  // kernel (PDL, launch.h), overlapping its tail; everything else after it.
  float wc[kCached > 0 ? kCached : 1];
  if constexpr (kCached > 0) {
#pragma unroll
    for (int j = 0; j < kCached; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kThreads;
      wc[j] = i < n && w != nullptr ? w[i] : 1.0f;
    }
  }
  wait_for_prior_grids();
  allow_dependent_grids();
  double ss = 0.0;
  if constexpr (kCached > 0) {
#pragma unroll
    for (int j = 0; j < kCached; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kThreads;
      if (i < n) {
        float v = xr[i];
        if (c.on) xr[i] = v = combined(c, v, t, i, n);
        cached[j] = v;
        const double dv = v;
        ss += dv * dv;
      }
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      float v = xr[i];
      if (c.on) xr[i] = v = combined(c, v, t, i, n);
      const double dv = v;
      ss += dv * dv;
    }
  }
  const float inv = rms_inverse<kWarps>(ss, partial, n, eps);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if constexpr (kAct == Act::Q8_K) {
    const int64_t nb = n / kQK_K;
    BlockQ8_K* out = static_cast<BlockQ8_K*>(act) + t * nb;
#pragma unroll 2
    for (int64_t b = warp; b < nb; b += kWarps) {  // b uniform per warp: the shuffles see whole warps
      const int64_t i0 = b * kQK_K + 8 * lane;
      float v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        v[j] = normed(xr[i0 + j], inv, w, i0 + j);
        hr[i0 + j] = v[j];
      }
      quantize_detail::quantize_q8_k_warp(v, out[b], lane);
    }
  } else if constexpr (kCached > 0) {
    [[maybe_unused]] BlockQ8_0* out = kAct == Act::Q8_0 ? static_cast<BlockQ8_0*>(act) + t * (n / kQK) : nullptr;
#pragma unroll
    for (int j = 0; j < kCached; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kThreads;
      // With Q8_0 n is a multiple of 32, so i < n is uniform per warp (block warp + 8j).
      if (i < n) {
        const float v = w != nullptr ? __fmul_rn(__fmul_rn(cached[j], inv), wc[j]) : __fmul_rn(cached[j], inv);
        hr[i] = v;
        if constexpr (kAct == Act::Q8_0) quantize_detail::quantize_q8_0_llama_warp(v, out[warp + kWarps * j], lane);
      }
    }
  } else {
    [[maybe_unused]] BlockQ8_0* out = kAct == Act::Q8_0 ? static_cast<BlockQ8_0*>(act) + t * (n / kQK) : nullptr;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      const float v = normed(xr[i], inv, w, i);
      hr[i] = v;
      if constexpr (kAct == Act::Q8_0) quantize_detail::quantize_q8_0_llama_warp(v, out[i / kQK], lane);
    }
  }
}

// Q8_0 without the combine, n a multiple of 256 (up to 16 * 256), h not overlapping x: grid
// (n / 256, rows). Every CTA sums the whole row with the same tree (the same double, the same
// inv) and outputs one 256-element slice: thread tid element s * 256 + tid, which is its
// register j = s of the sum, and warp w block 8 s + w. The single-CTA kernel above left one CTA
// to normalise, store and quantize all of a 2048-wide row (8 blocks per warp, one after
// another): on the H200 it was ~0.5 us per layer slower than rms_norm then
// quantize_activations_llama in the decode chain (moraine-kernel-bench cuda --mixer-only, run
// B); sliced, 2.0 us per layer faster than the pair (run C: the step 3.3 -> 0.9-1.5 us).
template <int kCached>
__global__ void __launch_bounds__(kThreads)
    norm_quantize_sliced_kernel(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ h,
                                BlockQ8_0* __restrict__ act, int64_t n, float eps) {
  __shared__ double partial[kWarps];
  const int64_t t = blockIdx.y;
  const int s = blockIdx.x;
  const int64_t mine = static_cast<int64_t>(s) * kThreads + threadIdx.x;
  const float wv = w != nullptr ? w[mine] : 1.0f;   // a weight: before the wait (PDL, launch.h)
  wait_for_prior_grids();
  allow_dependent_grids();
  const float* xr = x + t * n;
  float cached[kCached];
#pragma unroll
  for (int j = 0; j < kCached; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kThreads;
    cached[j] = i < n ? xr[i] : 0.0f;
  }
  double ss = 0.0;
#pragma unroll
  for (int j = 0; j < kCached; ++j) {
    if (threadIdx.x + static_cast<int64_t>(j) * kThreads < n) {
      const double dv = cached[j];
      ss += dv * dv;
    }
  }
  const float inv = rms_inverse<kWarps>(ss, partial, n, eps);
  float xv = 0.0f;
#pragma unroll
  for (int j = 0; j < kCached; ++j)
    if (j == s) xv = cached[j];
  const float v = w != nullptr ? __fmul_rn(__fmul_rn(xv, inv), wv) : __fmul_rn(xv, inv);
  h[t * n + mine] = v;
  quantize_detail::quantize_q8_0_llama_warp(v, act[t * (n / kQK) + mine / kQK], threadIdx.x % 32);
}

template <int kCached>
void launch_sliced(const float* x, const float* w, float* h, void* act, int64_t n, int64_t rows, float eps,
                   cudaStream_t stream) {
  launch_kernel(norm_quantize_sliced_kernel<kCached>, dim3(static_cast<unsigned>(n / kThreads), static_cast<unsigned>(rows)),
                dim3(kThreads), 0, stream, x, w, h, static_cast<BlockQ8_0*>(act), n, eps);
}

template <int kCached>
void launch_cached(Act a, float* x, const Combine& c, const float* w, float* h, void* act, int64_t n, int64_t rows,
                   float eps, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(rows)), block(kThreads);
  switch (a) {
    case Act::None: launch_kernel(norm_quantize_kernel<kCached, Act::None>, grid, block, 0, stream, x, c, w, h, act, n, eps); break;
    case Act::Q8_0: launch_kernel(norm_quantize_kernel<kCached, Act::Q8_0>, grid, block, 0, stream, x, c, w, h, act, n, eps); break;
    case Act::Q8_K: launch_kernel(norm_quantize_kernel<kCached, Act::Q8_K>, grid, block, 0, stream, x, c, w, h, act, n, eps); break;
  }
}

// Q8_K re-reads x, so it needs no cache (0 keeps its registers free).
void launch(Act a, float* x, const Combine& c, const float* w, float* h, void* act, int64_t n, int64_t rows, float eps,
            cudaStream_t stream) {
  const int64_t per_thread = (n + kThreads - 1) / kThreads;
  const bool apart = x + n * rows <= h || h + n * rows <= x;
  if (a == Act::Q8_0 && !c.on && n % kThreads == 0 && per_thread <= 16 && apart && rows <= 65535) {
    if (per_thread > 8) launch_sliced<16>(x, w, h, act, n, rows, eps, stream);
    else if (per_thread > 4) launch_sliced<8>(x, w, h, act, n, rows, eps, stream);
    else launch_sliced<4>(x, w, h, act, n, rows, eps, stream);
  } else if (a == Act::Q8_K || per_thread > 16) {
    launch_cached<0>(a, x, c, w, h, act, n, rows, eps, stream);
  } else if (per_thread > 8) {
    launch_cached<16>(a, x, c, w, h, act, n, rows, eps, stream);
  } else if (per_thread > 4) {
    launch_cached<8>(a, x, c, w, h, act, n, rows, eps, stream);
  } else if (per_thread > 2) {
    launch_cached<4>(a, x, c, w, h, act, n, rows, eps, stream);
  } else {
    launch_cached<2>(a, x, c, w, h, act, n, rows, eps, stream);
  }
  CUDA_CHECK(cudaGetLastError());
}

Act check_act(const char* what, TensorType act_type, const void* act_out, int64_t n, int64_t rows) {
  const std::string shape = std::string(what) + ": n=" + std::to_string(n) + ", rows=" + std::to_string(rows);
  if (n <= 0 || rows <= 0 || rows > 0x7fffffff)
    throw std::invalid_argument(shape + " (need n > 0 and rows in 1..2^31-1)");
  if (act_out == nullptr) return Act::None;
  if (act_type != TensorType::Q8_0 && act_type != TensorType::Q8_K)
    throw std::invalid_argument(std::string(what) + ": activation type " + std::string(type_name(act_type)) +
                                " is not q8_0 or q8_K");
  const int64_t block = act_type == TensorType::Q8_0 ? kQK : kQK_K;
  if (n % block != 0)
    throw std::invalid_argument(shape + " (n must be a multiple of " + std::to_string(block) + " for " +
                                std::string(type_name(act_type)) + ")");
  return act_type == TensorType::Q8_0 ? Act::Q8_0 : Act::Q8_K;
}

}  // namespace

void rms_norm_quantize(const float* x, const float* w, float* h_out, TensorType act_type, void* act_out, int64_t n,
                       int64_t rows, float eps, cudaStream_t stream) {
  if (x == nullptr || h_out == nullptr || act_out == nullptr)
    throw std::invalid_argument("rms_norm_quantize: null x, h_out or act_out");
  const Act a = check_act("rms_norm_quantize", act_type, act_out, n, rows);
  // x is only read when the combine is off.
  launch(a, const_cast<float*>(x), Combine{}, w, h_out, act_out, n, rows, eps, stream);
}

void moe_combine_rms_norm_quantize(float* x, const float* slots, const float* host_rows, const int32_t* host_row_of,
                                   const float* weight, const float* shared, const float* gate_logit, int64_t n,
                                   int64_t k, int64_t d, const float* norm_w, float* h_out, TensorType act_type,
                                   void* act_out, float eps, cudaStream_t stream) {
  if ((host_rows == nullptr) != (host_row_of == nullptr) || (shared == nullptr) != (gate_logit == nullptr) || k <= 0 ||
      x == nullptr || slots == nullptr || weight == nullptr || h_out == nullptr)
    throw std::invalid_argument("moe_combine_rms_norm_quantize: k=" + std::to_string(k) +
                                " (need k > 0, x, slots, weight and h_out, host_rows with host_row_of, shared with "
                                "gate_logit)");
  const Act a = check_act("moe_combine_rms_norm_quantize", act_type, act_out, d, n);
  Combine c;
  c.on = true;
  c.slots = slots;
  c.host_rows = host_rows;
  c.host_row_of = host_row_of;
  c.weight = weight;
  c.shared = shared;
  c.gate_logit = gate_logit;
  c.k = k;
  launch(a, x, c, norm_w, h_out, act_out, d, n, eps, stream);
}

}  // namespace moraine::cuda
