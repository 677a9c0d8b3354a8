// Grid (ceil(n_expert / 8), n): one warp per expert row as matvec_float.cu (its row code,
// matvec_float_row.cuh), then the "last CTA done" pattern: each CTA publishes its logits
// (__threadfence, then one atomicAdd on the token's counter); the CTA that arrives last reads the
// token's logits back from L2 (__ldcg: its L1 may hold stale lines of a neighbouring token's
// row) into shared memory and one warp routes them with router.cu's code (route_warp.cuh).
#include "kernels/cuda/router_fused.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
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

}  // namespace

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
