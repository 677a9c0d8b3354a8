// The MoE block's output into the residual: for every token t and element i,
//   x[t][i] += sum_s weight[t][s] * slots[t * k + s][i]  (+ sigmoid(gate_logit[t]) * shared[t][i])
// (an ungated shared expert, glm4moe's: + shared[t][i], gate_logit null)
// with the slot terms added in top-k order, then the shared expert, then the residual: the float
// additions of moraine::reference::moe_combine (common/reference/moe_parts.cpp) in its order, each
// rounded to nearest (no contraction), so equal inputs give bit-identical x. gate_logit is the
// shared expert's router dot h . w (the "sigmoid router" of qwen3next), computed by a matvec.
//
// Memory contract (device floats): x [n][d]; slots [n * k][d]; weight [n * k]; shared [n][d] and
// gate_logit [n] both null when the model has no shared expert, gate_logit alone null when its
// shared expert has no gate.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moraine::cuda {

void moe_combine(float* x, const float* slots, const float* weight, const float* shared, const float* gate_logit,
                 int64_t n, int64_t k, int64_t d, cudaStream_t stream = nullptr);

// The same sum when some experts were computed off the device (the cpu workers): slot i's row is
// host_rows + host_row_of[i] * d when host_row_of[i] >= 0 (the workers' packed rows, copied to
// the device), else slots + i * d. host_rows and host_row_of (device [n * k]) both null: as
// moe_combine. Same order of additions, so the same bits for the same rows.
void moe_combine_mixed(float* x, const float* slots, const float* host_rows, const int32_t* host_row_of,
                       const float* weight, const float* shared, const float* gate_logit, int64_t n, int64_t k,
                       int64_t d, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
