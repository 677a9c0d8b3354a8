// The random values of every tensor, row by row: deterministic from (seed, tensor name, row),
// scaled so activations stay O(1) through the layers, with the massive dimension and router
// biases router_skew.h describes.
//
//   token_embd     uniform, std 1; element j (the massive dimension) = sqrt(hidden)
//   norms          1 +- 5% (element j exactly 1)
//   input proj.    std 1/sqrt(fan_in); element j = 0 (nothing but the router reads j)
//   output proj.   std 1/sqrt(fan_in * 2 * n_layer); row j = 0 (nothing writes j)
//   router         noise part std kLogitNoise / |token-dependent input|, a share kSlowShare
//                  of it from the slow subspace S; element j = bias
//   recency heads  the first q head of the first kv groups of every attention layer
//                  (router_locality.h): constant q/k from element j, q/k norm sqrt(amp) on
//                  rotated dims, output only into S, which the embedding and every other
//                  output projection leave at zero
//   output (head)  std 1/sqrt(hidden); element j = 0
//   ssm_a          -exp(U(-1, 1)); ssm_dt.bias 1 +- 0.5; conv taps std 1/sqrt(kernel)
#pragma once
#include <cstdint>
#include <vector>

#include "tools/synth/router_locality.h"
#include "tools/synth/router_skew.h"
#include "tools/synth/shapes.h"

namespace moraine::synth {

class WeightInit {
 public:
  // Calibrates the router biases (a fraction of a second for 512 experts).
  WeightInit(const ShapeSpec& shape, uint64_t seed, double zipf);

  int64_t massive_dim() const { return massive_dim_; }
  const RecencyDesign& recency() const { return recency_; }

  // Fills rows [row_begin, row_end) of tensor t (row length t.shape[0]) into out.
  void fill_rows(const TensorSpec& t, int64_t row_begin, int64_t row_end, float* out) const;

 private:
  ShapeSpec shape_;
  uint64_t seed_;
  int64_t massive_dim_;
  std::vector<double> rank_bias_;                // per popularity rank, in logit-noise units
  std::vector<std::vector<int64_t>> layer_rank_;  // [layer][expert] -> popularity rank
  RecencyDesign recency_;
  RouterInputModel router_input(int64_t layer) const;   // with the slow subspace
  // Rows of the recency heads' q (and gate) and their kv heads' k in an attention layer:
  // constant from element j.
  void recency_in_proj(const TensorSpec& t, int64_t r, float* row) const;
};

}  // namespace moraine::synth
