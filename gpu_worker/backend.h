// What the gpu_worker asks of a device: the dense part of each layer (mixer, router, shared
// expert, the weighted sum of expert outputs) with KV cache and recurrent state kept on the
// device. Two implementations are planned: CUDA (not built yet) and CPU (reusing the reference
// kernels, so the whole group runs and is tested on machines without a GPU).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "coordinator/group_layout.h"

namespace moraine::gpu_worker {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual void reset() = 0;                  // forget the cached sequence
  virtual int64_t n_past() const = 0;
  virtual void embed(const int32_t* tokens, int64_t n, float* x) = 0;
  // Mixer of layer il on residual x, then the normalised MoE input into h.
  virtual void mixer(int64_t il, float* x, int64_t n, float* h) = 0;
  // Router top-k of layer il over h: chosen/weight [n][k].
  virtual void route(int64_t il, const float* h, int64_t n, int32_t* chosen, float* weight) = 0;
  // Adds the MoE output to x: routed slot outputs (slot_rows) weighted, plus the shared expert.
  virtual void combine(int64_t il, const float* h, int64_t n, const float* weight,
                       const float* const* slot_rows, float* x) = 0;
  // Routed experts the placement put on this device, for layer il. `plan` groups the step's
  // slots (t * k + s) per expert (coordinator/group_layout.h ExpertPlan); for each id in
  // `experts` (ascending), packed rows plan.start[e]..plan.start[e+1] come from h rows
  // plan.slot_of[r] / k and go to expert_out + r * n_embd, as the cpu_expert_workers write theirs.
  virtual void routed_experts(int64_t il, const float* h, int64_t n, const group::ExpertPlan& plan,
                              const std::vector<int32_t>& experts, float* expert_out) = 0;
  virtual void advance(int64_t n) = 0;
  virtual void logits(const float* x, int64_t rows, float* out) = 0;
};

// `kind` "cpu" or "cuda"; throws std::runtime_error for a backend this build does not have.
std::unique_ptr<Backend> make_backend(const std::string& kind, int device, const model::Model& m,
                                      int max_tokens, int threads);

}  // namespace moraine::gpu_worker
