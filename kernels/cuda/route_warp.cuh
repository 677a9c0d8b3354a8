// The router's per-token work for one warp (softmax over the logits, top-k, renormalisation),
// shared by route_softmax_top_k (router.cu) and the fused router matvec (router_fused.cu) so
// both give the same bits: the same expf, division and reduction order in one place.
#pragma once
#include <cmath>
#include <cstdint>

namespace moraine::cuda::route_detail {

// lt: the token's n_expert logits (global or shared memory); prob: n_expert floats of shared
// memory for this warp; chosen / weight: the token's k slots. Top-k by k rounds of a warp
// arg-max (greater probability, then lower id), the winner struck out with -1 (probabilities
// are >= 0).
__device__ __forceinline__ void route_token_warp(const float* lt, float* prob, int64_t ne, int64_t k, bool renorm,
                                                 int32_t* chosen, float* weight, int lane) {
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
      chosen[s] = best_e;
      weight[s] = best;  // rescaled below
    }
    wsum += best;  // every lane has the same best: the sum in slot order, as the reference
    __syncwarp();
  }
  if (renorm) {  // lane 0's stores are visible to the warp: the loop ended with __syncwarp
    for (int64_t s = lane; s < k; s += 32) weight[s] = weight[s] / wsum;
  }
}

}  // namespace moraine::cuda::route_detail
