// Which experts will layer il + 1 route to? A guess the cpu_expert_worker makes from layer il's
// MoE input while the GPU runs the rest of layer il and layer il + 1's mixer, so that its idle
// threads can pull those experts toward their L2 before the request arrives.
//
// Layer il's MoE input is h = x * w_il / rms(x) (x: the residual after layer il's mixer, w_il:
// its ffn norm). Layer il + 1's router reads x' * w_il+1 / rms(x') with x' = x plus layer il's
// MoE output and layer il + 1's mixer output. The guess drops both additions: it routes
// h * w_il+1 / w_il, i.e. layer il + 1's router folded with the ratio of the two norm weights,
// which is exactly layer il + 1's routing of x (the rms cancels). Measured on a 12-layer
// qwen3moe-30b-a3b moraine-synth file (--zipf 0, 24 random tokens, reference executor): 74% of
// layer il + 1's top-8 guessed right (chance: 6%); from x after layer il's MoE instead (later,
// so less time to prefetch) 74% too.
//
// The folded routers are stored as int8 rows with a float scale each (a quarter of F32's bytes:
// the guess reads them during the idle window it is meant to fill); a logit is then off by at
// most error_bound() from the F32 fold.
#pragma once
#include <cstdint>
#include <vector>

#include "common/model/model.h"
#include "kernels/cpu/thread_pool.h"

namespace moraine::cpu_worker {

class NextLayerGuess {
 public:
  // Folds and quantizes every layer's router but the first (throws std::invalid_argument for a
  // model without routers or norms of the expected sizes).
  explicit NextLayerGuess(const model::Model& m);

  // Layer il + 1's logits for the n_embd floats h (layer il's normalised MoE input), each from
  // the int8 fold: logits[e], e < n_expert. il must be below n_layer - 1. Rows are split over
  // the pool (jobs of kRowsPerJob experts); allocates nothing after the first call.
  void logits(int64_t il, const float* h, cpu::ThreadPool& pool, std::vector<float>& out) const;

  // Layer il + 1's top `k` experts (default n_expert_used) for each of the n rows of h, best
  // first, ties to the lower id; for several rows the union, row 0's first. Appends to `out`.
  void guess(int64_t il, const float* h, int64_t n, cpu::ThreadPool& pool, std::vector<int32_t>& out, int64_t k = 0);

  // |logit from the int8 fold - logit from the F32 fold| <= this, for expert e and input h.
  float error_bound(int64_t il, int64_t e, const float* h) const;

  static constexpr int64_t kRowsPerJob = 8;   // 16 KB of int8 weights per job at n_embd 2048

 private:
  const int8_t* row(int64_t il, int64_t e) const {
    return q_.data() + (static_cast<size_t>(il) * static_cast<size_t>(n_expert_) + static_cast<size_t>(e)) * static_cast<size_t>(n_embd_);
  }
  int64_t n_layer_, n_embd_, n_expert_, k_;
  std::vector<int8_t> q_;       // [n_layer - 1][n_expert][n_embd]: entry il holds layer il + 1's fold
  std::vector<float> scale_;    // [n_layer - 1][n_expert]
  std::vector<float> choice_bias_;    // [n_layer - 1][n_expert]: router bias + score bias of layer il + 1
  std::vector<bool> sigmoid_choice_;  // [n_layer - 1]: layer il + 1 chooses by sigmoid(logit) + bias
  mutable std::vector<float> logits_;
  std::vector<int32_t> order_;
};

}  // namespace moraine::cpu_worker
