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

// ---- the sigmoid group-limited router (route_sigmoid_group_top_k) ----

constexpr int kNone = 0x7fffffff;   // a lane without a candidate

__device__ __forceinline__ float sigmoid_rn(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }

// The largest non-NaN a[i] of i in [0, count) (ties to the lower i) over the warp; NaN marks the
// entries already taken. Every lane gets it; best_e stays kNone when every entry is NaN.
__device__ __forceinline__ void warp_arg_max(const float* a, int64_t count, int lane, float& best, int& best_e) {
  best = -INFINITY;
  best_e = kNone;
  for (int64_t i = lane; i < count; i += 32) {
    const float v = a[i];
    if (!isnan(v) && (best_e == kNone || v > best)) best = v, best_e = static_cast<int>(i);  // i ascends: ties keep the lower
  }
  for (int off = 16; off > 0; off /= 2) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, off);
    const int oe = __shfl_xor_sync(0xffffffffu, best_e, off);
    if (oe != kNone && (best_e == kNone || ob > best || (ob == best && oe < best_e))) best = ob, best_e = oe;
  }
}

// One warp per token; shared memory per warp: the biased scores [n_expert], the group scores
// [n_group]. The reference's steps in its order: scores, group scores (best + second, serially
// per group), topk_group rounds over the groups, the losers' experts masked to -inf, k rounds
// over the experts, the weight sum in slot order.
__global__ void route_sigmoid_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int64_t n,
                                     int64_t ne, int64_t k, int64_t n_group, int64_t topk_group, bool renorm,
                                     float scale, int32_t* __restrict__ chosen, float* __restrict__ weight) {
  extern __shared__ float sel_all[];
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + warp;
  if (t >= n) return;
  float* sel = sel_all + warp * (ne + n_group);
  float* gs = sel + ne;
  const float* lt = logits + t * ne;
  for (int64_t e = lane; e < ne; e += 32) {
    const float s = sigmoid_rn(lt[e]);
    sel[e] = bias != nullptr ? __fadd_rn(s, bias[e]) : s;
  }
  __syncwarp();
  float best;
  int best_e;
  if (n_group > 1) {
    const int64_t per = ne / n_group;
    for (int64_t g = lane; g < n_group; g += 32) {   // a group's score: its two best (its one when alone)
      float b1 = -INFINITY, b2 = -INFINITY;
      for (int64_t j = 0; j < per; ++j) {
        const float v = sel[g * per + j];
        if (v > b1) b2 = b1, b1 = v;
        else if (v > b2) b2 = v;
      }
      gs[g] = per > 1 ? __fadd_rn(b1, b2) : b1;
    }
    __syncwarp();
    for (int64_t r = 0; r < topk_group; ++r) {   // the kept groups struck with NaN
      warp_arg_max(gs, n_group, lane, best, best_e);
      __syncwarp();
      if (lane == 0 && best_e != kNone) gs[best_e] = NAN;
      __syncwarp();
    }
    for (int64_t e = lane; e < ne; e += 32)
      if (!isnan(gs[e / per])) sel[e] = -INFINITY;
    __syncwarp();
  }
  float wsum = 0.0f;
  for (int64_t s = 0; s < k; ++s) {
    warp_arg_max(sel, ne, lane, best, best_e);
    if (best_e == kNone) best_e = 0;   // only NaN scores left (NaN logits): a valid id, never a stray access
    const float p = sigmoid_rn(lt[best_e]);   // the unbiased score: the same bits as above
    __syncwarp();
    if (lane == 0) {
      sel[best_e] = NAN;
      chosen[t * k + s] = best_e;
      weight[t * k + s] = p;
    }
    wsum = __fadd_rn(wsum, p);   // every lane has the same winner: the sum in slot order, as the reference
    __syncwarp();
  }
  wsum = fmaxf(wsum, 6.103515625e-5f);   // llama.cpp's floor (the smallest normal half)
  for (int64_t s = lane; s < k; s += 32) {
    const float w = weight[t * k + s];
    weight[t * k + s] = __fmul_rn(renorm ? __fdiv_rn(w, wsum) : w, scale);
  }
}

__global__ void scale_weights_kernel(float* __restrict__ w, int64_t count, float scale) {
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) w[i] = __fmul_rn(w[i], scale);
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

void route_sigmoid_group_top_k(const float* logits, const float* score_bias, int64_t n, int64_t n_expert, int64_t k,
                               int64_t n_group, int64_t topk_group, bool renormalize, float routed_scale,
                               int32_t* chosen, float* weight, cudaStream_t stream) {
  check_router("route_sigmoid_group_top_k", n, n_expert, k);
  if (n_group < 1 || n_expert % n_group != 0 || topk_group < 1 || topk_group > n_group ||
      topk_group * (n_expert / n_group) < k)
    throw std::invalid_argument("route_sigmoid_group_top_k: " + std::to_string(n_expert) + " experts in " +
                                std::to_string(n_group) + " groups, " + std::to_string(topk_group) +
                                " used, cannot choose " + std::to_string(k) +
                                " (need n_group dividing n_expert, topk_group in 1..n_group holding k experts)");
  const size_t smem = static_cast<size_t>(kWarpsPerCta * (n_expert + n_group)) * sizeof(float);
  if (smem > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(route_sigmoid_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
  launch_kernel(route_sigmoid_kernel, dim3(static_cast<unsigned>((n + kWarpsPerCta - 1) / kWarpsPerCta)),
                dim3(32 * kWarpsPerCta), smem, stream, logits, score_bias, n, n_expert, k, n_group, topk_group,
                renormalize, routed_scale, chosen, weight);
}

void scale_router_weights(float* weight, int64_t count, float scale, cudaStream_t stream) {
  if (count <= 0) throw std::invalid_argument("scale_router_weights: count " + std::to_string(count) + " (need > 0)");
  constexpr int kThreads = 256;
  launch_kernel(scale_weights_kernel, dim3(static_cast<unsigned>((count + kThreads - 1) / kThreads)), dim3(kThreads), 0,
                stream, weight, count, scale);
}

}  // namespace moraine::cuda
