// The CPU backend: the reference executor's layer-step pieces, so the group's numbers are the
// reference's. Scratch is sized once for max_tokens rows.
#include <algorithm>
#include <stdexcept>

#include "common/reference/executor.h"
#include "common/reference/moe_parts.h"
#include "gpu_worker/backend.h"
#ifdef MORAINE_HAVE_CUDA
#include "gpu_worker/cuda_backend.h"
#endif

namespace moraine::gpu_worker {

namespace {

class CpuBackend final : public Backend {
 public:
  CpuBackend(const model::Model& m, int max_tokens, int threads) : m_(m), exec_(m, {threads}) {
    router_.reserve(m.hp, max_tokens);
    if (m.hp.n_ff_shexp > 0) shared_scratch_.reserve(max_tokens, m.hp.n_ff_shexp);
    shared_.resize(static_cast<size_t>(max_tokens * m.hp.n_embd));
    norm_.resize(static_cast<size_t>(max_tokens * m.hp.n_embd));
    // One expert sees at most every token of the step once.
    gathered_.resize(static_cast<size_t>(max_tokens * m.hp.n_embd));
    routed_scratch_.reserve(max_tokens, m.hp.n_ff_exp);
  }
  void reset() override { exec_.reset(); }
  int64_t n_past() const override { return exec_.n_past(); }
  void embed(const int32_t* tokens, int64_t n, float* x) override {
    exec_.embed(std::span<const int32_t>(tokens, static_cast<size_t>(n)), x);
  }
  void mixer(int64_t il, float* x, int64_t n, float* h) override { exec_.mixer_step(il, x, n, h); }
  void route(int64_t il, const float* h, int64_t n, int32_t* chosen, float* weight) override {
    reference::route_top_k(m_.hp, m_.layers[il].moe, h, n, chosen, weight, router_, exec_.pool());
  }
  void combine(int64_t il, const float* h, int64_t n, const float* weight,
               const float* const* slot_rows, float* x) override {
    const model::MoeWeights& W = m_.layers[il].moe;
    const float* shared = nullptr;
    if (W.shared_up) {
      reference::swiglu_expert(W.shared_gate, W.shared_up, W.shared_down, h, n, shared_.data(),
                               shared_scratch_, exec_.pool());
      shared = shared_.data();
    }
    reference::moe_combine(m_.hp, W, h, n, weight, slot_rows, shared, x);
  }
  void routed_experts(int64_t il, const float* h, int64_t n, const group::ExpertPlan& plan,
                      const std::vector<int32_t>& experts, float* expert_out) override {
    (void)n;
    const model::MoeWeights& W = m_.layers[il].moe;
    const int64_t d = m_.hp.n_embd, k = m_.hp.n_expert_used;
    for (int32_t e : experts) {
      const int32_t rows = plan.count(e);
      if (rows == 0) continue;
      for (int32_t j = 0; j < rows; ++j) {
        const int64_t t = plan.slot_of[plan.start[e] + j] / k;
        std::copy_n(h + t * d, d, gathered_.data() + j * d);
      }
      reference::swiglu_expert(W.gate.expert(e), W.up.expert(e), W.down.expert(e),
                               gathered_.data(), rows, expert_out + int64_t{plan.start[e]} * d,
                               routed_scratch_, exec_.pool());
    }
  }
  void advance(int64_t n) override { exec_.advance(n); }
  void logits(const float* x, int64_t rows, float* out) override {
    exec_.output_logits(x, rows, norm_.data(), out);
  }

 private:
  const model::Model& m_;
  reference::ReferenceExecutor exec_;
  reference::RouterScratch router_;
  reference::ExpertScratch shared_scratch_, routed_scratch_;
  std::vector<float> shared_, norm_, gathered_;
};

}  // namespace

std::unique_ptr<Backend> make_backend(const std::string& kind, int device, const model::Model& m,
                                      int max_tokens, int threads) {
  if (kind == "cpu") return std::make_unique<CpuBackend>(m, max_tokens, threads);
  if (kind == "cuda") {
#ifdef MORAINE_HAVE_CUDA
    return make_cuda_backend(m, device, max_tokens, std::max<int64_t>(kDefaultCudaContext, max_tokens));
#else
    throw std::runtime_error("--backend cuda: this build has no CUDA (nvcc was not found at configure time; "
                             "device " + std::to_string(device) + "); use --backend cpu");
#endif
  }
  throw std::runtime_error("--backend " + kind + ": expected cpu or cuda");
}

}  // namespace moraine::gpu_worker
