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

// The (best, id) of the warp: greater probability, then lower id. Every lane gets it.
__device__ __forceinline__ void warp_best(float& best, int& best_e) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // Two redux instructions instead of a 5-step tree of two shuffles each. Probabilities are >= 0,
  // so their bits order as unsigned; 0 is kept for "none" (struck entries, and NaN, which the
  // shuffle tree never picks either). Gives the tree's winner whenever one is >= 0, which holds
  // in every round since k <= n_expert leaves an entry not struck.
  const unsigned key = best >= 0.0f ? __float_as_uint(best) + 1u : 0u;
  const unsigned top = __reduce_max_sync(0xffffffffu, key);
  best_e = static_cast<int>(__reduce_min_sync(0xffffffffu, key == top ? static_cast<unsigned>(best_e) : 0x7fffffffu));
  best = top != 0u ? __uint_as_float(top - 1u) : -1.0f;
#else
  for (int off = 16; off > 0; off /= 2) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, off);
    const int oe = __shfl_xor_sync(0xffffffffu, best_e, off);
    if (ob > best || (ob == best && oe < best_e)) best = ob, best_e = oe;
  }
#endif
}

// route_token_warp for n_expert <= 32 * kPer with the probabilities in registers (lane l holds
// experts l, l + 32, ...): the same float operations in the same order (expf, the lane sums and
// xor trees, the division, the slot-order weight sum), hence the same bits, without a shared
// memory round trip per top-k round or a global store per slot (the k slots are written once at
// the end, slot s by lane s % 32). H200, 128 experts, top 8, one token: 5.4 -> 2.9 us ncu-timed
// (graph-replayed 4.8 -> 2.2; moraine-kernel-bench cuda --mixer-only).
template <int kPer>
__device__ __forceinline__ void route_token_warp_regs(const float* lt, int ne, int k, bool renorm, int32_t* chosen,
                                                      float* weight, int lane) {
  float p[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) p[j] = lane + 32 * j < ne ? lt[lane + 32 * j] : -INFINITY;
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < kPer; ++j) mx = fmaxf(mx, p[j]);
  for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (lane + 32 * j < ne) {
      p[j] = expf(p[j] - mx);
      sum += p[j];
    }
  }
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
#pragma unroll
  for (int j = 0; j < kPer; ++j) p[j] = lane + 32 * j < ne ? p[j] / sum : -3.0f;  // -3: never picked
  float wsum = 0.0f, w_lo = 0.0f, w_hi = 0.0f;
  int c_lo = 0, c_hi = 0;
  for (int s = 0; s < k; ++s) {
    float best = -2.0f;
    int best_e = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (p[j] > best) best = p[j], best_e = lane + 32 * j;  // ascending per lane: ties keep the lower
    }
    warp_best(best, best_e);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (lane + 32 * j == best_e) p[j] = -1.0f;
    }
    if (s == lane) c_lo = best_e, w_lo = best;
    if (s == lane + 32) c_hi = best_e, w_hi = best;
    wsum += best;  // the sum in slot order, as the reference
  }
  if (lane < k) {
    chosen[lane] = c_lo;
    weight[lane] = renorm ? w_lo / wsum : w_lo;
  }
  if (lane + 32 < k) {
    chosen[lane + 32] = c_hi;
    weight[lane + 32] = renorm ? w_hi / wsum : w_hi;
  }
}

}  // namespace moraine::cuda::route_detail
