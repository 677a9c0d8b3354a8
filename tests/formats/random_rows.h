// Random test rows for the format tests: fixed seeds, several shapes of distribution.
#pragma once
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace moraine::test {

enum class Dist { Gaussian, Uniform, Outliers };

inline std::string dist_name(Dist d) {
  switch (d) {
    case Dist::Gaussian: return "gaussian";
    case Dist::Uniform: return "uniform";
    case Dist::Outliers: return "outliers";
  }
  return "?";
}

inline constexpr Dist kAllDists[] = {Dist::Gaussian, Dist::Uniform, Dist::Outliers};

// Gaussian(0, 1); uniform on [-1, 3) (off-centre, exercises the mins); gaussian with 1% of the
// elements scaled by 25 (the heavy-tailed rows real weight matrices have).
inline std::vector<float> random_row(Dist d, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(-1.0f, 3.0f);
  std::uniform_real_distribution<float> coin(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) {
    switch (d) {
      case Dist::Gaussian: v = normal(rng); break;
      case Dist::Uniform: v = uniform(rng); break;
      case Dist::Outliers: v = normal(rng) * (coin(rng) < 0.01f ? 25.0f : 1.0f); break;
    }
  }
  return x;
}

}  // namespace moraine::test
