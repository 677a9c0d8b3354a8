// Gated DeltaNet kernels (kernels/cuda/delta_net.cu) against the scalar reference's ops
// (common/reference/ops.h: conv1d_silu_step, l2_norm, sigmoid, softplus, delta_rule_step,
// rms_norm, silu) composed as ReferenceExecutor::delta_net_block composes them, on fresh random
// inputs with every output NaN-poisoned before the call; in qwen3next's layout and in qwen35moe's
// (qwen35: value head j reads key head j % n_k, b and alpha in value-head order), always with
// n_v > n_k there so the tiled and grouped heads differ.
//
// Tolerances are derived, with u = 2^-24 (the unit roundoff; an ulp is at most 2u relative):
//  - conv: the taps are added in the reference's order with the same roundings, so only SiLU's
//    expf differs (CUDA 2 ulp, glibc 1 ulp), then 1 + e and the division: at most 5 ulp = 10u.
//    The state is copied, so it must match bit for bit.
//  - L2 norm: a sum of d_k squares in two orders differs by at most 2(d_k - 1)u relative;
//    1/sqrt halves that and adds 2 roundings per side; the two multiplies add 2 per side:
//    (d_k + 8)u relative.
//  - gates: expf (3 ulp both sides), 1 + e, the division; softplus' log1p passes the relative
//    error of e through with a factor e / ((1 + e) log1p(e)) <= 1 and adds 1 ulp per side, then
//    a * sp one rounding per side: within 8 ulp = 16u.
//  - gated RMSNorm: the rms_norm test's 8u (sums of squares in double) plus SiLU's 10u plus the
//    last multiply's rounding on both sides: 22u.
//  - recurrence: a running error bound. The same recurrence is run in double on absolute values
//    (M = state magnitudes: M <- e^g M + |k| beta (|v| + |k|^T e^g M)); each step's roundings
//    are at most (d_k + 8)u of the magnitudes they touch per side, and the map carries earlier
//    errors no further than it carries M, so after t steps |S_gpu - S_ref| <= 2 c_t u M with
//    c_t = t (d_k + 8), and an output (a d_k-term dot product more) within 2 (c_t + d_k + 2) u O
//    with O = |q|^T M. Whole-mixer tests add the stages' input differences to c per step.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "common/reference/ops.h"
#include "kernels/cuda/delta_net.h"
#include "kernels/cuda/device_buffer.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

using cuda::DeltaNetShape;
using cuda::DeviceBuffer;

constexpr double kU = 0x1p-24;

DeltaNetShape shape_of(int64_t nk, int64_t nv, int64_t dk, int64_t dv, int64_t kernel) {
  DeltaNetShape s;
  s.n_k_heads = nk;
  s.n_v_heads = nv;
  s.head_k_dim = dk;
  s.head_v_dim = dv;
  s.conv_kernel = kernel;
  return s;
}

// The same shape in qwen35moe's layout: tiled value heads, split beta / alpha.
DeltaNetShape qwen35(DeltaNetShape s) {
  s.v_heads_tiled = s.split_ba = true;
  return s;
}

std::string name(const DeltaNetShape& s) {
  return "nk=" + std::to_string(s.n_k_heads) + " nv=" + std::to_string(s.n_v_heads) + " dk=" +
         std::to_string(s.head_k_dim) + " dv=" + std::to_string(s.head_v_dim) + " K=" + std::to_string(s.conv_kernel) +
         (s.v_heads_tiled ? " tiled" : "") + (s.split_ba ? " split_ba" : "");
}

// The key head value head hv reads, as delta_net_block picks it.
int64_t key_head(const DeltaNetShape& s, int64_t hv) {
  return s.v_heads_tiled ? hv % s.n_k_heads : hv / (s.n_v_heads / s.n_k_heads);
}

// Value head hv's b and alpha in a token's ba row: split_ba, ssm_beta's rows then ssm_alpha's
// (the backend stacks them); else grouped per key head g as [b of its r heads | alpha of them].
float b_of(const DeltaNetShape& s, const float* row, int64_t hv) {
  const int64_t r = s.n_v_heads / s.n_k_heads;
  return s.split_ba ? row[hv] : row[hv / r * 2 * r + hv % r];
}
float alpha_of(const DeltaNetShape& s, const float* row, int64_t hv) {
  const int64_t r = s.n_v_heads / s.n_k_heads;
  return s.split_ba ? row[s.n_v_heads + hv] : row[hv / r * 2 * r + r + hv % r];
}

std::vector<float> normal(std::mt19937& rng, size_t n, float mean, float sd) {
  std::normal_distribution<float> d(mean, sd);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

DeviceBuffer<float> upload(const std::vector<float>& v) {
  DeviceBuffer<float> d(v.size());
  d.upload(v.data(), v.size());
  return d;
}

DeviceBuffer<float> poisoned(size_t n) {
  DeviceBuffer<float> d(n);
  d.fill_bytes(0xff);
  return d;
}

std::vector<float> download(const DeviceBuffer<float>& d, size_t n) {
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> v(n);
  d.download(v.data(), n);
  return v;
}

// |got - want| <= rel * |want| + FLT_MIN per element; stops at the first failure.
void expect_close_rel(const std::vector<float>& got, const std::vector<float>& want, double rel, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = rel * std::fabs(static_cast<double>(want[i])) + FLT_MIN;
    ASSERT_TRUE(std::fabs(static_cast<double>(got[i]) - want[i]) <= tol)
        << what << " element " << i << ": got " << got[i] << ", reference " << want[i] << " (tolerance " << tol << ")";
  }
}

void expect_bitwise(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(float)), 0)
        << what << " element " << i << ": got " << got[i] << ", want " << want[i];
}

// ------------------------------------------------------------------ conv

void check_conv(const DeltaNetShape& s, const std::vector<int64_t>& calls, uint32_t seed) {
  SCOPED_TRACE(name(s));
  std::mt19937 rng(seed);
  const int64_t C = s.conv_dim();
  const auto w = normal(rng, static_cast<size_t>(C * s.conv_kernel), 0.0f, 0.5f);
  std::vector<float> state = normal(rng, static_cast<size_t>(std::max<int64_t>(1, s.conv_state_floats())), 0.0f, 1.0f);
  DeviceBuffer<float> dw = upload(w), dstate = upload(state);
  for (int64_t n : calls) {
    const auto mixed = cuda_test::random_values(rng, static_cast<size_t>(n * C));
    DeviceBuffer<float> dmixed = upload(mixed), dout = poisoned(static_cast<size_t>(n * C));
    cuda::delta_net_conv_silu(s, dw.get(), s.conv_kernel > 1 ? dstate.get() : nullptr, dmixed.get(), dout.get(), n);
    std::vector<float> want(static_cast<size_t>(n * C));
    for (int64_t t = 0; t < n; ++t)
      reference::conv1d_silu_step(w.data(), s.conv_kernel, C, state.data(), mixed.data() + t * C, want.data() + t * C);
    expect_close_rel(download(dout, want.size()), want, 10 * kU, "conv out, call of n=" + std::to_string(n));
    if (s.conv_kernel > 1)
      expect_bitwise(download(dstate, static_cast<size_t>(s.conv_state_floats())),
                     std::vector<float>(state.begin(), state.begin() + s.conv_state_floats()),
                     "conv state after n=" + std::to_string(n));
  }
}

TEST(CudaDeltaNet, ConvMatchesReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  // Calls of 1 token (decode), more than one 16-token run (state updated by a second kernel),
  // and fewer tokens than the window (the new state keeps old rows).
  const std::vector<int64_t> calls{1, 37, 2, 1, 16, 20, 1};
  check_conv(shape_of(3, 3, 40, 24, 4), calls, 1);
  check_conv(shape_of(3, 6, 64, 72, 2), calls, 2);
  check_conv(shape_of(1, 4, 128, 128, 5), calls, 3);
  check_conv(shape_of(2, 2, 8, 8, 1), calls, 4);  // no history at all
  check_conv(shape_of(1, 1, 16, 16, 16), calls, 5);
}

// ------------------------------------------------------------------ L2 norm

TEST(CudaDeltaNet, L2NormMatchesReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  for (const DeltaNetShape& s : {shape_of(3, 3, 40, 24, 4), shape_of(5, 10, 128, 64, 4), shape_of(2, 8, 1, 8, 4),
                                 shape_of(16, 32, 128, 128, 4)}) {
    SCOPED_TRACE(name(s));
    std::mt19937 rng(static_cast<uint32_t>(s.head_k_dim * 7 + s.n_k_heads));
    const int64_t n = 9, C = s.conv_dim(), dk = s.head_k_dim;
    const float eps = 1e-6f;
    const auto x = cuda_test::random_values(rng, static_cast<size_t>(n * C));
    DeviceBuffer<float> dx = upload(x);
    cuda::delta_net_l2_norm_qk(s, dx.get(), n, eps);
    std::vector<float> want = x;
    const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t h = 0; h < 2 * s.n_k_heads; ++h) {
        float* v = want.data() + t * C + h * dk;
        reference::l2_norm(v, dk, eps);
        if (h < s.n_k_heads)
          for (int64_t i = 0; i < dk; ++i) v[i] = v[i] * scale;  // as delta_rule_step scales q
      }
    }
    const std::vector<float> got = download(dx, x.size());
    expect_close_rel(got, want, static_cast<double>(dk + 8) * kU, "l2 norm");
    // v channels untouched.
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 2 * s.key_dim(); c < C; ++c)
        ASSERT_EQ(std::memcmp(&got[t * C + c], &x[t * C + c], sizeof(float)), 0) << "v channel " << c << " changed";
  }
}

// ------------------------------------------------------------------ gates

TEST(CudaDeltaNet, GatesMatchReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  for (const DeltaNetShape& s : {shape_of(3, 3, 8, 8, 4), shape_of(3, 6, 8, 8, 4), shape_of(5, 20, 8, 8, 4),
                                 shape_of(16, 32, 128, 128, 4), qwen35(shape_of(5, 20, 8, 8, 4)),
                                 qwen35(shape_of(16, 64, 128, 128, 4))}) {
    SCOPED_TRACE(name(s));
    std::mt19937 rng(static_cast<uint32_t>(s.n_v_heads));
    const int64_t n = 23, nv = s.n_v_heads;
    // alpha spread so some alpha + dt_bias pass 20 (softplus' linear branch).
    const auto ba = normal(rng, static_cast<size_t>(n * 2 * nv), 0.0f, 8.0f);
    std::vector<float> a = normal(rng, static_cast<size_t>(nv), 0.0f, 1.0f);
    for (float& v : a) v = -std::exp(v);  // -exp(A_log)
    const auto dt_bias = normal(rng, static_cast<size_t>(nv), 0.0f, 1.0f);
    DeviceBuffer<float> dba = upload(ba), da = upload(a), ddt = upload(dt_bias);
    DeviceBuffer<float> dbeta = poisoned(static_cast<size_t>(n * nv)), dgate = poisoned(static_cast<size_t>(n * nv));
    cuda::delta_net_gates(s, dba.get(), da.get(), ddt.get(), dbeta.get(), dgate.get(), n);
    std::vector<float> beta(static_cast<size_t>(n * nv)), gate(static_cast<size_t>(n * nv));
    for (int64_t t = 0; t < n; ++t)
      for (int64_t hv = 0; hv < nv; ++hv) {
        beta[t * nv + hv] = reference::sigmoid(b_of(s, ba.data() + t * 2 * nv, hv));
        gate[t * nv + hv] = a[hv] * reference::softplus(alpha_of(s, ba.data() + t * 2 * nv, hv) + dt_bias[hv]);
      }
    expect_close_rel(download(dbeta, beta.size()), beta, 16 * kU, "beta");
    expect_close_rel(download(dgate, gate.size()), gate, 16 * kU, "gate");
  }
}

// ------------------------------------------------------------------ gated RMSNorm

TEST(CudaDeltaNet, GatedRmsNormMatchesReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  for (const DeltaNetShape& s : {shape_of(3, 3, 8, 24, 4), shape_of(3, 6, 8, 128, 4), shape_of(1, 5, 8, 256, 4)}) {
    SCOPED_TRACE(name(s));
    std::mt19937 rng(static_cast<uint32_t>(s.head_v_dim));
    const int64_t n = 7, dv = s.head_v_dim, V = s.value_dim();
    const float eps = 1e-6f;
    const auto o = cuda_test::random_values(rng, static_cast<size_t>(n * V));
    const auto z = cuda_test::random_values(rng, static_cast<size_t>(n * V));
    const auto w = cuda_test::random_values(rng, static_cast<size_t>(dv));
    DeviceBuffer<float> dout = upload(o), dz = upload(z), dw = upload(w);
    cuda::delta_net_gated_rms_norm(s, dout.get(), dz.get(), dw.get(), n, eps);
    std::vector<float> want(o.size());
    for (int64_t row = 0; row < n * s.n_v_heads; ++row) {
      reference::rms_norm(o.data() + row * dv, w.data(), dv, eps, want.data() + row * dv);
      for (int64_t j = 0; j < dv; ++j) want[row * dv + j] *= reference::silu(z[row * dv + j]);
    }
    expect_close_rel(download(dout, want.size()), want, 22 * kU, "gated rms norm");
  }
}

// ------------------------------------------------------------------ recurrence

// Host state of the recurrence with its running error bound (see the top of the file).
struct HostRecurrence {
  DeltaNetShape s;
  std::vector<float> S;     // [nv][dk][dv], float, advanced by reference::delta_rule_step
  std::vector<double> M;    // magnitudes, same layout
  double c = 0.0;           // accumulated per-side error count in units of u (times M)

  // One token: q (already scaled), k, v for all heads in a conv-output row; writes o [value_dim]
  // and the bound on |o_gpu - o_ref| per element (given per-step count `step_c`, output count
  // `out_c`).
  void step(const float* row, const float* gate, const float* beta, double step_c, double out_c, float* o,
            double* o_bound) {
    const int64_t dk = s.head_k_dim, dv = s.head_v_dim;
    c += step_c;
    std::vector<double> W(static_cast<size_t>(dv)), U(static_cast<size_t>(dv));
    for (int64_t hv = 0; hv < s.n_v_heads; ++hv) {
      const int64_t g = key_head(s, hv);
      const float* q = row + g * dk;
      const float* k = row + s.key_dim() + g * dk;
      const float* v = row + 2 * s.key_dim() + hv * dv;
      reference::delta_rule_step(S.data() + hv * dk * dv, q, k, v, gate[hv], beta[hv], dk, dv, 1.0f, o + hv * dv);
      double* Mh = M.data() + hv * dk * dv;
      const double d = std::exp(static_cast<double>(gate[hv]));
      std::fill(W.begin(), W.end(), 0.0);
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = 0; j < dv; ++j) {
          Mh[i * dv + j] *= d;
          W[j] += Mh[i * dv + j] * std::fabs(k[i]);
        }
      for (int64_t j = 0; j < dv; ++j) U[j] = beta[hv] * (std::fabs(v[j]) + W[j]);
      for (int64_t j = 0; j < dv; ++j) o_bound[hv * dv + j] = 0.0;
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = 0; j < dv; ++j) {
          Mh[i * dv + j] += std::fabs(k[i]) * U[j];
          o_bound[hv * dv + j] += Mh[i * dv + j] * std::fabs(q[i]);
        }
      for (int64_t j = 0; j < dv; ++j) o_bound[hv * dv + j] *= 2.0 * (c + out_c) * kU;
    }
  }
  void check_state(const std::vector<float>& got) const {
    for (size_t i = 0; i < S.size(); ++i) {
      const double tol = 2.0 * c * kU * M[i] + FLT_MIN;
      ASSERT_TRUE(std::fabs(static_cast<double>(got[i]) - S[i]) <= tol)
          << "state element " << i << ": got " << got[i] << ", reference " << S[i] << " (tolerance " << tol << ")";
    }
  }
};

// Random recurrence inputs for n tokens: rows of a conv output with unit q, k (q scaled).
struct RecurrenceInputs {
  std::vector<float> qkv, gate, beta;
};

RecurrenceInputs random_recurrence_inputs(const DeltaNetShape& s, int64_t n, std::mt19937& rng) {
  RecurrenceInputs in;
  const int64_t C = s.conv_dim(), dk = s.head_k_dim;
  in.qkv = normal(rng, static_cast<size_t>(n * C), 0.0f, 1.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < 2 * s.n_k_heads; ++h) {
      float* v = in.qkv.data() + t * C + h * dk;
      reference::l2_norm(v, dk, 1e-6f);
      if (h < s.n_k_heads)
        for (int64_t i = 0; i < dk; ++i) v[i] *= scale;
    }
  std::uniform_real_distribution<float> gdist(-4.0f, -0.02f), bdist(0.02f, 0.98f);
  in.gate.resize(static_cast<size_t>(n * s.n_v_heads));
  in.beta.resize(in.gate.size());
  for (float& g : in.gate) g = gdist(rng);
  for (float& b : in.beta) b = bdist(rng);
  return in;
}

// Runs `calls` (token counts) through delta_net_recurrence from a random initial state and
// checks every output and the state after every call.
void check_recurrence(const DeltaNetShape& s, const std::vector<int64_t>& calls, uint32_t seed) {
  SCOPED_TRACE(name(s));
  std::mt19937 rng(seed);
  HostRecurrence host{s, normal(rng, static_cast<size_t>(s.ssm_state_floats()), 0.0f, 0.3f), {}, 0.0};
  host.M.resize(host.S.size());
  for (size_t i = 0; i < host.S.size(); ++i) host.M[i] = std::fabs(host.S[i]);
  DeviceBuffer<float> dstate = upload(host.S);
  const int64_t V = s.value_dim(), dk = s.head_k_dim;
  for (int64_t n : calls) {
    const RecurrenceInputs in = random_recurrence_inputs(s, n, rng);
    DeviceBuffer<float> dqkv = upload(in.qkv), dgate = upload(in.gate), dbeta = upload(in.beta);
    DeviceBuffer<float> dout = poisoned(static_cast<size_t>(n * V));
    cuda::delta_net_recurrence(s, dstate.get(), dqkv.get(), dgate.get(), dbeta.get(), dout.get(), n);
    std::vector<float> want(static_cast<size_t>(n * V));
    std::vector<double> bound(want.size());
    for (int64_t t = 0; t < n; ++t)
      host.step(in.qkv.data() + t * s.conv_dim(), in.gate.data() + t * s.n_v_heads, in.beta.data() + t * s.n_v_heads,
                static_cast<double>(dk + 8), static_cast<double>(dk + 2), want.data() + t * V, bound.data() + t * V);
    const std::vector<float> got = download(dout, want.size());
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_TRUE(std::fabs(static_cast<double>(got[i]) - want[i]) <= bound[i] + FLT_MIN)
          << "call of n=" << n << ", output " << i << ": got " << got[i] << ", reference " << want[i]
          << " (bound " << bound[i] << ")";
    host.check_state(download(dstate, host.S.size()));
  }
}

TEST(CudaDeltaNet, RecurrenceDecodeStepsMatchReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const std::vector<int64_t> decode(12, 1);
  check_recurrence(shape_of(3, 3, 40, 24, 4), decode, 11);     // r = 1, odd heads
  check_recurrence(shape_of(3, 6, 64, 72, 4), decode, 12);     // r = 2, d_v not a multiple of 32
  check_recurrence(shape_of(1, 4, 128, 128, 4), decode, 13);   // r = 4, full dims
  check_recurrence(shape_of(5, 20, 33, 160, 4), decode, 14);   // r = 4, odd d_k, d_v > 128
  check_recurrence(qwen35(shape_of(3, 6, 64, 72, 4)), decode, 15);
  check_recurrence(qwen35(shape_of(2, 8, 128, 128, 4)), decode, 16);
}

TEST(CudaDeltaNet, RecurrencePrefillMatchesReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const std::vector<int64_t> calls{29, 1, 64, 3};
  check_recurrence(shape_of(3, 3, 40, 24, 4), calls, 21);
  check_recurrence(shape_of(3, 6, 64, 72, 4), calls, 22);
  check_recurrence(shape_of(2, 8, 128, 128, 4), calls, 23);
  check_recurrence(qwen35(shape_of(3, 12, 40, 24, 4)), calls, 24);
}

// ------------------------------------------------------------------ chunked recurrence

double gamma_u(double c) { return c * kU / (1.0 - c * kU); }

// The chunked recurrence against the exact recurrence (the reference's step formula in double:
// its own rounding, a few 2^-53, is negligible here), with a bound from the chunked
// algorithm's own structure: the kernels compute a fixed expression DAG of +, - and x on float
// inputs (decay factors exp(G) taken in double, rounded once), so each result is within
// gamma(depth) of the same DAG evaluated on absolute values (the "abs run" below, in double).
// Per chunk of L tokens the depth grows by at most 3 d_k + 2 L + 16: a d_k-term dot product
// and 3 roundings for A, L substitution steps, a d_k-term dot for W S0, then L terms of P U or
// of the state update; the state carries the depth into the next chunk.
struct ChunkedHost {
  DeltaNetShape s;
  std::vector<double> S;  // exact state
  std::vector<double> M;  // abs run of the chunked algorithm's state
  double c = 0.0;

  void run(const RecurrenceInputs& in, int64_t n, std::vector<double>& o, std::vector<double>& bound) {
    const int64_t dk = s.head_k_dim, dv = s.head_v_dim, nv = s.n_v_heads;
    const int64_t C = s.conv_dim(), V = s.value_dim();
    o.assign(static_cast<size_t>(n * V), 0.0);
    bound.assign(o.size(), 0.0);
    for (int64_t t0 = 0; t0 < n; t0 += 64) {
      const int64_t L = std::min<int64_t>(64, n - t0);
      c += static_cast<double>(3 * dk + 2 * L + 16);
      const double gam = gamma_u(c);
      for (int64_t hv = 0; hv < nv; ++hv) {
        const int64_t g = key_head(s, hv);
        auto q = [&](int64_t t, int64_t i) { return static_cast<double>(in.qkv[(t0 + t) * C + g * dk + i]); };
        auto k = [&](int64_t t, int64_t i) { return static_cast<double>(in.qkv[(t0 + t) * C + s.key_dim() + g * dk + i]); };
        auto v = [&](int64_t t, int64_t j) {
          return static_cast<double>(in.qkv[(t0 + t) * C + 2 * s.key_dim() + hv * dv + j]);
        };
        auto beta = [&](int64_t t) { return static_cast<double>(in.beta[(t0 + t) * nv + hv]); };
        // Exact recurrence, token by token.
        double* Sh = S.data() + hv * dk * dv;
        std::vector<double> w(static_cast<size_t>(dv)), u(static_cast<size_t>(dv));
        for (int64_t t = 0; t < L; ++t) {
          const double d = std::exp(static_cast<double>(in.gate[(t0 + t) * nv + hv]));
          std::fill(w.begin(), w.end(), 0.0);
          for (int64_t i = 0; i < dk; ++i)
            for (int64_t j = 0; j < dv; ++j) {
              Sh[i * dv + j] *= d;
              w[j] += Sh[i * dv + j] * k(t, i);
            }
          for (int64_t j = 0; j < dv; ++j) u[j] = beta(t) * (v(t, j) - w[j]);
          double* ot = o.data() + (t0 + t) * V + hv * dv;
          for (int64_t i = 0; i < dk; ++i)
            for (int64_t j = 0; j < dv; ++j) {
              Sh[i * dv + j] += k(t, i) * u[j];
              ot[j] += Sh[i * dv + j] * q(t, i);
            }
        }
        // Abs run of the chunked algorithm.
        std::vector<double> G(static_cast<size_t>(L));
        double acc = 0.0;
        for (int64_t t = 0; t < L; ++t) G[t] = acc += static_cast<double>(in.gate[(t0 + t) * nv + hv]);
        std::vector<double> A(static_cast<size_t>(L * L), 0.0), P(A.size(), 0.0);
        for (int64_t t = 0; t < L; ++t)
          for (int64_t u2 = 0; u2 <= t; ++u2) {
            double kk = 0.0, qk = 0.0;
            for (int64_t i = 0; i < dk; ++i) {
              kk += std::fabs(k(t, i) * k(u2, i));
              qk += std::fabs(q(t, i) * k(u2, i));
            }
            const double f = std::exp(G[t] - G[u2]);
            P[t * L + u2] = f * qk;
            if (u2 < t) A[t * L + u2] = beta(t) * f * kk;
          }
        std::vector<double> Xw(static_cast<size_t>(L * dk)), Xu(static_cast<size_t>(L * dv));
        for (int64_t t = 0; t < L; ++t) {
          for (int64_t i = 0; i < dk; ++i) {
            double x = beta(t) * std::exp(G[t]) * std::fabs(k(t, i));
            for (int64_t u2 = 0; u2 < t; ++u2) x += A[t * L + u2] * Xw[u2 * dk + i];
            Xw[t * dk + i] = x;
          }
          for (int64_t j = 0; j < dv; ++j) {
            double x = beta(t) * std::fabs(v(t, j));
            for (int64_t u2 = 0; u2 < t; ++u2) x += A[t * L + u2] * Xu[u2 * dv + j];
            Xu[t * dv + j] = x;
          }
        }
        double* Mh = M.data() + hv * dk * dv;
        std::vector<double> U(static_cast<size_t>(L * dv));
        for (int64_t t = 0; t < L; ++t)
          for (int64_t j = 0; j < dv; ++j) {
            double x = Xu[t * dv + j];
            for (int64_t i = 0; i < dk; ++i) x += Xw[t * dk + i] * Mh[i * dv + j];
            U[t * dv + j] = x;
          }
        for (int64_t t = 0; t < L; ++t)
          for (int64_t j = 0; j < dv; ++j) {
            double qs = 0.0;
            for (int64_t i = 0; i < dk; ++i) qs += std::fabs(q(t, i)) * Mh[i * dv + j];
            double x = std::exp(G[t]) * qs;
            for (int64_t u2 = 0; u2 <= t; ++u2) x += P[t * L + u2] * U[u2 * dv + j];
            bound[(t0 + t) * V + hv * dv + j] = gam * x;
          }
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) {
            double x = std::exp(G[L - 1]) * Mh[i * dv + j];
            for (int64_t u2 = 0; u2 < L; ++u2) x += std::exp(G[L - 1] - G[u2]) * std::fabs(k(u2, i)) * U[u2 * dv + j];
            Mh[i * dv + j] = x;
          }
      }
    }
  }
};

void check_chunked(const DeltaNetShape& s, const std::vector<int64_t>& calls, uint32_t seed) {
  SCOPED_TRACE(name(s));
  std::mt19937 rng(seed);
  const std::vector<float> s0 = normal(rng, static_cast<size_t>(s.ssm_state_floats()), 0.0f, 0.3f);
  ChunkedHost host{s, std::vector<double>(s0.begin(), s0.end()), {}, 0.0};
  for (float x : s0) host.M.push_back(std::fabs(x));
  DeviceBuffer<float> dstate = upload(s0);
  const int64_t V = s.value_dim();
  double worst = 0.0;  // largest |error| / bound seen, reported
  for (int64_t n : calls) {
    const RecurrenceInputs in = random_recurrence_inputs(s, n, rng);
    DeviceBuffer<float> dqkv = upload(in.qkv), dgate = upload(in.gate), dbeta = upload(in.beta);
    DeviceBuffer<float> dout = poisoned(static_cast<size_t>(n * V));
    DeviceBuffer<float> ws = poisoned(static_cast<size_t>(cuda::delta_net_chunked_workspace_floats(s, n)));
    cuda::delta_net_recurrence_chunked(s, dstate.get(), dqkv.get(), dgate.get(), dbeta.get(), dout.get(), n, ws.get());
    std::vector<double> want, bound;
    host.run(in, n, want, bound);
    const std::vector<float> got = download(dout, want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
      worst = std::max(worst, err / (bound[i] + FLT_MIN));
      ASSERT_TRUE(err <= bound[i] + FLT_MIN) << "call of n=" << n << ", output " << i << ": got " << got[i]
                                             << ", exact " << want[i] << " (bound " << bound[i] << ")";
    }
    const std::vector<float> st = download(dstate, host.S.size());
    for (size_t i = 0; i < st.size(); ++i) {
      const double tol = gamma_u(host.c) * host.M[i] + FLT_MIN;
      ASSERT_TRUE(std::fabs(static_cast<double>(st[i]) - host.S[i]) <= tol)
          << "after n=" << n << ", state element " << i << ": got " << st[i] << ", exact " << host.S[i]
          << " (bound " << tol << ")";
    }
  }
  std::cout << name(s) << ": largest error / bound " << worst << "\n";
}

TEST(CudaDeltaNet, RecurrenceChunkedMatchesExact) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  // Whole and partial chunks, a 1-token call, state carried across calls.
  check_chunked(shape_of(3, 3, 40, 24, 4), {200, 1, 63, 130}, 51);   // r = 1
  check_chunked(shape_of(3, 6, 64, 72, 4), {130, 64}, 52);           // r = 2
  check_chunked(shape_of(2, 8, 128, 128, 4), {200, 70}, 53);         // r = 4, full dims
  check_chunked(shape_of(5, 20, 33, 100, 4), {65}, 54);              // odd dims
  check_chunked(shape_of(1, 2, 16, 16, 4), {2100, 5}, 55);           // two passes of 2048
  check_chunked(qwen35(shape_of(3, 6, 64, 72, 4)), {130, 64}, 56);   // tiled value heads
  check_chunked(qwen35(shape_of(2, 8, 128, 128, 4)), {200, 1}, 57);
}

// ------------------------------------------------------------------ whole mixer

// Host weights and states of one layer and the reference computation of delta_net_block
// between the projections, token by token, with the running error bound.
struct HostMixer {
  DeltaNetShape s;
  float eps = 1e-6f;
  std::vector<float> conv_w, a, dt_bias, norm_w, conv_state;
  HostRecurrence rec;

  HostMixer(const DeltaNetShape& shape, std::mt19937& rng) : s(shape), rec{shape, {}, {}, 0.0} {
    conv_w = normal(rng, static_cast<size_t>(s.conv_dim() * s.conv_kernel), 0.0f, 0.5f);
    a = normal(rng, static_cast<size_t>(s.n_v_heads), 0.0f, 1.0f);
    for (float& v : a) v = -std::exp(v);
    dt_bias = normal(rng, static_cast<size_t>(s.n_v_heads), 0.0f, 1.0f);
    norm_w = normal(rng, static_cast<size_t>(s.head_v_dim), 1.0f, 0.2f);
    conv_state = normal(rng, static_cast<size_t>(std::max<int64_t>(1, s.conv_state_floats())), 0.0f, 1.0f);
    rec.S = normal(rng, static_cast<size_t>(s.ssm_state_floats()), 0.0f, 0.3f);
    rec.M.resize(rec.S.size());
    for (size_t i = 0; i < rec.S.size(); ++i) rec.M[i] = std::fabs(rec.S[i]);
  }

  // n tokens; want [n][value_dim] and the bound per element.
  void run(const std::vector<float>& mixed, const std::vector<float>& z, const std::vector<float>& ba, int64_t n,
           std::vector<float>& want, std::vector<double>& bound) {
    const int64_t C = s.conv_dim(), V = s.value_dim(), nv = s.n_v_heads;
    const int64_t dk = s.head_k_dim, dv = s.head_v_dim;
    want.assign(static_cast<size_t>(n * V), 0.0f);
    bound.assign(want.size(), 0.0);
    std::vector<float> x(static_cast<size_t>(C)), beta(static_cast<size_t>(nv)), gate(static_cast<size_t>(nv));
    std::vector<double> ob(static_cast<size_t>(V));
    const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
    for (int64_t t = 0; t < n; ++t) {
      reference::conv1d_silu_step(conv_w.data(), s.conv_kernel, C, conv_state.data(), mixed.data() + t * C, x.data());
      for (int64_t h = 0; h < 2 * s.n_k_heads; ++h) {
        reference::l2_norm(x.data() + h * dk, dk, eps);
        if (h < s.n_k_heads)
          for (int64_t i = 0; i < dk; ++i) x[h * dk + i] *= scale;  // delta_rule_step's q * scale
      }
      double gmax = 0.0;
      for (int64_t hv = 0; hv < nv; ++hv) {
        beta[hv] = reference::sigmoid(b_of(s, ba.data() + t * 2 * nv, hv));
        gate[hv] = a[hv] * reference::softplus(alpha_of(s, ba.data() + t * 2 * nv, hv) + dt_bias[hv]);
        gmax = std::max(gmax, std::fabs(static_cast<double>(gate[hv])));
      }
      // Input differences (both sides, in u, relative to the magnitudes they feed): q and k
      // (d_k + 8 from the norm, 20 from the conv through it), v 10, beta 16, and the decay
      // exp(gate) 16 |gate|.
      const double in_c = static_cast<double>(dk + 28) + 10.0 + 16.0 + 16.0 * gmax;
      float* o = want.data() + t * V;
      rec.step(x.data(), gate.data(), beta.data(), static_cast<double>(dk + 8) + in_c / 2.0,
               static_cast<double>(dk + 2) + static_cast<double>(dk + 28) / 2.0, o, ob.data());
      for (int64_t hv = 0; hv < nv; ++hv) {
        float* oh = o + hv * dv;
        const double* eh = ob.data() + hv * dv;
        // Bound through the norm: o * inv moves by e * inv + |o| * inv * |d inv / inv| with
        // |d inv / inv| <= (sum 2|o| e + e^2) / (2 sum o^2).
        double ss = 0.0, dss = 0.0;
        for (int64_t j = 0; j < dv; ++j) {
          ss += static_cast<double>(oh[j]) * oh[j];
          dss += 2.0 * std::fabs(oh[j]) * eh[j] + eh[j] * eh[j];
        }
        const double inv = 1.0 / std::sqrt(ss / static_cast<double>(dv) + eps);
        const double rel_inv = dss / (2.0 * (ss + static_cast<double>(eps) * static_cast<double>(dv)));
        std::vector<float> on(static_cast<size_t>(dv));
        for (int64_t j = 0; j < dv; ++j) on[j] = oh[j];
        reference::rms_norm(on.data(), norm_w.data(), dv, eps, oh);
        for (int64_t j = 0; j < dv; ++j) {
          const float sz = reference::silu(z[t * V + hv * dv + j]);
          oh[j] *= sz;
          bound[t * V + hv * dv + j] =
              std::fabs(static_cast<double>(norm_w[j]) * sz) * inv * (eh[j] + std::fabs(on[j]) * rel_inv) +
              22.0 * kU * std::fabs(oh[j]);
        }
      }
    }
  }
};

struct MixInputs {
  std::vector<float> mixed, z, ba;
};

MixInputs random_mix_inputs(const DeltaNetShape& s, int64_t n, std::mt19937& rng) {
  MixInputs in;
  in.mixed = normal(rng, static_cast<size_t>(n * s.conv_dim()), 0.0f, 1.0f);
  in.z = normal(rng, static_cast<size_t>(n * s.value_dim()), 0.0f, 1.5f);
  in.ba = normal(rng, static_cast<size_t>(n * 2 * s.n_v_heads), 0.0f, 2.0f);
  return in;
}

struct DeviceMixer {
  DeviceBuffer<float> conv_w, a, dt_bias, norm_w, conv_state, ssm_state;
  explicit DeviceMixer(const HostMixer& h)
      : conv_w(upload(h.conv_w)), a(upload(h.a)), dt_bias(upload(h.dt_bias)), norm_w(upload(h.norm_w)),
        conv_state(upload(h.conv_state)), ssm_state(upload(h.rec.S)) {}
  std::vector<float> run(const DeltaNetShape& s, const MixInputs& in, int64_t n, float eps) {
    DeviceBuffer<float> dmixed = upload(in.mixed), dz = upload(in.z), dba = upload(in.ba);
    DeviceBuffer<float> ws = poisoned(static_cast<size_t>(cuda::delta_net_workspace_floats(s, n)));
    DeviceBuffer<float> out = poisoned(static_cast<size_t>(n * s.value_dim()));
    cuda::delta_net_mix(s, {conv_w.get(), a.get(), dt_bias.get(), norm_w.get()}, {conv_state.get(), ssm_state.get()},
                        dmixed.get(), dz.get(), dba.get(), n, eps, ws.get(), out.get());
    return download(out, static_cast<size_t>(n * s.value_dim()));
  }
};

void check_mix(const DeltaNetShape& s, const std::vector<int64_t>& calls, uint32_t seed) {
  SCOPED_TRACE(name(s));
  std::mt19937 rng(seed);
  HostMixer host(s, rng);
  DeviceMixer dev(host);
  for (int64_t n : calls) {
    const MixInputs in = random_mix_inputs(s, n, rng);
    const std::vector<float> got = dev.run(s, in, n, host.eps);
    std::vector<float> want;
    std::vector<double> bound;
    host.run(in.mixed, in.z, in.ba, n, want, bound);
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_TRUE(std::fabs(static_cast<double>(got[i]) - want[i]) <= bound[i] + FLT_MIN)
          << "call of n=" << n << ", output " << i << ": got " << got[i] << ", reference " << want[i]
          << " (bound " << bound[i] << ")";
    host.rec.check_state(download(dev.ssm_state, host.rec.S.size()));
    expect_bitwise(download(dev.conv_state, static_cast<size_t>(s.conv_state_floats())),
                   std::vector<float>(host.conv_state.begin(), host.conv_state.begin() + s.conv_state_floats()),
                   "conv state");
  }
}

TEST(CudaDeltaNet, MixDecodeStepsMatchReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const std::vector<int64_t> decode(10, 1);
  check_mix(shape_of(3, 3, 40, 24, 4), decode, 31);
  check_mix(shape_of(3, 6, 64, 72, 4), decode, 32);
  check_mix(shape_of(3, 12, 128, 128, 4), decode, 33);
  check_mix(shape_of(5, 20, 33, 160, 3), decode, 34);  // d_v > 128: norm not fused
  check_mix(qwen35(shape_of(3, 6, 64, 72, 4)), decode, 35);
  check_mix(qwen35(shape_of(4, 12, 128, 128, 4)), decode, 36);
  check_mix(qwen35(shape_of(5, 20, 33, 160, 3)), decode, 37);
}

TEST(CudaDeltaNet, MixPrefillMatchesReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check_mix(shape_of(3, 6, 64, 72, 4), {40, 1, 1, 17}, 41);
  check_mix(shape_of(16, 32, 128, 128, 4), {33, 1, 2}, 42);  // Qwen3-Next-80B's layer shape
  check_mix(qwen35(shape_of(16, 32, 128, 128, 4)), {33, 1, 2}, 43);   // Qwen3.5-35B-A3B's
  check_mix(qwen35(shape_of(3, 6, 64, 72, 4)), {40, 1, 17}, 44);
}

// Prefill of n tokens leaves the same states and outputs as n decode calls, bit for bit: both
// run the same per-token arithmetic (conv with the same roundings, the recurrence's token loop,
// the norms' sums in the same order), in a few launches instead of 4n. (The chunked form, not
// used by delta_net_mix, is equal to rounding: RecurrenceChunkedMatchesExact.)
TEST(CudaDeltaNet, PrefillEqualsDecodeSteps) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  for (const DeltaNetShape& s : {shape_of(3, 6, 64, 72, 4), shape_of(5, 20, 33, 160, 3), shape_of(4, 16, 128, 128, 4),
                                 qwen35(shape_of(4, 16, 128, 128, 4))}) {
    SCOPED_TRACE(name(s));
    std::mt19937 rng(static_cast<uint32_t>(s.n_v_heads));
    HostMixer host(s, rng);
    DeviceMixer prefill(host), decode(host);
    const int64_t n = 50, V = s.value_dim();
    const MixInputs in = random_mix_inputs(s, n, rng);
    const std::vector<float> got = prefill.run(s, in, n, host.eps);
    std::vector<float> steps;
    for (int64_t t = 0; t < n; ++t) {
      MixInputs one;
      one.mixed.assign(in.mixed.begin() + t * s.conv_dim(), in.mixed.begin() + (t + 1) * s.conv_dim());
      one.z.assign(in.z.begin() + t * V, in.z.begin() + (t + 1) * V);
      one.ba.assign(in.ba.begin() + t * 2 * s.n_v_heads, in.ba.begin() + (t + 1) * 2 * s.n_v_heads);
      const std::vector<float> o = decode.run(s, one, 1, host.eps);
      steps.insert(steps.end(), o.begin(), o.end());
    }
    expect_bitwise(got, steps, "outputs");
    expect_bitwise(download(prefill.ssm_state, static_cast<size_t>(s.ssm_state_floats())),
                   download(decode.ssm_state, static_cast<size_t>(s.ssm_state_floats())), "ssm state");
    expect_bitwise(download(prefill.conv_state, static_cast<size_t>(s.conv_state_floats())),
                   download(decode.conv_state, static_cast<size_t>(s.conv_state_floats())), "conv state");
  }
}

// delta_net_mix fuses the L2 norm, gates and (d_v <= 128) the gated norm into the token loop
// for calls of up to 4 tokens and runs the stage kernels one by one for longer ones: either way
// a call must equal the stages run one by one, bit for bit (the fused kernel shares the stages'
// device functions and adds the norm's squares in the standalone kernel's order).
TEST(CudaDeltaNet, MixEqualsItsStages) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  for (const DeltaNetShape& s : {shape_of(3, 6, 64, 72, 4), shape_of(16, 32, 128, 128, 4), shape_of(5, 20, 33, 160, 3),
                                 qwen35(shape_of(16, 32, 128, 128, 4)), qwen35(shape_of(5, 20, 33, 160, 3))}) {
    SCOPED_TRACE(name(s));
    std::mt19937 rng(static_cast<uint32_t>(s.head_v_dim));
    HostMixer host(s, rng);
    DeviceMixer mix(host), stages(host);
    const float eps = host.eps;
    for (int64_t n : {int64_t{5}, int64_t{150}, int64_t{1}, int64_t{3}, int64_t{64}}) {
      const MixInputs in = random_mix_inputs(s, n, rng);
      const std::vector<float> got = mix.run(s, in, n, eps);
      DeviceBuffer<float> dmixed = upload(in.mixed), dz = upload(in.z), dba = upload(in.ba);
      DeviceBuffer<float> x = poisoned(static_cast<size_t>(n * s.conv_dim()));
      DeviceBuffer<float> beta = poisoned(static_cast<size_t>(n * s.n_v_heads)), gate = poisoned(beta.size());
      DeviceBuffer<float> out = poisoned(static_cast<size_t>(n * s.value_dim()));
      cuda::delta_net_conv_silu(s, stages.conv_w.get(), stages.conv_state.get(), dmixed.get(), x.get(), n);
      cuda::delta_net_l2_norm_qk(s, x.get(), n, eps);
      cuda::delta_net_gates(s, dba.get(), stages.a.get(), stages.dt_bias.get(), beta.get(), gate.get(), n);
      cuda::delta_net_recurrence(s, stages.ssm_state.get(), x.get(), gate.get(), beta.get(), out.get(), n);
      cuda::delta_net_gated_rms_norm(s, out.get(), dz.get(), stages.norm_w.get(), n, eps);
      expect_bitwise(got, download(out, got.size()), "outputs of n=" + std::to_string(n));
      expect_bitwise(download(mix.ssm_state, static_cast<size_t>(s.ssm_state_floats())),
                     download(stages.ssm_state, static_cast<size_t>(s.ssm_state_floats())), "ssm state");
    }
  }
}

// ------------------------------------------------------------------ head maps

// The kernels' head maps (delta_net_shape.h, also compiled for the device) against this file's,
// which follow delta_net_block: each value head's key head and its b and alpha in the ba row.
TEST(CudaDeltaNetHeads, MapsAreTheReferences) {
  for (const DeltaNetShape& g : {shape_of(3, 3, 8, 8, 4), shape_of(2, 8, 8, 8, 4), shape_of(5, 20, 8, 8, 4)}) {
    for (const DeltaNetShape& s : {g, qwen35(g)}) {
      SCOPED_TRACE(name(s));
      std::vector<float> row(static_cast<size_t>(2 * s.n_v_heads));
      for (size_t i = 0; i < row.size(); ++i) row[i] = static_cast<float>(i);
      std::vector<int> uses(row.size(), 0);
      for (int64_t hv = 0; hv < s.n_v_heads; ++hv) {
        EXPECT_EQ(cuda::delta_net_key_head(hv, s.n_k_heads, s.n_v_heads, s.v_heads_tiled), key_head(s, hv)) << hv;
        const int64_t b = cuda::delta_net_b_index(hv, s.n_k_heads, s.n_v_heads, s.split_ba);
        const int64_t al = cuda::delta_net_alpha_index(hv, s.n_k_heads, s.n_v_heads, s.split_ba);
        EXPECT_EQ(row[b], b_of(s, row.data(), hv)) << hv;
        EXPECT_EQ(row[al], alpha_of(s, row.data(), hv)) << hv;
        ++uses[b];
        ++uses[al];
      }
      EXPECT_EQ(std::count(uses.begin(), uses.end(), 1), static_cast<long>(row.size())) << "every entry read once";
    }
  }
  // n_v > n_k: tiled and grouped differ (value head 1 of 2 key heads, 8 value heads: 1 vs 0).
  EXPECT_NE(cuda::delta_net_key_head(1, 2, 8, true), cuda::delta_net_key_head(1, 2, 8, false));
}

// ------------------------------------------------------------------ arguments

TEST(CudaDeltaNetArguments, RejectsBadShapes) {
  EXPECT_THROW(cuda::check_delta_net_shape(shape_of(3, 4, 128, 128, 4)), std::invalid_argument);  // 4 % 3
  EXPECT_THROW(cuda::check_delta_net_shape(shape_of(1, 1, 129, 128, 4)), std::invalid_argument);  // d_k
  EXPECT_THROW(cuda::check_delta_net_shape(shape_of(1, 1, 128, 257, 4)), std::invalid_argument);  // d_v
  EXPECT_THROW(cuda::check_delta_net_shape(shape_of(1, 1, 128, 128, 0)), std::invalid_argument);  // K
  EXPECT_THROW(cuda::check_delta_net_shape(shape_of(0, 1, 128, 128, 4)), std::invalid_argument);
  EXPECT_NO_THROW(cuda::check_delta_net_shape(shape_of(16, 32, 128, 128, 4)));
  // Null pointers and bad token counts are refused before any launch (no device needed).
  const DeltaNetShape s = shape_of(16, 32, 128, 128, 4);
  float dummy = 0.0f;
  EXPECT_THROW(cuda::delta_net_conv_silu(s, &dummy, nullptr, &dummy, &dummy, 1), std::invalid_argument);
  EXPECT_THROW(cuda::delta_net_recurrence(s, &dummy, &dummy, &dummy, &dummy, &dummy, 0), std::invalid_argument);
  EXPECT_THROW(cuda::delta_net_gates(s, nullptr, &dummy, &dummy, &dummy, &dummy, 1), std::invalid_argument);
  EXPECT_THROW(cuda::delta_net_recurrence_chunked(shape_of(1, 1, 128, 256, 4), &dummy, &dummy, &dummy, &dummy, &dummy, 8,
                                                  &dummy),
               std::invalid_argument);  // d_v above the chunked path's 128
  EXPECT_THROW(cuda::delta_net_recurrence_chunked(s, &dummy, &dummy, &dummy, &dummy, &dummy, 8, nullptr),
               std::invalid_argument);  // no workspace
  EXPECT_THROW(cuda::delta_net_chunked_workspace_floats(s, 0), std::invalid_argument);
  EXPECT_THROW(cuda::delta_net_workspace_floats(s, 0), std::invalid_argument);
  EXPECT_FALSE(cuda::delta_net_chunked_supported(shape_of(1, 1, 128, 256, 4)));
  try {
    cuda::check_delta_net_shape(shape_of(3, 4, 128, 128, 4));
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("n_v_heads=4"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moraine
