// Grid (ceil(n_expert / 8), n): one warp per expert row as matvec_float.cu (its row code,
// matvec_float_row.cuh), then the "last CTA done" pattern: each CTA publishes its logits
// (__threadfence, then one atomicAdd on the token's counter); the CTA that arrives last reads the
// token's logits back from L2 (__ldcg: its L1 may hold stale lines of a neighbouring token's
// row) into shared memory and one warp routes them with router.cu's code (route_warp.cuh).
#include "kernels/cuda/router_fused.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/rms_norm_block.cuh"
#include "kernels/cuda/matvec_float_row.cuh"
#include "kernels/cuda/route_warp.cuh"

namespace moraine::cuda {
namespace {

using namespace matvec_float_detail;

constexpr int kRowsPerCta = 8;  // matvec_float.cu's CTA shape (not part of the row's arithmetic)

template <TensorType T>
__global__ void __launch_bounds__(32 * kRowsPerCta)
    router_fused_kernel(const uint8_t* __restrict__ w, int64_t ne, int64_t d, const float* __restrict__ x,
                        float* logits, int64_t k, bool renorm, int32_t* __restrict__ chosen,
                        float* __restrict__ weight, uint32_t* __restrict__ arrivals) {
  extern __shared__ float smem[];
  float* xs = smem;           // [d] activations rounded to the weight's type
  float* lg = smem + d;       // [ne] the token's logits (last CTA)
  float* prob = lg + ne;      // [ne] its probabilities
  __shared__ bool last;
  const int64_t t = blockIdx.y;
  const float* xt = x + t * d;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) xs[i] = round_activation<T>(xt[i]);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + warp;
  if (row < ne) {
    constexpr int64_t kElemBytes = T == TensorType::F32 ? 4 : 2;
    const float acc = row_dot_warp<T>(w + row * d * kElemBytes, xs, d, lane);
    if (lane == 0) logits[t * ne + row] = acc;
  }
  __threadfence();  // this CTA's logits visible device-wide before its arrival is counted
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(arrivals + t, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int64_t e = threadIdx.x; e < ne; e += blockDim.x) lg[e] = __ldcg(logits + t * ne + e);
  __syncthreads();
  if (warp == 0) route_detail::route_token_warp(lg, prob, ne, k, renorm, chosen + t * k, weight + t * k, lane);
  if (threadIdx.x == 0) arrivals[t] = 0;  // every CTA of this token has arrived: ready for the next call
}

// ---- rms_norm_router_fused: the FFN input norm in front (router_fused.h) ----
//
// Grid (ceil(n_expert / kNormRows), n), 256 threads (rms_norm.cu's CTA: the width fixes its
// reduction tree). Before waiting on the previous kernel (PDL, launch.h) a CTA puts its
// kNormRows router rows in flight into shared memory (cp.async) and loads its norm weights:
// neither is written by any kernel of a step, so these loads overlap the kernel before (the o
// projection) instead of following it. Then every CTA normalises the token's row itself, with
// rms_norm_kernel's expressions (thread tid sums elements tid, tid + 256, ... in double, the warp
// xor tree, the 8 warp partials in order; h = x * inv * w rounded as there), rounds h to the
// weight's type into shared memory as matvec_float's staged kernel does, and warp r dots row r
// with row_dot_warp (same bits as matvec_float_batched). CTA 0 of the token writes h (the experts
// read it); the last CTA to arrive routes with router.cu's warp code.
constexpr int kNormThreads = 256;   // rms_norm.cu's kThreads

__device__ __forceinline__ void fence_acq_rel_gpu() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
#else
  __threadfence();
#endif
}
constexpr int kNormWarps = kNormThreads / 32;
constexpr int kNormRows = 2;        // router rows per CTA: 128 experts over 64 SMs

template <TensorType T, int kCached>
__global__ void __launch_bounds__(kNormThreads)
    rms_norm_router_kernel(const uint8_t* __restrict__ w, int64_t ne, int64_t d, const float* __restrict__ x,
                           const float* __restrict__ norm_w, float eps, float* __restrict__ h_out, float* logits,
                           int64_t k, bool renorm, int32_t* __restrict__ chosen, float* __restrict__ weight,
                           uint32_t* __restrict__ arrivals) {
  extern __shared__ uint4 norm_router_smem[];
  constexpr int64_t kElemBytes = T == TensorType::F32 ? 4 : 2;
  float* xs = reinterpret_cast<float*>(norm_router_smem);   // [d] h rounded to the weight's type
  uint4* rows_s = norm_router_smem + d / 4;                   // [kNormRows][d * kElemBytes / 16]
  __shared__ double partial[kNormWarps];
  __shared__ bool last;
  const int64_t t = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row_words = d * kElemBytes / 16;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kNormRows;
  const int64_t my_rows = ne - row0 < kNormRows ? ne - row0 : kNormRows;
  {
    const uint4* src = reinterpret_cast<const uint4*>(w + row0 * d * kElemBytes);
    for (int64_t i = threadIdx.x; i < my_rows * row_words; i += kNormThreads) async_copy::copy_16(rows_s + i, src + i);
  }
  float wc[kCached];
#pragma unroll
  for (int j = 0; j < kCached; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kNormThreads;
    wc[j] = i < d ? (norm_w != nullptr ? norm_w[i] : 1.0f) : 0.0f;
  }
  wait_for_prior_grids();
  allow_dependent_grids();
  const float* xr = x + t * d;
  float xc[kCached];
  double ss = 0.0;
#pragma unroll
  for (int j = 0; j < kCached; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kNormThreads;
    xc[j] = i < d ? xr[i] : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < kCached; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kNormThreads;
    if (i < d) {
      const double v = xc[j];
      ss += v * v;
    }
  }
  const float inv = rms_inverse<kNormWarps>(ss, partial, d, eps);
#pragma unroll
  for (int j = 0; j < kCached; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kNormThreads;
    if (i < d) {
      const float v = __fmul_rn(xc[j], inv);
      const float hv = norm_w != nullptr ? __fmul_rn(v, wc[j]) : v;
      xs[i] = round_activation<T>(hv);
      if (blockIdx.x == 0) h_out[t * d + i] = hv;
    }
  }
  async_copy::wait_all();
  __syncthreads();   // xs and every thread's row copies
  if (warp < my_rows) {
    const float acc = row_dot_warp<T>(reinterpret_cast<const uint8_t*>(rows_s + warp * row_words), xs, d, lane);
    if (lane == 0) logits[t * ne + row0 + warp] = acc;
  }
  // Release: this CTA's logits before its arrival is counted; the last CTA acquires after the
  // count. fence.acq_rel rather than __threadfence's sequentially consistent fence, which is
  // the costlier one and not needed for this message-passing pattern (PTX memory model).
  fence_acq_rel_gpu();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(arrivals + t, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  fence_acq_rel_gpu();
  float* lg = xs;   // the staging is done with: the token's logits, then (ne > 128) its probabilities
  for (int64_t e = threadIdx.x; e < ne; e += kNormThreads) lg[e] = __ldcg(logits + t * ne + e);
  __syncthreads();
  if (warp == 0) {
    // router.cu's choice of warp code by n_expert (both give the same bits).
    if (ne <= 128) {
      route_detail::route_token_warp_regs<4>(lg, static_cast<int>(ne), static_cast<int>(k), renorm, chosen + t * k,
                                             weight + t * k, lane);
    } else {
      route_detail::route_token_warp(lg, lg + ne, ne, k, renorm, chosen + t * k, weight + t * k, lane);
    }
  }
  if (threadIdx.x == 0) arrivals[t] = 0;  // every CTA of this token has arrived: ready for the next call
}

// Dynamic shared memory without the opt-in: 48 KiB less the kernel's static arrays (an F32
// router of width 4096 needs exactly 48 KiB, which the launch refused on the H200).
constexpr size_t kNormMaxDynamicSmem = 47 * 1024;

// h staged as floats, then the CTA's rows; the last CTA's logits and probabilities reuse both.
size_t norm_router_smem_bytes(TensorType w_type, int64_t n_expert, int64_t d) {
  const size_t elem = w_type == TensorType::F32 ? 4 : 2;
  const size_t staging = static_cast<size_t>(d) * sizeof(float) + static_cast<size_t>(kNormRows * d) * elem;
  return std::max(staging, static_cast<size_t>(2 * n_expert) * sizeof(float));
}

template <TensorType T>
void launch_norm_router(int64_t per_thread, dim3 grid, size_t smem, cudaStream_t stream, const uint8_t* w, int64_t ne,
                        int64_t d, const float* x, const float* norm_w, float eps, float* h_out, float* logits,
                        int64_t k, bool renorm, int32_t* chosen, float* weight, uint32_t* arrivals) {
  const dim3 block(kNormThreads);
  if (per_thread <= 4)
    launch_kernel(rms_norm_router_kernel<T, 4>, grid, block, smem, stream, w, ne, d, x, norm_w, eps, h_out, logits, k,
                  renorm, chosen, weight, arrivals);
  else if (per_thread <= 8)
    launch_kernel(rms_norm_router_kernel<T, 8>, grid, block, smem, stream, w, ne, d, x, norm_w, eps, h_out, logits, k,
                  renorm, chosen, weight, arrivals);
  else
    launch_kernel(rms_norm_router_kernel<T, 16>, grid, block, smem, stream, w, ne, d, x, norm_w, eps, h_out, logits, k,
                  renorm, chosen, weight, arrivals);
}

}  // namespace

bool rms_norm_router_fused_supported(TensorType w_type, int64_t n_expert, int64_t d) {
  return (w_type == TensorType::F32 || w_type == TensorType::F16 || w_type == TensorType::BF16) && d > 0 &&
         d <= 16 * kNormThreads && (d * (w_type == TensorType::F32 ? 4 : 2)) % 16 == 0 && n_expert > 0 &&
         n_expert <= 4096 && norm_router_smem_bytes(w_type, n_expert, d) <= kNormMaxDynamicSmem;
}

void rms_norm_router_fused(TensorType w_type, const void* w, int64_t n_expert, int64_t d, const float* x,
                           const float* norm_w, float eps, int64_t n, float* h_out, int64_t k, bool renormalize,
                           float* logits, int32_t* chosen, float* weight, uint32_t* arrivals, cudaStream_t stream) {
  const std::string where = " (weight " + std::string(type_name(w_type)) + ", n_expert=" + std::to_string(n_expert) +
                            ", d=" + std::to_string(d) + ", n=" + std::to_string(n) + ", k=" + std::to_string(k) + ")";
  if (!rms_norm_router_fused_supported(w_type, n_expert, d))
    throw std::invalid_argument("rms_norm_router_fused: unsupported shape (weight f32/f16/bf16, d up to 4096 with "
                                "16-byte rows, n_expert 1..4096, 2 rows and d floats within 48 KiB)" + where);
  if (n <= 0 || n > 65535 || k < 1 || k > n_expert || k > 64)
    throw std::invalid_argument("rms_norm_router_fused: need n in 1..65535, k in 1..min(n_expert, 64)" + where);
  if (w == nullptr || x == nullptr || h_out == nullptr || logits == nullptr || chosen == nullptr ||
      weight == nullptr || arrivals == nullptr)
    throw std::invalid_argument("rms_norm_router_fused: a null pointer among w, x, h_out, logits, chosen, weight, "
                                "arrivals" + where);
  if (reinterpret_cast<uintptr_t>(w) % 16 != 0)
    throw std::invalid_argument("rms_norm_router_fused: w is not 16-byte aligned" + where);
  const dim3 grid(static_cast<unsigned>((n_expert + kNormRows - 1) / kNormRows), static_cast<unsigned>(n));
  const size_t smem = norm_router_smem_bytes(w_type, n_expert, d);
  const int64_t per_thread = (d + kNormThreads - 1) / kNormThreads;
  const auto* wb = static_cast<const uint8_t*>(w);
  switch (w_type) {
    case TensorType::F32:
      launch_norm_router<TensorType::F32>(per_thread, grid, smem, stream, wb, n_expert, d, x, norm_w, eps, h_out,
                                          logits, k, renormalize, chosen, weight, arrivals);
      break;
    case TensorType::F16:
      launch_norm_router<TensorType::F16>(per_thread, grid, smem, stream, wb, n_expert, d, x, norm_w, eps, h_out,
                                          logits, k, renormalize, chosen, weight, arrivals);
      break;
    default:
      launch_norm_router<TensorType::BF16>(per_thread, grid, smem, stream, wb, n_expert, d, x, norm_w, eps, h_out,
                                           logits, k, renormalize, chosen, weight, arrivals);
      break;
  }
}

void router_fused(TensorType w_type, const void* w, int64_t n_expert, int64_t d, const float* x, int64_t n, int64_t k,
                  bool renormalize, float* logits, int32_t* chosen, float* weight, uint32_t* arrivals,
                  cudaStream_t stream) {
  const std::string where = " (weight " + std::string(type_name(w_type)) + ", n_expert=" + std::to_string(n_expert) +
                            ", d=" + std::to_string(d) + ", n=" + std::to_string(n) + ", k=" + std::to_string(k) + ")";
  if (w_type != TensorType::F32 && w_type != TensorType::F16 && w_type != TensorType::BF16)
    throw std::invalid_argument("router_fused: weight type is not f32, f16 or bf16" + where);
  if (n <= 0 || n > 65535 || n_expert <= 0 || n_expert > 4096 || k < 1 || k > n_expert || k > 64 || d <= 0)
    throw std::invalid_argument("router_fused: need n in 1..65535, n_expert in 1..4096, k in 1..min(n_expert, 64), "
                                "d > 0" + where);
  const size_t smem = static_cast<size_t>(d + 2 * n_expert) * sizeof(float);
  if (smem > 48 * 1024)
    throw std::invalid_argument("router_fused: d + 2 n_expert floats exceed 48 KiB of shared memory" + where);
  if (w == nullptr || x == nullptr || logits == nullptr || chosen == nullptr || weight == nullptr || arrivals == nullptr)
    throw std::invalid_argument("router_fused: a null pointer among w, x, logits, chosen, weight, arrivals" + where);
  const dim3 grid(static_cast<unsigned>((n_expert + kRowsPerCta - 1) / kRowsPerCta), static_cast<unsigned>(n));
  const auto* wb = static_cast<const uint8_t*>(w);
  switch (w_type) {
    case TensorType::F32:
      router_fused_kernel<TensorType::F32><<<grid, 32 * kRowsPerCta, smem, stream>>>(
          wb, n_expert, d, x, logits, k, renormalize, chosen, weight, arrivals);
      break;
    case TensorType::F16:
      router_fused_kernel<TensorType::F16><<<grid, 32 * kRowsPerCta, smem, stream>>>(
          wb, n_expert, d, x, logits, k, renormalize, chosen, weight, arrivals);
      break;
    default:
      router_fused_kernel<TensorType::BF16><<<grid, 32 * kRowsPerCta, smem, stream>>>(
          wb, n_expert, d, x, logits, k, renormalize, chosen, weight, arrivals);
      break;
  }
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moraine::cuda
