// gpt-oss's clamped SwiGLU of one element (reference::biased_expert), with the reference's
// operations and rounding (expf aside): g = min(g, limit); u = clamp(u, -limit, limit);
// act = g * sigmoid(alpha g) * (u + 1), sigmoid(x) = 1 / (1 + exp(-x)). Shared by moe_fused's
// kernel 1 and swiglu_experts (swiglu.cu), so the decode and prefill paths agree.
#pragma once
#include <cmath>

namespace moraine::cuda {

__device__ __forceinline__ float swiglu_clamped(float g, float u, float alpha, float limit) {
  g = fminf(g, limit);
  u = fmaxf(-limit, fminf(u, limit));
  const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-__fmul_rn(alpha, g))));
  return __fmul_rn(__fmul_rn(g, sig), __fadd_rn(u, 1.0f));
}

}  // namespace moraine::cuda
