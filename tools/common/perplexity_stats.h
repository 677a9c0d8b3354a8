// The statistics moraine-perplexity reports, as llama.cpp's llama-perplexity defines them: the
// perplexity of a model over scored tokens (exp of the mean negative log-likelihood, with the
// standard error of that mean carried through exp), and, against a base model's logits on the
// same tokens, the mean KL divergence KL(base || model), the share of tokens whose top-1 tokens
// agree and the perplexity difference, each with its standard error. Log-softmax and KL are
// computed in double from the full logits (llama.cpp stores the base's log-probabilities in
// 16 bits first, which moves its KL by up to ~1e-4; here a file against itself gives exactly 0).
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>

namespace moraine::tools {

// A mean and the standard error of it, from sums over `count` samples (sqrt of the sample
// variance over count - 1; 0 for fewer than two samples).
struct MeanAndError {
  double mean = 0, error = 0;
};
MeanAndError mean_and_error(double sum, double sum_squares, size_t count);

// -log softmax(logits)[token], in double. Throws std::invalid_argument for a token outside the row.
double negative_log_likelihood(std::span<const float> logits, int32_t token);

// The perplexity of one model over the tokens added so far.
class PerplexityStats {
 public:
  // One scored token: the logits of the row that predicts `next`, and that token.
  void add(std::span<const float> logits, int32_t next) { add_nll(negative_log_likelihood(logits, next)); }
  void add_nll(double nll);
  size_t count() const { return count_; }
  double mean_nll() const;
  MeanAndError ppl() const;   // exp(mean nll), error = ppl * standard error of the mean nll

 private:
  double sum_ = 0, sum_squares_ = 0;
  size_t count_ = 0;
};

// A model's logits against a base model's on the same scored tokens.
class DivergenceStats {
 public:
  // One scored token: both rows (the same vocabulary) and the token they predict. Throws
  // std::invalid_argument when the rows differ in length.
  void add(std::span<const float> base_logits, std::span<const float> logits, int32_t next);
  size_t count() const { return count_; }
  MeanAndError ppl() const;        // the model's
  MeanAndError base_ppl() const;   // the base's
  MeanAndError kl() const;         // mean KL(base || model), nats per token
  MeanAndError top1() const;       // share of tokens whose argmax agree (first index on ties)
  // ppl() - base_ppl(), its error from both errors and the covariance of the two nll series.
  MeanAndError delta_ppl() const;

 private:
  double sum_nll_ = 0, sum_nll2_ = 0, sum_base_ = 0, sum_base2_ = 0, sum_nll_base_ = 0;
  double sum_kl_ = 0, sum_kl2_ = 0;
  size_t same_top_ = 0, count_ = 0;
};

}  // namespace moraine::tools
