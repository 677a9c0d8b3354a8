#include "tools/common/perplexity_stats.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace moraine::tools {

namespace {

// The row's argmax (first index on ties) and log(sum exp(z - max)), so that
// log softmax(z)[i] = z[i] - max - log_sum.
struct RowNorm {
  size_t argmax = 0;
  double max = 0, log_sum = 0;
};

RowNorm row_norm(std::span<const float> z) {
  if (z.empty()) throw std::invalid_argument("perplexity: an empty logits row");
  RowNorm r;
  for (size_t i = 1; i < z.size(); ++i) {
    if (z[i] > z[r.argmax]) r.argmax = i;
  }
  r.max = z[r.argmax];
  double sum = 0;
  for (const float x : z) sum += std::exp(static_cast<double>(x) - r.max);
  r.log_sum = std::log(sum);
  return r;
}

void check_token(std::span<const float> z, int32_t token) {
  if (token < 0 || static_cast<size_t>(token) >= z.size())
    throw std::invalid_argument("perplexity: token " + std::to_string(token) + " is outside a vocabulary of " +
                                std::to_string(z.size()));
}

}  // namespace

MeanAndError mean_and_error(double sum, double sum_squares, size_t count) {
  if (count == 0) return {};
  const double n = static_cast<double>(count);
  MeanAndError m{sum / n, 0};
  const double variance = sum_squares / n - m.mean * m.mean;
  if (count > 1 && variance > 0) m.error = std::sqrt(variance / (n - 1));
  return m;
}

double negative_log_likelihood(std::span<const float> logits, int32_t token) {
  check_token(logits, token);
  const RowNorm r = row_norm(logits);
  return r.max + r.log_sum - static_cast<double>(logits[static_cast<size_t>(token)]);
}

void PerplexityStats::add_nll(double nll) {
  sum_ += nll;
  sum_squares_ += nll * nll;
  ++count_;
}

double PerplexityStats::mean_nll() const { return mean_and_error(sum_, sum_squares_, count_).mean; }

namespace {

// exp of a mean log-likelihood and its error carried through exp (d exp(x) = exp(x) dx).
MeanAndError exp_of(MeanAndError log_mean) {
  const double v = std::exp(log_mean.mean);
  return {v, v * log_mean.error};
}

}  // namespace

MeanAndError PerplexityStats::ppl() const { return exp_of(mean_and_error(sum_, sum_squares_, count_)); }

void DivergenceStats::add(std::span<const float> base_logits, std::span<const float> logits, int32_t next) {
  if (base_logits.size() != logits.size())
    throw std::invalid_argument("perplexity: base rows have " + std::to_string(base_logits.size()) +
                                " logits, the model's " + std::to_string(logits.size()));
  check_token(logits, next);
  const RowNorm b = row_norm(base_logits), q = row_norm(logits);
  const double b_shift = b.max + b.log_sum, q_shift = q.max + q.log_sum;
  double kl = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    const double log_p_base = static_cast<double>(base_logits[i]) - b_shift;
    const double log_p = static_cast<double>(logits[i]) - q_shift;
    kl += std::exp(log_p_base) * (log_p_base - log_p);
  }
  const size_t t = static_cast<size_t>(next);
  const double nll = q_shift - static_cast<double>(logits[t]);
  const double nll_base = b_shift - static_cast<double>(base_logits[t]);
  sum_nll_ += nll;
  sum_nll2_ += nll * nll;
  sum_base_ += nll_base;
  sum_base2_ += nll_base * nll_base;
  sum_nll_base_ += nll * nll_base;
  sum_kl_ += kl;
  sum_kl2_ += kl * kl;
  same_top_ += b.argmax == q.argmax ? 1 : 0;
  ++count_;
}

MeanAndError DivergenceStats::ppl() const { return exp_of(mean_and_error(sum_nll_, sum_nll2_, count_)); }

MeanAndError DivergenceStats::base_ppl() const { return exp_of(mean_and_error(sum_base_, sum_base2_, count_)); }

MeanAndError DivergenceStats::kl() const { return mean_and_error(sum_kl_, sum_kl2_, count_); }

MeanAndError DivergenceStats::top1() const {
  if (count_ == 0) return {};
  const double n = static_cast<double>(count_), p = static_cast<double>(same_top_) / n;
  return {p, count_ > 1 ? std::sqrt(p * (1 - p) / (n - 1)) : 0.0};
}

MeanAndError DivergenceStats::delta_ppl() const {
  const MeanAndError q = ppl(), base = base_ppl();
  if (count_ < 2) return {q.mean - base.mean, 0};
  const double n = static_cast<double>(count_);
  // The covariance of the two mean nll's: the sample covariance over n - 1, carried through exp.
  const double log_cov = (sum_nll_base_ / n - (sum_nll_ / n) * (sum_base_ / n)) / (n - 1);
  const double variance = q.error * q.error + base.error * base.error - 2 * q.mean * base.mean * log_cov;
  return {q.mean - base.mean, std::sqrt(std::max(variance, 0.0))};
}

}  // namespace moraine::tools
