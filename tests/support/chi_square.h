// Pearson's chi-square goodness of fit for the statistical tests of sampling: observed counts of
// categories against their exact probabilities, and the chi-square distribution's upper quantile
// to compare the statistic with (computed, not tabled: the regularised lower incomplete gamma's
// series, inverted by bisection).
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>

namespace moraine::testing {

// P(a, x), the regularised lower incomplete gamma function, by its power series (converges for
// every x; the tests' x stay below a few hundred, where a few thousand terms suffice).
inline double gamma_p(double a, double x) {
  if (x <= 0.0) return 0.0;
  double term = 1.0 / a, sum = term;
  for (int n = 1; n < 100000; ++n) {
    term *= x / (a + n);
    sum += term;
    if (term < sum * 1e-17) break;
  }
  return std::exp(a * std::log(x) - x - std::lgamma(a)) * sum;
}

// The x with P(chi-square_df > x) = p.
inline double chi_square_upper_quantile(int df, double p) {
  if (df < 1 || !(p > 0.0 && p < 1.0)) throw std::invalid_argument("chi_square_upper_quantile: df >= 1, p in (0, 1)");
  double lo = 0.0, hi = 10.0 * df + 100.0;
  for (int i = 0; i < 200; ++i) {
    const double mid = (lo + hi) / 2;
    (1.0 - gamma_p(df / 2.0, mid / 2.0) > p ? lo : hi) = mid;
  }
  return (lo + hi) / 2;
}

struct ChiSquare {
  double statistic = 0.0;
  int df = 0;
  double bound = 0.0;   // the upper quantile at the test's p
  bool passes() const { return statistic <= bound; }
  std::string describe() const {
    return "chi-square " + std::to_string(statistic) + " over " + std::to_string(df) + " degrees of freedom, bound " +
           std::to_string(bound);
  }
};

// `observed`: counts per category out of n draws; `expected`: each category's exact probability
// (categories absent from it have probability 0: one observed there makes the statistic infinite).
// Categories expected fewer than 5 times are pooled into one (the statistic's chi-square
// approximation needs expected counts of about 5 or more).
template <class Key>
ChiSquare chi_square(const std::map<Key, int64_t>& observed, const std::map<Key, double>& expected, int64_t n, double p) {
  ChiSquare c;
  for (const auto& [k, count] : observed) {
    const auto it = expected.find(k);
    if (count > 0 && (it == expected.end() || it->second <= 0.0)) c.statistic = std::numeric_limits<double>::infinity();
  }
  double pooled_e = 0.0;
  int64_t pooled_o = 0;
  int cells = 0;
  for (const auto& [k, prob] : expected) {
    if (prob <= 0.0) continue;
    const double e = prob * static_cast<double>(n);
    const auto it = observed.find(k);
    const int64_t o = it == observed.end() ? 0 : it->second;
    if (e < 5.0) {
      pooled_e += e;
      pooled_o += o;
      continue;
    }
    c.statistic += (static_cast<double>(o) - e) * (static_cast<double>(o) - e) / e;
    ++cells;
  }
  if (pooled_e > 0.0) {
    c.statistic += (static_cast<double>(pooled_o) - pooled_e) * (static_cast<double>(pooled_o) - pooled_e) / pooled_e;
    ++cells;
  }
  c.df = std::max(cells - 1, 1);
  c.bound = chi_square_upper_quantile(c.df, p);
  return c;
}

}  // namespace moraine::testing
