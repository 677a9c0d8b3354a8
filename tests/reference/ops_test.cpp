// Reference ops against direct formulas written differently (double precision, whole-matrix
// forms), on fresh random data with fixed seeds.
#include <gtest/gtest.h>

#include <cmath>
#include <complex>
#include <random>
#include <vector>

#include "common/reference/ops.h"

namespace moraine::reference {
namespace {

std::vector<float> randv(std::mt19937_64& rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

TEST(Ops, RmsNormMatchesFormula) {
  std::mt19937_64 rng(11);
  const int64_t n = 37;
  auto x = randv(rng, n, -3, 3), w = randv(rng, n, 0.5f, 1.5f);
  std::vector<float> out(n);
  rms_norm(x.data(), w.data(), n, 1e-6f, out.data());
  double ss = 0;
  for (float v : x) ss += double(v) * v;
  const double inv = 1.0 / std::sqrt(ss / n + 1e-6);
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(out[i], x[i] * inv * w[i], 1e-5);
}

TEST(Ops, L2NormGivesUnitVector) {
  std::mt19937_64 rng(12);
  auto x = randv(rng, 16, -2, 2);
  auto y = x;
  l2_norm(y.data(), 16, 1e-6f);
  double ss = 0, dotp = 0, nx = 0;
  for (int i = 0; i < 16; ++i) {
    ss += double(y[i]) * y[i];
    dotp += double(x[i]) * y[i];
    nx += double(x[i]) * x[i];
  }
  EXPECT_NEAR(ss, 1.0, 1e-5);
  EXPECT_NEAR(dotp, std::sqrt(nx), 1e-4);  // same direction
}

// NEOX RoPE as a complex rotation of pairs (i, i + n_rot/2), dims past n_rot untouched.
TEST(Ops, RopeNeoxIsPairwiseComplexRotation) {
  std::mt19937_64 rng(13);
  for (int64_t n_rot : {24, 6}) {
    const int64_t hd = 24;
    const double base = 1e6;
    for (int64_t pos : {0, 1, 7, 300}) {
      auto x = randv(rng, hd);
      auto y = x;
      rope_neox(y.data(), n_rot, pos, base);
      const int64_t half = n_rot / 2;
      for (int64_t i = 0; i < half; ++i) {
        const double freq = 1.0 / std::pow(base, double(2 * i) / n_rot);
        std::complex<double> z(x[i], x[i + half]);
        z *= std::polar(1.0, pos * freq);
        EXPECT_NEAR(y[i], z.real(), 2e-6) << "n_rot " << n_rot << " pos " << pos << " i " << i;
        EXPECT_NEAR(y[i + half], z.imag(), 2e-6);
      }
      for (int64_t i = n_rot; i < hd; ++i) EXPECT_EQ(y[i], x[i]);
    }
  }
}

TEST(Ops, AttentionMatchesDirectSoftmax) {
  std::mt19937_64 rng(14);
  const int64_t n_kv = 19, hd = 16, stride = 40;  // k/v rows interleaved with other heads
  auto q = randv(rng, hd, -2, 2);
  auto k = randv(rng, n_kv * stride, -2, 2), v = randv(rng, n_kv * stride);
  const float scale = 0.25f;
  std::vector<float> scores(n_kv), out(hd);
  attend_one_head(q.data(), k.data() + 8, v.data() + 8, n_kv, stride, hd, scale, scores.data(), out.data());
  std::vector<double> p(n_kv);
  double z = 0;
  for (int64_t j = 0; j < n_kv; ++j) {
    double s = 0;
    for (int64_t d = 0; d < hd; ++d) s += double(q[d]) * k[j * stride + 8 + d];
    p[j] = std::exp(s * scale);
    z += p[j];
  }
  for (int64_t d = 0; d < hd; ++d) {
    double o = 0;
    for (int64_t j = 0; j < n_kv; ++j) o += p[j] / z * v[j * stride + 8 + d];
    EXPECT_NEAR(out[d], o, 1e-5);
  }
}

// Streaming conv steps equal the zero-padded causal convolution of the whole sequence.
TEST(Ops, Conv1dStepsEqualCausalConvolution) {
  std::mt19937_64 rng(15);
  const int64_t K = 4, C = 10, T = 9;
  auto w = randv(rng, C * K), x = randv(rng, T * C, -2, 2);
  std::vector<float> state((K - 1) * C, 0.0f), out(C);
  for (int64_t t = 0; t < T; ++t) {
    conv1d_silu_step(w.data(), K, C, state.data(), x.data() + t * C, out.data());
    for (int64_t c = 0; c < C; ++c) {
      double acc = 0;
      for (int64_t j = 0; j < K; ++j) {
        const int64_t src = t - (K - 1) + j;
        if (src >= 0) acc += double(w[c * K + j]) * x[src * C + c];
      }
      const double expect = acc / (1.0 + std::exp(-acc));
      EXPECT_NEAR(out[c], expect, 1e-5) << "t " << t << " c " << c;
    }
  }
}

// The delta rule in matrix form: S_t = exp(g) (I - beta k k^T) S_{t-1} + beta k v^T,
// o_t = scale S_t^T q, run in double with explicit matrix products.
TEST(Ops, DeltaRuleStepMatchesMatrixForm) {
  std::mt19937_64 rng(16);
  const int64_t dk = 8, dv = 6, T = 12;
  const float scale = 1.0f / std::sqrt(float(dk));
  std::vector<float> S(dk * dv, 0.0f), o(dv);
  std::vector<double> Sd(dk * dv, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    auto q = randv(rng, dk), k = randv(rng, dk), v = randv(rng, dv, -2, 2);
    l2_norm(k.data(), dk, 1e-6f);
    const float g = -std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
    const float beta = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
    delta_rule_step(S.data(), q.data(), k.data(), v.data(), g, beta, dk, dv, scale, o.data());

    std::vector<double> A(dk * dk);  // exp(g) (I - beta k k^T)
    for (int64_t i = 0; i < dk; ++i)
      for (int64_t j = 0; j < dk; ++j)
        A[i * dk + j] = std::exp(double(g)) * ((i == j ? 1.0 : 0.0) - double(beta) * k[i] * k[j]);
    std::vector<double> Sn(dk * dv, 0.0);
    for (int64_t i = 0; i < dk; ++i)
      for (int64_t j = 0; j < dv; ++j) {
        double s = 0;
        for (int64_t m = 0; m < dk; ++m) s += A[i * dk + m] * Sd[m * dv + j];
        Sn[i * dv + j] = s + double(beta) * k[i] * v[j];
      }
    Sd = Sn;
    for (int64_t j = 0; j < dv; ++j) {
      double oj = 0;
      for (int64_t i = 0; i < dk; ++i) oj += Sd[i * dv + j] * q[i];
      EXPECT_NEAR(o[j], oj * scale, 1e-5) << "t " << t << " j " << j;
    }
  }
  for (int64_t i = 0; i < dk * dv; ++i) EXPECT_NEAR(S[i], Sd[i], 1e-5);
}

TEST(Ops, SoftplusMatchesFormulaAndIsLinearAboveThreshold) {
  for (float x : {-30.0f, -2.0f, 0.0f, 0.5f, 19.0f}) {
    EXPECT_NEAR(softplus(x), std::log1p(std::exp(double(x))), 1e-6 * std::max(1.0f, std::fabs(x)));
  }
  EXPECT_EQ(softplus(25.0f), 25.0f);
}

}  // namespace
}  // namespace moraine::reference
