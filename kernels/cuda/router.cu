#include "kernels/cuda/router.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/route_warp.cuh"

namespace moraine::cuda {
namespace {

constexpr int kWarpsPerCta = 4;

// One warp per token; its probabilities in shared memory ([kWarpsPerCta][n_expert]); the
// per-token work is route_warp.cuh's (shared with the fused router, router_fused.cu).
__global__ void route_kernel(const float* __restrict__ logits, int64_t n, int64_t ne, int64_t k, bool renorm,
                             int32_t* __restrict__ chosen, float* __restrict__ weight) {
  extern __shared__ float prob_all[];
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + warp;
  if (t >= n) return;
  if (ne <= 128) {  // every Qwen3 MoE (128 experts) and smaller: probabilities in registers
    route_detail::route_token_warp_regs<4>(logits + t * ne, static_cast<int>(ne), static_cast<int>(k), renorm,
                                           chosen + t * k, weight + t * k, lane);
    return;
  }
  route_detail::route_token_warp(logits + t * ne, prob_all + warp * ne, ne, k, renorm, chosen + t * k, weight + t * k,
                                 lane);
}

// One warp per token: l = logit + bias in shared memory, k rounds of a warp arg-max (greater l,
// then lower id; the winner struck with -inf), then the softmax over the k winners in slot order.
__global__ void route_topk_softmax_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int64_t n,
                                          int64_t ne, int64_t k, int32_t* __restrict__ chosen,
                                          float* __restrict__ weight) {
  extern __shared__ float l_all[];
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + warp;
  if (t >= n) return;
  float* l = l_all + warp * ne;
  for (int64_t e = lane; e < ne; e += 32) l[e] = bias != nullptr ? __fadd_rn(logits[t * ne + e], bias[e]) : logits[t * ne + e];
  __syncwarp();
  float top = 0.0f, sum = 0.0f;
  for (int64_t s = 0; s < k; ++s) {
    float best = -INFINITY;
    int best_e = 0x7fffffff;
    for (int64_t e = lane; e < ne; e += 32) {
      const float v = l[e];
      if (v > best || best_e == 0x7fffffff) best = v, best_e = static_cast<int>(e);  // e ascends: ties keep the lower
    }
    for (int off = 16; off > 0; off /= 2) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, off);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, off);
      if (ob > best || (ob == best && oe < best_e)) best = ob, best_e = oe;
    }
    __syncwarp();
    if (s == 0) top = best;
    const float w = expf(__fsub_rn(best, top));
    sum = __fadd_rn(sum, w);   // every lane has the same winner: the sum in slot order, as the reference
    if (lane == 0) {
      l[best_e] = -INFINITY;
      chosen[t * k + s] = best_e;
      weight[t * k + s] = w;
    }
    __syncwarp();
  }
  for (int64_t s = lane; s < k; s += 32) weight[t * k + s] = __fdiv_rn(weight[t * k + s], sum);
}

void check_router(const char* what, int64_t n, int64_t n_expert, int64_t k) {
  if (n <= 0 || n_expert <= 0 || n_expert > 4096 || k < 1 || k > n_expert || k > 64)
    throw std::invalid_argument(std::string(what) + ": n=" + std::to_string(n) + ", n_expert=" +
                                std::to_string(n_expert) + ", k=" + std::to_string(k) +
                                " (need n > 0, n_expert in 1..4096, k in 1..min(n_expert, 64))");
}

}  // namespace

void route_top_k_softmax(const float* logits, const float* bias, int64_t n, int64_t n_expert, int64_t k,
                         int32_t* chosen, float* weight, cudaStream_t stream) {
  check_router("route_top_k_softmax", n, n_expert, k);
  const size_t smem = static_cast<size_t>(kWarpsPerCta * n_expert) * sizeof(float);
  if (smem > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(route_topk_softmax_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
  launch_kernel(route_topk_softmax_kernel, dim3(static_cast<unsigned>((n + kWarpsPerCta - 1) / kWarpsPerCta)),
                dim3(32 * kWarpsPerCta), smem, stream, logits, bias, n, n_expert, k, chosen, weight);
}

void route_softmax_top_k(const float* logits, int64_t n, int64_t n_expert, int64_t k, bool renormalize,
                         int32_t* chosen, float* weight, cudaStream_t stream) {
  check_router("route_softmax_top_k", n, n_expert, k);
  const size_t smem = static_cast<size_t>(kWarpsPerCta * n_expert) * sizeof(float);
  // Above 3072 experts the table passes the 48 KB a launch gets without opting in (64 KB at 4096).
  if (smem > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  launch_kernel(route_kernel, dim3(static_cast<unsigned>((n + kWarpsPerCta - 1) / kWarpsPerCta)), dim3(32 * kWarpsPerCta),
                smem, stream, logits, n, n_expert, k, renormalize, chosen, weight);
}

}  // namespace moraine::cuda
