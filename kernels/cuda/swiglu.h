// SwiGLU's elementwise step: g[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u, in place over
// `count` floats (device). Scalar reference: moraine::reference::silu (common/reference/ops.h)
// times u; the device exp may differ from the host's in the last bit.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moraine::cuda {

void swiglu(float* g, const float* u, int64_t count, cudaStream_t stream = nullptr);

// The routed experts' activation of reference::biased_expert for rows of n_ff (gpt-oss), row r
// of expert expert_of_row[r] (device): g += gate_bias[e] and u += up_bias[e] (nullable, [n_expert]
// [n_ff]), then g = clamped ? swiglu_clamped(g, u, alpha, limit) (swiglu_clamped.cuh) : silu(g) * u,
// in place in g. The bits of moe_fused's kernel 1 for the same g and u.
void swiglu_experts(float* g, const float* u, int64_t rows, int64_t n_ff, const int32_t* expert_of_row,
                    const float* gate_bias, const float* up_bias, bool clamped, float alpha, float limit,
                    cudaStream_t stream = nullptr);

// y[r][i] += bias[expert_of_row[r]][i] for rows of d floats (the experts' down bias, gpt-oss).
void add_expert_bias(float* y, int64_t rows, int64_t d, const int32_t* expert_of_row, const float* bias,
                     cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
