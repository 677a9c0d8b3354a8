#include "kernels/cuda/router.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"

namespace moraine::cuda {
namespace {

constexpr int kWarpsPerCta = 4;

// One warp per token; its probabilities in shared memory ([kWarpsPerCta][n_expert]). Top-k by k
// rounds of a warp arg-max (greater probability, then lower id), the winner struck out with -1
// (probabilities are >= 0).
__global__ void route_kernel(const float* __restrict__ logits, int64_t n, int64_t ne, int64_t k, bool renorm,
                             int32_t* __restrict__ chosen, float* __restrict__ weight) {
  extern __shared__ float prob_all[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + warp;
  if (t >= n) return;
  float* prob = prob_all + warp * ne;
  const float* lt = logits + t * ne;
  float mx = -INFINITY;
  for (int64_t e = lane; e < ne; e += 32) mx = fmaxf(mx, lt[e]);
  for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  float sum = 0.0f;
  for (int64_t e = lane; e < ne; e += 32) {
    const float p = expf(lt[e] - mx);
    prob[e] = p;
    sum += p;
  }
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  for (int64_t e = lane; e < ne; e += 32) prob[e] = prob[e] / sum;
  __syncwarp();
  float wsum = 0.0f;
  for (int64_t s = 0; s < k; ++s) {
    float best = -2.0f;
    int best_e = 0x7fffffff;
    for (int64_t e = lane; e < ne; e += 32) {
      const float p = prob[e];
      if (p > best) best = p, best_e = static_cast<int>(e);  // e ascends per lane: ties keep the lower
    }
    for (int off = 16; off > 0; off /= 2) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, off);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, off);
      if (ob > best || (ob == best && oe < best_e)) best = ob, best_e = oe;
    }
    __syncwarp();
    if (lane == 0) {
      prob[best_e] = -1.0f;
      chosen[t * k + s] = best_e;
      weight[t * k + s] = best;  // rescaled below
    }
    wsum += best;  // every lane has the same best: the sum in slot order, as the reference
    __syncwarp();
  }
  if (renorm) {
    for (int64_t s = lane; s < k; s += 32) weight[t * k + s] = weight[t * k + s] / wsum;
  }
}

}  // namespace

void route_softmax_top_k(const float* logits, int64_t n, int64_t n_expert, int64_t k, bool renormalize,
                         int32_t* chosen, float* weight, cudaStream_t stream) {
  if (n <= 0 || n_expert <= 0 || n_expert > 4096 || k < 1 || k > n_expert || k > 64)
    throw std::invalid_argument("route_softmax_top_k: n=" + std::to_string(n) + ", n_expert=" +
                                std::to_string(n_expert) + ", k=" + std::to_string(k) +
                                " (need n > 0, n_expert in 1..4096, k in 1..min(n_expert, 64))");
  const size_t smem = static_cast<size_t>(kWarpsPerCta * n_expert) * sizeof(float);
  route_kernel<<<static_cast<unsigned>((n + kWarpsPerCta - 1) / kWarpsPerCta), 32 * kWarpsPerCta, smem, stream>>>(
      logits, n, n_expert, k, renormalize, chosen, weight);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moraine::cuda
