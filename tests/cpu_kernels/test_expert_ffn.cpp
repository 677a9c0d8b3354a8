// The fused expert FFN against two references:
//  1. a straightforward dequantize-then-float (double) FFN, within a tolerance derived term by
//     term below (float summation, SwiGLU rounding, the intermediate's quantization), for every
//     format and tier;
//  2. the same pipeline spelled out with the scalar reference quantizers and vec_dot_reference:
//     bitwise equal for the k-quants, whose kernels equal the reference bitwise.
// Activations are quantized with llama.cpp's x86 rule (the production path's choice, see
// expert_ffn.cpp). MoeFfn::run_expert, the worker's per-expert call, must equal
// reference::swiglu_expert bitwise for the k-quants and stay within the float reference's
// bound for Q8_0 / MXFP4. Layers of several experts with different token subsets must equal
// the sum of the experts, and the result must not depend on the pool's size.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "common/reference/moe_parts.h"
#include "kernels/cpu/cpu_topology.h"
#include "kernels/cpu/expert_ffn.h"
#include "kernels/cpu/matvec.h"
#include "kernels/cpu/vec_dot.h"
#include "tests/cpu_kernels/tiers.h"
#include "tests/formats/dot_bounds.h"
#include "tests/formats/random_rows.h"

namespace moraine {
namespace {

constexpr double kU = 1.0 / (1 << 24);  // float unit roundoff
constexpr int64_t kHidden = 512, kFfn = 256;
// max |d/dz silu(z)| over the reals (attained near z = 2.4).
constexpr double kSiluSlope = 1.0998;

struct Mat {
  TensorType type;
  int64_t rows, cols;
  std::vector<uint8_t> q;
  std::vector<float> deq;
  size_t rb;
  const uint8_t* row(int64_t r) const { return q.data() + static_cast<size_t>(r) * rb; }
};

Mat make_mat(TensorType t, int64_t rows, int64_t cols, uint32_t seed) {
  Mat m{t, rows, cols, std::vector<uint8_t>(row_bytes(t, cols) * static_cast<size_t>(rows)), std::vector<float>(static_cast<size_t>(rows * cols)),
        row_bytes(t, cols)};
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> x = test::random_row(test::kAllDists[r % 3], cols, seed + static_cast<uint32_t>(r));
    for (float& v : x) v *= 0.08f;  // weight-like scale: keeps the FFN's values O(1)
    quantize_row(t, x.data(), m.q.data() + static_cast<size_t>(r) * m.rb, cols);
    dequantize_row(t, m.row(r), m.deq.data() + r * cols, cols);
  }
  return m;
}

struct Expert {
  Mat gate, up, down;
  cpu::ExpertWeights w;
};

Expert make_expert(TensorType gu, TensorType dn, uint32_t seed) {
  Expert e{make_mat(gu, kFfn, kHidden, seed), make_mat(gu, kFfn, kHidden, seed + 1000), make_mat(dn, kHidden, kFfn, seed + 2000), {}};
  e.w = {gu, gu, dn, e.gate.q.data(), e.up.q.data(), e.down.q.data(), kHidden, kFfn};
  return e;
}

std::vector<float> deq_act(TensorType act, const float* x, int64_t n) {
  std::vector<uint8_t> q(row_bytes(act, n));
  cpu::quantize_activation_row_llama_x86(act, x, q.data(), n);
  std::vector<float> d(static_cast<size_t>(n));
  dequantize_row(act, q.data(), d.data(), n);
  return d;
}

// Reference 1 for one token: value and error bound of FFN(x) (before the route weight),
// computed in double on dequantized weights and the dequantized activation the kernels are
// given (the x86 rule; its AVX-512 and scalar versions are bit-identical, tests/reference).
// Error terms:
//  - gate/up/down dots: the kernels' float summation, twice the recursive-sum bound;
//  - SwiGLU: |silu(g')u' - silu(g)u| <= L eg (|u| + eu) + |silu(g)| eu, plus a few ulps of
//    rounding for exp, the division and the product (8u relative);
//  - the intermediate's quantization: the reference quantizes its own h with the same rule; the kernel's h' is within eh of it, so an element's code can only differ where
//    h lies within eh (plus the block step's own change) of a rounding boundary: there the
//    value may move by one step, elsewhere only by |q| times the step's change (the step is
//    amax/127, amax moves by at most max eh, and Q8_0 rounds the step to fp16: one more
//    2^-10 relative).
void float_reference(const Expert& e, const float* x, std::vector<double>& y, std::vector<double>& err) {
  const TensorType at = dot_activation_type(e.w.gate_type), dt = dot_activation_type(e.w.down_type);
  const std::vector<float> xt = deq_act(at, x, kHidden);
  std::vector<uint8_t> xq(row_bytes(at, kHidden));
  cpu::quantize_activation_row_llama_x86(at, x, xq.data(), kHidden);
  std::vector<double> h(kFfn), eh(kFfn);
  for (int64_t j = 0; j < kFfn; ++j) {
    double g = 0, u = 0;
    for (int64_t i = 0; i < kHidden; ++i) {
      g += static_cast<double>(e.gate.deq[static_cast<size_t>(j * kHidden + i)]) * xt[static_cast<size_t>(i)];
      u += static_cast<double>(e.up.deq[static_cast<size_t>(j * kHidden + i)]) * xt[static_cast<size_t>(i)];
    }
    const double adds = static_cast<double>(kHidden / type_traits(e.w.gate_type).block_elems) + 20.0;
    const std::vector<float> grow(e.gate.deq.begin() + j * kHidden, e.gate.deq.begin() + (j + 1) * kHidden);
    const std::vector<float> urow(e.up.deq.begin() + j * kHidden, e.up.deq.begin() + (j + 1) * kHidden);
    double g_min_mag = 0, u_min_mag = 0;
    g += test::q8_1_min_correction(e.w.gate_type, e.gate.row(j), xq.data(), xt, &g_min_mag);
    u += test::q8_1_min_correction(e.w.up_type, e.up.row(j), xq.data(), xt, &u_min_mag);
    const double eg = 2.0 * adds * kU * (test::dot_magnitude(e.w.gate_type, std::vector<uint8_t>(e.gate.row(j), e.gate.row(j) + e.gate.rb), grow, xt) + g_min_mag);
    const double eu = 2.0 * adds * kU * (test::dot_magnitude(e.w.up_type, std::vector<uint8_t>(e.up.row(j), e.up.row(j) + e.up.rb), urow, xt) + u_min_mag);
    const double s = g / (1.0 + std::exp(-g));
    h[static_cast<size_t>(j)] = s * u;
    const double mag = (std::fabs(s) + kSiluSlope * eg) * (std::fabs(u) + eu);
    eh[static_cast<size_t>(j)] = kSiluSlope * eg * (std::fabs(u) + eu) + std::fabs(s) * eu + 8.0 * kU * mag;
  }
  const std::vector<float> hf(h.begin(), h.end());
  const std::vector<float> ht = deq_act(dt, hf.data(), kFfn);
  const int64_t qb = type_traits(dt).block_elems;
  std::vector<double> eq(kFfn);
  for (int64_t b = 0; b < kFfn; b += qb) {
    double amax = 0, ehmax = 0;
    for (int64_t j = b; j < b + qb; ++j) {
      amax = std::max(amax, std::fabs(h[static_cast<size_t>(j)]));
      ehmax = std::max(ehmax, eh[static_cast<size_t>(j)] + kU * std::fabs(h[static_cast<size_t>(j)]));
    }
    const double d = amax / 127.0;
    const double dd = ehmax / 127.0 + d * std::ldexp(1.0, -10);  // how far the kernel's step can be from d
    for (int64_t j = b; j < b + qb; ++j) {
      const double v = std::fabs(h[static_cast<size_t>(j)]);
      double& ej = eq[static_cast<size_t>(j)];
      ej = 127.0 * dd;
      if (d > 0) {
        const double frac = v / d - std::floor(v / d);
        const double margin = (eh[static_cast<size_t>(j)] + kU * v + v * dd / d) / d + 1e-4;
        if (std::fabs(frac - 0.5) < margin) ej += d;  // may round the other way
      }
    }
  }
  const std::vector<float> hmag = [&] {
    std::vector<float> m(kFfn);
    for (int64_t j = 0; j < kFfn; ++j) m[static_cast<size_t>(j)] = std::fabs(ht[static_cast<size_t>(j)]) + static_cast<float>(eq[static_cast<size_t>(j)]);
    return m;
  }();
  y.assign(kHidden, 0.0);
  err.assign(kHidden, 0.0);
  for (int64_t r = 0; r < kHidden; ++r) {
    double v = 0, ev = 0;
    for (int64_t j = 0; j < kFfn; ++j) {
      const double w = e.down.deq[static_cast<size_t>(r * kFfn + j)];
      v += w * ht[static_cast<size_t>(j)];
      ev += std::fabs(w) * eq[static_cast<size_t>(j)];
    }
    const double adds = static_cast<double>(kFfn / type_traits(e.w.down_type).block_elems) + 20.0;
    const std::vector<float> drow(e.down.deq.begin() + r * kFfn, e.down.deq.begin() + (r + 1) * kFfn);
    ev += 2.0 * adds * kU * test::dot_magnitude(e.w.down_type, std::vector<uint8_t>(e.down.row(r), e.down.row(r) + e.down.rb), drow, hmag) +
          test::q8_1_min_slack(e.w.down_type, e.down.row(r), hmag);
    y[static_cast<size_t>(r)] = v;
    err[static_cast<size_t>(r)] = ev;
  }
}

// Reference 2: the kernel's pipeline with the scalar reference dots, in float.
std::vector<float> exact_path(const Expert& e, const float* x) {
  const TensorType at = dot_activation_type(e.w.gate_type), dt = dot_activation_type(e.w.down_type);
  std::vector<uint8_t> xq(row_bytes(at, kHidden)), hq(row_bytes(dt, kFfn));
  cpu::quantize_activation_row_llama_x86(at, x, xq.data(), kHidden);
  std::vector<float> h(kFfn);
  for (int64_t j = 0; j < kFfn; ++j) {
    const float g = vec_dot_reference(e.w.gate_type, kHidden, e.gate.row(j), xq.data());
    const float u = vec_dot_reference(e.w.up_type, kHidden, e.up.row(j), xq.data());
    h[static_cast<size_t>(j)] = g / (1.0f + std::exp(-g)) * u;
  }
  cpu::quantize_activation_row_llama_x86(dt, h.data(), hq.data(), kFfn);
  std::vector<float> y(kHidden);
  for (int64_t r = 0; r < kHidden; ++r) y[static_cast<size_t>(r)] = vec_dot_reference(e.w.down_type, kFfn, e.down.row(r), hq.data());
  return y;
}

bool kquant(TensorType t) { return t != TensorType::Q8_0 && t != TensorType::MXFP4; }

struct FormatPair {
  TensorType gate_up, down;
};
constexpr FormatPair kPairs[] = {{TensorType::Q4_K, TensorType::Q4_K}, {TensorType::Q5_K, TensorType::Q5_K}, {TensorType::Q6_K, TensorType::Q6_K},
                                 {TensorType::Q8_0, TensorType::Q8_0}, {TensorType::Q2_K, TensorType::Q2_K}, {TensorType::Q3_K, TensorType::Q3_K},
                                 {TensorType::MXFP4, TensorType::MXFP4}, {TensorType::Q4_K, TensorType::Q6_K},
                                 // Q8_1 pairings only for gate/up: the tie-laden token of MoeFfn's test drives
                                 // the intermediate to ~1e3, where q8_1's s = d * sum(q) overflows fp16 (inf
                                 // in ggml too, a format limit).
                                 {TensorType::Q4_1, TensorType::Q5_0}, {TensorType::Q5_1, TensorType::IQ4_NL}, {TensorType::IQ4_XS, TensorType::IQ4_XS},
                                 {TensorType::TQ2_0, TensorType::TQ1_0}};

TEST(ExpertFfn, MatchesFloatReferenceAndReferencePipeline) {
  cpu::ThreadPool pool(cpu::allowed_cpus());
  for (const FormatPair& fp : kPairs) {
    const Expert e = make_expert(fp.gate_up, fp.down, 17 * static_cast<uint32_t>(fp.gate_up) + static_cast<uint32_t>(fp.down));
    for (int n_tok : {1, 3, 16, 33}) {
      std::vector<float> x(static_cast<size_t>(n_tok * kHidden)), y0(x.size()), rw(static_cast<size_t>(n_tok));
      for (int t = 0; t < n_tok; ++t) {
        const std::vector<float> r = test::random_row(test::kAllDists[t % 3], kHidden, 500 + static_cast<uint32_t>(t));
        std::copy(r.begin(), r.end(), x.begin() + t * kHidden);
        const std::vector<float> r0 = test::random_row(test::Dist::Gaussian, kHidden, 800 + static_cast<uint32_t>(t));
        std::copy(r0.begin(), r0.end(), y0.begin() + t * kHidden);
        rw[static_cast<size_t>(t)] = 0.1f + 0.05f * static_cast<float>(t % 7);
      }
      for (cpu::CpuIsa isa : test::available_tiers()) {
        cpu::CpuKernelTuning tu;
        tu.matvec.max_isa = isa;
        std::vector<float> y = y0;
        cpu::expert_ffn(e.w, x.data(), n_tok, rw.data(), y.data(), pool, tu);
        const std::string where = std::string(type_name(fp.gate_up)) + "/" + std::string(type_name(fp.down)) + " " +
                                  std::string(cpu::isa_name(isa)) + " n_tok " + std::to_string(n_tok);
        double sum_tol = 0, sum_sq = 0;
        for (int t = 0; t < n_tok; ++t) {
          std::vector<double> ref, err;
          float_reference(e, x.data() + t * kHidden, ref, err);
          const std::vector<float> ex = exact_path(e, x.data() + t * kHidden);
          for (int64_t r = 0; r < kHidden; ++r) {
            const size_t k = static_cast<size_t>(t * kHidden + r);
            const double want = y0[k] + static_cast<double>(rw[static_cast<size_t>(t)]) * ref[static_cast<size_t>(r)];
            // + the final multiply-add's rounding.
            const double tol = rw[static_cast<size_t>(t)] * err[static_cast<size_t>(r)] + 2.0 * kU * (std::fabs(y0[k]) + std::fabs(want));
            ASSERT_NEAR(y[k], want, tol) << where << " token " << t << " row " << r;
            if (kquant(fp.gate_up) && kquant(fp.down)) {
              ASSERT_EQ(y[k], y0[k] + rw[static_cast<size_t>(t)] * ex[static_cast<size_t>(r)]) << where << " token " << t << " row " << r;
            }
            sum_tol += err[static_cast<size_t>(r)];
            sum_sq += ref[static_cast<size_t>(r)] * ref[static_cast<size_t>(r)];
          }
        }
        // The bound must be able to fail: on average well below the size of the values it guards.
        const double count = static_cast<double>(n_tok * kHidden), rms = std::sqrt(sum_sq / count), mean_tol = sum_tol / count;
        EXPECT_LT(mean_tol, 0.25 * rms) << where;
        if (isa == test::available_tiers().back()) std::printf("%s: mean bound %.3g, rms %.3g\n", where.c_str(), mean_tol, rms);
      }
    }
  }
}

model::Matrix as_matrix(const Mat& m) {
  model::Matrix mm;
  mm.type = m.type;
  mm.n_cols = m.cols;
  mm.n_rows = m.rows;
  mm.row_bytes = m.rb;
  mm.data = m.q.data();
  return mm;
}

// The worker's call against the function it replaces, reference::swiglu_expert, on every tier.
TEST(MoeFfn, RunExpertEqualsReferenceSwigluExpert) {
  cpu::ThreadPool pool(cpu::allowed_cpus());
  reference::ThreadPool ref_pool(2, 0);
  reference::ExpertScratch scratch;
  scratch.reserve(72, kFfn);
  cpu::MoeFfn ffn;
  ffn.reserve(72, kHidden, kFfn);
  int bitwise = 0;
  for (const FormatPair& fp : kPairs) {
    const Expert e = make_expert(fp.gate_up, fp.down, 31 * static_cast<uint32_t>(fp.gate_up) + static_cast<uint32_t>(fp.down));
    for (int m : {1, 2, 5, 16, 72}) {
      std::vector<float> x(static_cast<size_t>(m * kHidden));
      for (int t = 0; t < m; ++t) {
        const std::vector<float> r = test::random_row(test::kAllDists[t % 3], kHidden, 7000 + static_cast<uint32_t>(t));
        std::copy(r.begin(), r.end(), x.begin() + t * kHidden);
      }
      // Token 0: every 32-block has amax 127 and its other values on exact ties k + 0.5, where
      // the x86 rule (ties to even) and ggml's reference rule (ties away) pick different q8_0
      // codes: an expert path quantizing with the reference rule fails the bound below.
      std::mt19937 tie_rng(4242u + static_cast<uint32_t>(m));
      for (int64_t i = 0; i < kHidden; ++i) {
        const float v = i % 32 == 0 ? 127.0f : static_cast<float>(tie_rng() % 40) + 0.5f;
        x[static_cast<size_t>(i)] = (tie_rng() & 1) ? -v : v;
      }
      std::vector<float> want(x.size(), NAN);
      reference::swiglu_expert(as_matrix(e.gate), as_matrix(e.up), as_matrix(e.down), x.data(), m, want.data(), scratch, ref_pool);
      for (cpu::CpuIsa isa : test::available_tiers()) {
        cpu::CpuKernelTuning tu;
        tu.matvec.max_isa = isa;
        ffn.set_tuning(tu);
        std::vector<float> y(x.size(), NAN);  // overwritten, not accumulated
        ffn.run_expert(e.w, x.data(), m, y.data(), pool);
        const std::string where = std::string(type_name(fp.gate_up)) + "/" + std::string(type_name(fp.down)) + " " +
                                  std::string(cpu::isa_name(isa)) + " m " + std::to_string(m);
        if (kquant(fp.gate_up) && kquant(fp.down)) {
          for (size_t k = 0; k < y.size(); ++k) ASSERT_EQ(y[k], want[k]) << where << " element " << k;
          ++bitwise;
          continue;
        }
        for (int t = 0; t < m; ++t) {
          std::vector<double> ref, err;
          float_reference(e, x.data() + t * kHidden, ref, err);
          for (int64_t r = 0; r < kHidden; ++r) {
            const size_t k = static_cast<size_t>(t * kHidden + r);
            ASSERT_NEAR(y[k], ref[static_cast<size_t>(r)], err[static_cast<size_t>(r)]) << where << " token " << t << " row " << r;
            ASSERT_NEAR(want[k], ref[static_cast<size_t>(r)], err[static_cast<size_t>(r)]) << where << " (reference) token " << t << " row " << r;
          }
        }
      }
    }
  }
  EXPECT_GT(bitwise, 0);
}

// A layer of experts with overlapping token subsets equals the experts applied one by one, and
// does not depend on the number of threads or the caller joining the pool as the worker does
// (bitwise: fixed summation order).
TEST(MoeFfn, LayerEqualsSumOfExpertsForAnyPoolSize) {
  const std::vector<int> cpus = cpu::allowed_cpus();
  cpu::ThreadPool big(cpus), one(std::vector<int>{cpus.front()});
  cpu::ThreadPool joined(cpus, {cpu::kDecodeSpinUs, true});
  std::vector<Expert> experts;
  const TensorType types[] = {TensorType::Q4_K, TensorType::Q8_0, TensorType::MXFP4, TensorType::Q6_K};
  for (int i = 0; i < 4; ++i) experts.push_back(make_expert(types[i], types[(i + 1) % 4], 3000 + 77 * static_cast<uint32_t>(i)));
  constexpr int kTokens = 9;
  std::vector<float> x(kTokens * kHidden);
  for (int t = 0; t < kTokens; ++t) {
    const std::vector<float> r = test::random_row(test::Dist::Gaussian, kHidden, 40 + static_cast<uint32_t>(t));
    std::copy(r.begin(), r.end(), x.begin() + t * kHidden);
  }
  // Expert i takes tokens t with (t + i) % 3 != 0, out of order; expert 3 takes none.
  std::vector<std::vector<int32_t>> toks(4);
  std::vector<std::vector<float>> rws(4);
  for (int i = 0; i < 3; ++i) {
    for (int t = kTokens - 1; t >= 0; --t) {
      if ((t + i) % 3 != 0) {
        toks[static_cast<size_t>(i)].push_back(t);
        rws[static_cast<size_t>(i)].push_back(0.2f + 0.1f * static_cast<float>(i) + 0.01f * static_cast<float>(t));
      }
    }
  }
  std::vector<cpu::ExpertAssignment> assign;
  for (int i = 0; i < 4; ++i) {
    assign.push_back({&experts[static_cast<size_t>(i)].w, toks[static_cast<size_t>(i)].data(), rws[static_cast<size_t>(i)].data(),
                      static_cast<int>(toks[static_cast<size_t>(i)].size())});
  }
  cpu::MoeFfn ffn;
  std::vector<float> y_big(x.size(), 0.0f), y_one(x.size(), 0.0f), y_seq(x.size(), 0.0f), y_joined(x.size(), 0.0f);
  ffn.run(assign, x.data(), y_big.data(), kTokens, kHidden, big);
  ffn.run(assign, x.data(), y_one.data(), kTokens, kHidden, one);
  EXPECT_EQ(y_big, y_one) << "the result depends on the thread count";
  ffn.run(assign, x.data(), y_joined.data(), kTokens, kHidden, joined);
  EXPECT_EQ(y_big, y_joined) << "the result depends on the caller joining the pool";
  // Expert by expert, each token on its own: same per-element sums in the same expert order.
  for (int i = 0; i < 4; ++i) {
    for (size_t k = 0; k < toks[static_cast<size_t>(i)].size(); ++k) {
      const int t = toks[static_cast<size_t>(i)][k];
      cpu::expert_ffn(experts[static_cast<size_t>(i)].w, x.data() + t * kHidden, 1, &rws[static_cast<size_t>(i)][k], y_seq.data() + t * kHidden, one);
    }
  }
  EXPECT_EQ(y_big, y_seq);
  double norm = 0;
  for (float v : y_big) norm += std::fabs(v);
  EXPECT_GT(norm, 1.0) << "the layer must produce something";
}

// A layer's experts in one call, each with its own rows and output, equal the experts run one
// by one (bitwise), with different types and row counts (one expert without rows).
TEST(MoeFfn, RunExpertsEqualsRunExpertPerExpert) {
  cpu::ThreadPool pool(cpu::allowed_cpus());
  const TensorType types[] = {TensorType::Q4_K, TensorType::Q8_0, TensorType::MXFP4, TensorType::Q6_K};
  std::vector<Expert> experts;
  for (int i = 0; i < 4; ++i) experts.push_back(make_expert(types[i], types[(i + 2) % 4], 6100 + 13 * static_cast<uint32_t>(i)));
  const int ms[] = {3, 1, 0, 6};
  std::vector<std::vector<float>> xs(4), ys(4), want(4);
  std::vector<cpu::MoeFfn::ExpertJob> jobs;
  cpu::MoeFfn single;
  for (int i = 0; i < 4; ++i) {
    const size_t n = static_cast<size_t>(ms[i] * kHidden);
    xs[static_cast<size_t>(i)].resize(n);
    for (int t = 0; t < ms[i]; ++t) {
      const std::vector<float> r = test::random_row(test::kAllDists[(t + i) % 3], kHidden, 300 + 10 * static_cast<uint32_t>(i) + static_cast<uint32_t>(t));
      std::copy(r.begin(), r.end(), xs[static_cast<size_t>(i)].begin() + t * kHidden);
    }
    ys[static_cast<size_t>(i)].assign(n, NAN);
    want[static_cast<size_t>(i)].assign(n, NAN);
    single.run_expert(experts[static_cast<size_t>(i)].w, xs[static_cast<size_t>(i)].data(), ms[i], want[static_cast<size_t>(i)].data(), pool);
    jobs.push_back({&experts[static_cast<size_t>(i)].w, xs[static_cast<size_t>(i)].data(), ms[i], ys[static_cast<size_t>(i)].data()});
  }
  cpu::MoeFfn layer;
  layer.run_experts(jobs, pool);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(ys[static_cast<size_t>(i)], want[static_cast<size_t>(i)]) << "expert " << i;
  double norm = 0;
  for (float v : ys[0]) norm += std::fabs(v);
  EXPECT_GT(norm, 1.0);
  const cpu::MoeFfn::ExpertJob bad{nullptr, xs[0].data(), 3, ys[0].data()};
  EXPECT_THROW(layer.run_experts(std::span(&bad, 1), pool), std::invalid_argument);
}

// The worker's form: rows named by index in one activation block (repeated across experts, out
// of order, one row no expert reads, one expert without rows) equal the ExpertJob form on the
// same rows gathered, bitwise, on a pool of any size; bad row indices are refused.
TEST(MoeFfn, RunExpertsOnRowIndicesEqualsGatheredRows) {
  const std::vector<int> cpus = cpu::allowed_cpus();
  cpu::ThreadPool big(cpus), one(std::vector<int>{cpus.front()});
  const TensorType types[] = {TensorType::Q5_K, TensorType::Q8_0, TensorType::MXFP4, TensorType::Q3_K, TensorType::Q4_K};
  std::vector<Expert> experts;
  for (int i = 0; i < 5; ++i) experts.push_back(make_expert(types[i], types[(i + 1) % 5], 7100 + 31 * static_cast<uint32_t>(i)));
  constexpr int kRows = 7;
  std::vector<float> x(kRows * kHidden);
  for (int t = 0; t < kRows; ++t) {
    const std::vector<float> r = test::random_row(test::kAllDists[t % 3], kHidden, 500 + static_cast<uint32_t>(t));
    std::copy(r.begin(), r.end(), x.begin() + t * kHidden);
  }
  // Row 4 is read by no expert; expert 2 has no rows.
  const std::vector<std::vector<int32_t>> rows = {{6, 0, 3}, {1}, {}, {3, 5, 2, 0, 6, 1}, {2, 5}};
  std::vector<std::vector<float>> gathered(5), want(5), got_big(5), got_one(5);
  std::vector<cpu::MoeFfn::ExpertJob> gather_jobs;
  std::vector<cpu::MoeFfn::RowsJob> big_jobs, one_jobs;
  for (size_t i = 0; i < 5; ++i) {
    const int m = static_cast<int>(rows[i].size());
    const size_t n = static_cast<size_t>(m) * kHidden;
    gathered[i].resize(n);
    for (int j = 0; j < m; ++j) std::copy_n(x.begin() + rows[i][static_cast<size_t>(j)] * kHidden, kHidden, gathered[i].begin() + j * kHidden);
    want[i].assign(n, NAN);
    got_big[i].assign(n, NAN);
    got_one[i].assign(n, NAN);
    gather_jobs.push_back({&experts[i].w, gathered[i].data(), m, want[i].data()});
    big_jobs.push_back({&experts[i].w, rows[i].data(), m, got_big[i].data()});
    one_jobs.push_back({&experts[i].w, rows[i].data(), m, got_one[i].data()});
  }
  cpu::MoeFfn a, b;
  a.run_experts(gather_jobs, one);
  b.run_experts(big_jobs, x.data(), kRows, big);
  b.run_experts(one_jobs, x.data(), kRows, one);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(got_big[i], want[i]) << "expert " << i;
    EXPECT_EQ(got_one[i], want[i]) << "expert " << i << " on one thread";
  }
  double norm = 0;
  for (float v : got_big[3]) norm += std::fabs(v);
  EXPECT_GT(norm, 1.0);
  const int32_t outside[] = {0, kRows};
  std::vector<float> y(2 * kHidden);
  const cpu::MoeFfn::RowsJob bad{&experts[0].w, outside, 2, y.data()};
  EXPECT_THROW(b.run_experts(std::span(&bad, 1), x.data(), kRows, big), std::invalid_argument);
  const cpu::MoeFfn::RowsJob no_rows{&experts[0].w, nullptr, 2, y.data()};
  EXPECT_THROW(b.run_experts(std::span(&no_rows, 1), x.data(), kRows, big), std::invalid_argument);
}

// gpt-oss's experts: per-expert biases on gate, up and down and the clamped SwiGLU, through the
// cpu worker's call (rows in place, several experts in one job list), equal reference::
// biased_expert bitwise for the k-quants, with and without the clamp; the clamp and each bias
// change the result (a mutation check: the test would see them missing).
TEST(MoeFfn, BiasedClampedExpertsEqualReferenceBiasedExpert) {
  const std::vector<int> cpus = cpu::allowed_cpus();
  cpu::ThreadPool pool(cpus);
  reference::ThreadPool ref_pool(2, 0);
  reference::ExpertScratch scratch;
  scratch.reserve(16, kFfn);
  constexpr int kRows = 9;
  std::vector<float> x(kRows * kHidden);
  for (int t = 0; t < kRows; ++t) {
    std::vector<float> r = test::random_row(test::kAllDists[t % 3], kHidden, 900 + static_cast<uint32_t>(t));
    for (float& v : r) v *= 4.0f;   // gate/up values past the clamp's limit of 7
    std::copy(r.begin(), r.end(), x.begin() + t * kHidden);
  }
  const FormatPair pairs[] = {{TensorType::Q4_K, TensorType::Q4_K}, {TensorType::Q5_K, TensorType::Q6_K}, {TensorType::Q3_K, TensorType::Q2_K}};
  int clamped_values = 0;
  for (const FormatPair& fp : pairs) {
    const Expert e = make_expert(fp.gate_up, fp.down, 8100 + static_cast<uint32_t>(fp.gate_up));
    model::MoeWeights W;
    std::mt19937 rng(77 + static_cast<uint32_t>(fp.down));
    std::normal_distribution<float> nd(0.0f, 2.0f);
    W.gate_bias.resize(kFfn);
    W.up_bias.resize(kFfn);
    W.down_bias.resize(kHidden);
    for (float& b : W.gate_bias) b = nd(rng);
    for (float& b : W.up_bias) b = nd(rng);
    for (float& b : W.down_bias) b = nd(rng);
    const std::array<model::Matrix, 3> mats = {as_matrix(e.gate), as_matrix(e.up), as_matrix(e.down)};
    const std::vector<int32_t> rows = {4, 0, 8, 2, 7};
    const int m = static_cast<int>(rows.size());
    std::vector<float> xg(static_cast<size_t>(m) * kHidden);
    for (int j = 0; j < m; ++j) std::copy_n(x.begin() + rows[static_cast<size_t>(j)] * kHidden, kHidden, xg.begin() + j * kHidden);
    std::vector<float> unlimited;
    // 0: biased SwiGLU; 1: gpt-oss's activation without a reachable limit; 2: with its limit 7.
    for (const int variant : {0, 1, 2}) {
      const bool clamp = variant > 0;
      model::ExpertsPart part;
      part.biases = true;
      part.act = clamp ? model::Activation::SwiGluClamped : model::Activation::SwiGlu;
      if (variant == 1) part.swiglu_limit = 1e30;
      std::vector<float> want(xg.size(), NAN), got(xg.size(), NAN), plain(xg.size(), NAN);
      reference::biased_expert(mats, W, 0, part, xg.data(), m, want.data(), scratch, ref_pool);
      cpu::ExpertWeights w = e.w;
      w.gate_bias = W.gate_bias.data();
      w.up_bias = W.up_bias.data();
      w.down_bias = W.down_bias.data();
      w.clamped_swiglu = clamp;
      w.swiglu_limit = static_cast<float>(part.swiglu_limit);
      // A second expert without biases in the same job list keeps its plain SwiGLU.
      const std::vector<int32_t> rows2 = {1, 3};
      std::vector<float> y2(2 * kHidden, NAN), y2_alone(2 * kHidden, NAN);
      const cpu::MoeFfn::RowsJob jobs[] = {{&w, rows.data(), m, got.data()}, {&e.w, rows2.data(), 2, y2.data()}};
      cpu::MoeFfn ffn;
      ffn.run_experts(jobs, x.data(), kRows, pool);
      const cpu::MoeFfn::RowsJob plain_jobs[] = {{&e.w, rows.data(), m, plain.data()}, {&e.w, rows2.data(), 2, y2_alone.data()}};
      cpu::MoeFfn().run_experts(plain_jobs, x.data(), kRows, pool);
      const std::string where = std::string(type_name(fp.gate_up)) + "/" + std::string(type_name(fp.down)) + " variant " +
                                std::to_string(variant);
      for (size_t k = 0; k < got.size(); ++k) ASSERT_EQ(got[k], want[k]) << where << " element " << k;
      EXPECT_EQ(y2, y2_alone) << where << ": the unbiased expert beside it";
      size_t moved = 0;
      for (size_t k = 0; k < got.size(); ++k) moved += std::fabs(got[k] - plain[k]) > 1e-3f * (1.0f + std::fabs(plain[k]));
      EXPECT_GT(moved, got.size() / 2) << where << ": the biases change most outputs";
      if (variant == 1) unlimited = got;
      if (variant == 2) {
        size_t differ = 0;
        for (size_t k = 0; k < got.size(); ++k) differ += got[k] != unlimited[k];
        EXPECT_GT(differ, got.size() / 2) << where << ": the clamp changes the outputs";
        clamped_values += static_cast<int>(differ);
      }
    }
  }
  EXPECT_GT(clamped_values, 0);
}

// The prefetch distances move lines into caches earlier; they must not change a single bit of
// the result, for an expert of its own and for a layer accumulating two experts into shared
// token rows (the down chunks' reduction).
TEST(MoeFfn, ResultDoesNotDependOnPrefetch) {
  cpu::ThreadPool pool(cpu::allowed_cpus());
  const Expert e = make_expert(TensorType::Q4_K, TensorType::Q6_K, 555);
  constexpr int kTok = 5;
  std::vector<float> x(kTok * kHidden);
  for (int t = 0; t < kTok; ++t) {
    const std::vector<float> r = test::random_row(test::Dist::Gaussian, kHidden, 90 + static_cast<uint32_t>(t));
    std::copy(r.begin(), r.end(), x.begin() + t * kHidden);
  }
  cpu::MoeFfn ffn;
  std::vector<float> want(x.size());
  ffn.run_expert(e.w, x.data(), kTok, want.data(), pool);
  const Expert e2 = make_expert(TensorType::Q6_K, TensorType::Q5_K, 556);
  const int32_t toks_a[] = {4, 0, 2, 1}, toks_b[] = {1, 3, 4};
  const float rw_a[] = {0.5f, 0.25f, 0.75f, 0.125f}, rw_b[] = {0.3f, 0.6f, 0.9f};
  const cpu::ExpertAssignment layer[] = {{&e.w, toks_a, rw_a, 4}, {&e2.w, toks_b, rw_b, 3}};
  std::vector<float> want_layer(x.size(), 0.5f);
  ffn.run(layer, x.data(), want_layer.data(), kTok, kHidden, pool);
  const cpu::MatvecPrefetch pf_variants[] = {{0, 0}, {64, 128}, {1 << 16, 1 << 16}, {4096, 2048}};
  for (const cpu::MatvecPrefetch& pf : pf_variants) {
    cpu::CpuKernelTuning tu;
    tu.matvec.prefetch = pf;
    ffn.set_tuning(tu);
    std::vector<float> y(x.size(), NAN);
    ffn.run_expert(e.w, x.data(), kTok, y.data(), pool);
    EXPECT_EQ(y, want) << "prefetch " << pf.l1_bytes << "/" << pf.spread_l1_bytes;
    std::vector<float> y_layer(x.size(), 0.5f);
    ffn.run(layer, x.data(), y_layer.data(), kTok, kHidden, pool);
    EXPECT_EQ(y_layer, want_layer) << "layer, prefetch " << pf.l1_bytes << "/" << pf.spread_l1_bytes;
  }
}

// The slices (each thread's share of a phase, cut at multiples of 4 rows wherever the thread
// count puts them, mid-expert included, into several jobs that idle threads take from the back;
// end to end or per expert) change which thread computes a row, never a bit of it: Q8_0 / MXFP4
// tiles start at multiples of 4 rows either way. 1 to 3 experts of 1 and 3 rows, as the worker
// gets them at a 12 GB budget, against one thread with one job per expert and phase, on a pool
// the caller joins (its slice then starts with the activation rows' quantization, which the
// other slices wait for) and one it does not.
TEST(MoeFfn, SlicesKeepResultsBitwise) {
  cpu::ThreadPool one(std::vector<int>{cpu::allowed_cpus().front()});
  cpu::ThreadPool waits(cpu::allowed_cpus()), joined(cpu::allowed_cpus(), {cpu::kDecodeSpinUs, true});
  const TensorType types[] = {TensorType::Q8_0, TensorType::MXFP4, TensorType::Q4_K};
  std::vector<Expert> experts;
  for (int i = 0; i < 3; ++i) experts.push_back(make_expert(types[i], types[(i + 1) % 3], 8100 + 17 * static_cast<uint32_t>(i)));
  constexpr int kRows = 3;
  std::vector<float> x(kRows * kHidden);
  for (int t = 0; t < kRows; ++t) {
    const std::vector<float> r = test::random_row(test::kAllDists[t % 3], kHidden, 700 + static_cast<uint32_t>(t));
    std::copy(r.begin(), r.end(), x.begin() + t * kHidden);
  }
  const int32_t one_row[] = {1}, three_rows[] = {2, 0, 1};
  auto run_with = [&](cpu::ThreadPool& pool, cpu::FfnSlices o, int n_exp, int m) {
    std::vector<std::vector<float>> ys(static_cast<size_t>(n_exp), std::vector<float>(static_cast<size_t>(m * kHidden), NAN));
    std::vector<cpu::MoeFfn::RowsJob> jobs;
    for (int i = 0; i < n_exp; ++i) jobs.push_back({&experts[static_cast<size_t>(i)].w, m == 1 ? one_row : three_rows, m, ys[static_cast<size_t>(i)].data()});
    cpu::CpuKernelTuning tu;
    tu.slices = o;
    cpu::MoeFfn ffn(tu);
    ffn.run_experts(jobs, x.data(), kRows, pool);
    return ys;
  };
  const cpu::FfnSlices variants[] = {{1, false}, {3, false}, {4, false}, {8, false}, {1, true}, {4, true}, {8, true}};
  for (int n_exp = 1; n_exp <= 3; ++n_exp) {
    for (int m : {1, 3}) {
      const auto want = run_with(one, {1, false}, n_exp, m);
      double norm = 0;
      for (float v : want.back()) norm += std::fabs(v);
      EXPECT_GT(norm, 1.0);
      for (cpu::ThreadPool* pool : {&waits, &joined}) {
        for (const cpu::FfnSlices& o : variants) {
          EXPECT_EQ(run_with(*pool, o, n_exp, m), want) << n_exp << " experts, " << m << " rows, split " << o.split << ", per expert " << o.per_expert
                                                         << ", caller joins " << pool->caller_joins();
        }
      }
    }
  }
}

// run()'s accumulating experts, whose down spans start and end wherever the thread shares fall
// (several sum chunks per span, or part of one): every bit of y_accum is the experts' one by one
// (each element's partials are added in expert order by whichever span finishes its chunk last).
// Overlapping token subsets (an expert with none among them), 1, 9 and 40 tokens, several jobs
// per thread and phase or one, end to end or per expert, caller joining or not, and the same list
// reused.
TEST(MoeFfn, AccumulatingKeepsResultsBitwise) {
  cpu::ThreadPool one(std::vector<int>{cpu::allowed_cpus().front()});
  cpu::ThreadPool waits(cpu::allowed_cpus()), joined(cpu::allowed_cpus(), {cpu::kDecodeSpinUs, true});
  const TensorType types[] = {TensorType::Q4_K, TensorType::Q8_0, TensorType::MXFP4, TensorType::Q6_K};
  std::vector<Expert> experts;
  for (int i = 0; i < 4; ++i) experts.push_back(make_expert(types[i], types[(i + 2) % 4], 9100 + 31 * static_cast<uint32_t>(i)));
  for (int n_tok : {1, 9, 40}) {  // 40: the AMX path on CPUs with AMX (cpu::kPrefillTokens)
    std::vector<float> x(static_cast<size_t>(n_tok) * kHidden);
    for (int t = 0; t < n_tok; ++t) {
      const std::vector<float> r = test::random_row(test::kAllDists[t % 3], kHidden, 1300 + static_cast<uint32_t>(t));
      std::copy(r.begin(), r.end(), x.begin() + t * kHidden);
    }
    // Expert i takes tokens t with (t + i) % 3 != 0 (at 1 token: all but expert 0), out of order; expert 3 none.
    std::vector<std::vector<int32_t>> toks(4);
    std::vector<std::vector<float>> rws(4);
    for (int i = 0; i < 3; ++i) {
      for (int t = n_tok - 1; t >= 0; --t) {
        if (n_tok > 1 ? (t + i) % 3 != 0 : i > 0) {
          toks[static_cast<size_t>(i)].push_back(t);
          rws[static_cast<size_t>(i)].push_back(0.3f + 0.1f * static_cast<float>(i) + 0.01f * static_cast<float>(t));
        }
      }
    }
    std::vector<cpu::ExpertAssignment> assign;
    for (int i = 0; i < 4; ++i) {
      assign.push_back({&experts[static_cast<size_t>(i)].w, toks[static_cast<size_t>(i)].data(), rws[static_cast<size_t>(i)].data(),
                        static_cast<int>(toks[static_cast<size_t>(i)].size())});
    }
    // The experts one by one, in list order, on one thread.
    std::vector<float> want(x.size(), 0.25f);
    cpu::MoeFfn single;
    for (const cpu::ExpertAssignment& a : assign) single.run(std::span(&a, 1), x.data(), want.data(), n_tok, kHidden, one);
    double moved = 0;
    for (float v : want) moved += std::fabs(v - 0.25f);
    EXPECT_GT(moved, 1.0) << "the layer must add something";
    const cpu::FfnSlices variants[] = {{4, false}, {1, false}, {3, false}, {8, false}, {4, true}, {1, true}};
    for (cpu::ThreadPool* pool : {&waits, &joined, &one}) {
      for (const cpu::FfnSlices& o : variants) {
        cpu::CpuKernelTuning tu;
        tu.slices = o;
        cpu::MoeFfn ffn(tu);
        for (int round = 0; round < 2; ++round) {  // the second call reuses the list and its chunk counts
          std::vector<float> y(x.size(), 0.25f);
          ffn.run(assign, x.data(), y.data(), n_tok, kHidden, *pool);
          EXPECT_EQ(y, want) << n_tok << " tokens, split " << o.split << ", per expert " << o.per_expert << ", round " << round
                             << ", caller joins " << pool->caller_joins() << ", threads " << pool->size();
        }
      }
    }
  }
}

// prefetch_experts (the worker's idle-time prefetch of a layer's previous experts) computes and
// writes nothing: the calls after it are bitwise those without it, with the caller joining the
// pool or not, whether it ran to the end or its stop callback ended it at once (and the callback
// is polled, and the call says it was cut short); experts of another hidden size are refused with a message naming the expert.
TEST(MoeFfn, PrefetchExpertsChangesNoResult) {
  cpu::ThreadPool waits(cpu::allowed_cpus()), joined(cpu::allowed_cpus(), {cpu::kDecodeSpinUs, true});
  std::vector<Expert> experts;
  experts.push_back(make_expert(TensorType::Q4_K, TensorType::Q6_K, 9500));
  experts.push_back(make_expert(TensorType::Q8_0, TensorType::MXFP4, 9600));
  constexpr int kRows = 2;
  std::vector<float> x(kRows * kHidden);
  for (int t = 0; t < kRows; ++t) {
    const std::vector<float> r = test::random_row(test::kAllDists[t % 3], kHidden, 950 + static_cast<uint32_t>(t));
    std::copy(r.begin(), r.end(), x.begin() + t * kHidden);
  }
  const int32_t rows[] = {1, 0};
  auto call = [&](cpu::MoeFfn& ffn, cpu::ThreadPool& pool) {
    std::vector<std::vector<float>> ys(experts.size(), std::vector<float>(static_cast<size_t>(kRows * kHidden), NAN));
    std::vector<cpu::MoeFfn::RowsJob> jobs;
    for (size_t i = 0; i < experts.size(); ++i) jobs.push_back({&experts[i].w, rows, kRows, ys[i].data()});
    ffn.run_experts(jobs, x.data(), kRows, pool);
    return ys;
  };
  cpu::MoeFfn plain;
  const auto want = call(plain, waits);
  const std::vector<const cpu::ExpertWeights*> ws{&experts[0].w, &experts[1].w};
  int polls = 0;
  for (cpu::ThreadPool* pool : {&waits, &joined}) {
    for (int stop_at_once = 0; stop_at_once < 2; ++stop_at_once) {
      cpu::MoeFfn ffn;
      for (int round = 0; round < 2; ++round) {
        polls = 0;
        if (stop_at_once) {
          EXPECT_FALSE(ffn.prefetch_experts(ws, kRows, *pool, [](const void* c) { ++*static_cast<int*>(const_cast<void*>(c)); return true; }, &polls))
              << "a prefetch stopped at once said it pulled every row";
          EXPECT_GT(polls, 0) << "the stop callback was never polled";
        } else {
          EXPECT_TRUE(ffn.prefetch_experts(ws, kRows, *pool)) << "a prefetch without a stop said it was cut short";
        }
        EXPECT_EQ(call(ffn, *pool), want) << "after a prefetch, stop at once " << stop_at_once << ", round " << round << ", caller joins "
                                          << pool->caller_joins();
      }
    }
  }
  Expert other = make_expert(TensorType::Q4_K, TensorType::Q4_K, 9700);
  other.w.hidden = kHidden / 2;
  const std::vector<const cpu::ExpertWeights*> bad{&experts[0].w, &other.w};
  cpu::MoeFfn ffn;
  try {
    ffn.prefetch_experts(bad, 1, waits);
    ADD_FAILURE() << "an expert of another hidden size was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("expert 1"), std::string::npos) << e.what();
  }
}

TEST(MoeFfn, RejectsBadShapesAndTokens) {
  cpu::ThreadPool pool(std::vector<int>{cpu::allowed_cpus().front()});
  Expert e = make_expert(TensorType::Q4_K, TensorType::Q4_K, 1);
  std::vector<float> x(2 * kHidden), y(2 * kHidden);
  const int32_t bad_tok[] = {0, 5};
  const float rw[] = {1.0f, 1.0f};
  cpu::MoeFfn ffn;
  const cpu::ExpertAssignment out_of_range{&e.w, bad_tok, rw, 2};
  EXPECT_THROW(ffn.run(std::span(&out_of_range, 1), x.data(), y.data(), 2, kHidden, pool), std::invalid_argument);
  const cpu::ExpertAssignment ok{&e.w, bad_tok, rw, 1};
  EXPECT_THROW(ffn.run(std::span(&ok, 1), x.data(), y.data(), 2, kHidden + 256, pool), std::invalid_argument);
  cpu::ExpertWeights odd = e.w;
  odd.ffn = 100;  // not a multiple of Q4_K's 256
  const cpu::ExpertAssignment bad_dims{&odd, bad_tok, rw, 1};
  EXPECT_THROW(ffn.run(std::span(&bad_dims, 1), x.data(), y.data(), 2, kHidden, pool), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
