// The fused routed-expert kernel (kernels/cuda/moe_fused.cu) against a host loop built from the
// scalar reference: per slot, x quantized by reference::pack_activations to the gate/up activation
// type (what moe_parts' swiglu_expert does: Q8_0 with llama.cpp's x86 rule), every gate/up row by
// vec_dot_reference, h = reference::silu(g) * u, h packed for down likewise, down rows by
// vec_dot_reference, then reference::moe_combine's weighted sum in top-k order.
//
// Tolerance, derived rather than tuned (u = 2^-24, gamma(k) = k*u / (1 - k*u)):
//  - g, u: the kernel adds the reference's per-block float terms in another order:
//    |dg| <= 2 gamma(blocks) sum|terms| (as tests/cuda/matvec_test.cpp).
//  - h: silu is 1.1-Lipschitz; the device's expf is within 2 ulp and the host's within 1, and the
//    add, divide and multiply round once each on both sides, so for the same g the two silu
//    values differ by at most 8u relative; then h = silu * u adds one rounding each side.
//  - quantized h: the device's block maximum lies in [max(|h|-dh), max(|h|+dh)], so each scaled
//    value h*127/amax lies in an interval (both rules' scalings, 127/amax and 1/(amax/127), within a
//    few ulp); every integer q it can round to (ties either way), times every scale the
//    range allows (fp16-rounded for Q8_0), bounds how far the device's dequantized h_i can be from
//    the host's: D_i. Almost always D_i is a relative 1e-6 of h_i; where an element sits on a
//    rounding boundary it is one quantum.
//  - down output row r: sum_i |W_ri| D_i (W dequantized) + 2 gamma(blocks) sum|terms| for the order,
//    plus the terms' own roundings, which no longer cancel once the activations differ: each side
//    rounds a term up to 3 times (isum to float beyond 2^24, d * d_act, the product), 6u both
//    sides; taken as 8u for the few-ulp difference of the activations themselves. Formats with
//    mins (Q2_K, Q4_K, Q5_K) round the two parts of d * isum - dmin * msum separately, and these
//    can be much larger than their difference, so their 8u applies to the parts, per block:
//    P1 = sum_i (W_ri + min_ri) h_i and P2 = sum_i min_ri h_i (min_ri = dmin * m of the element's
//    sub-block; W dequantized, h the host's dequantized h), plus sum_i (|W_ri + min_ri| + |min_ri|) D_i
//    for how far the device's activations can move them. A first derivation used 4u of |terms|
//    only and failed on the H200 for exactly the min formats, by up to 1.4x its bound; the
//    logged values are now within 0.1x to 0.2x of this one.
//    Q4_1 / Q5_1 (mins too, per 32-element block) dot Q8_1 h, whose min part is m * s with
//    s = fp16(d * sum q) (d the block's float scale): the device's s can move by the float-scale
//    bounds D'_i summed over the block (dequant_bounds with a float scale), plus the fp16 rounding
//    of both s (2^-11 relative each, 2^-25 absolute below the normal range); and since the term is
//    (W - m) . h + m * s rather than W . h, the h part's change is within flips + |m| sum D_i:
//    |m| (|s' - s| + sum D_i) per block on top of flips. IQ4_XS's terms are its sub-blocks'
//    (tests/cuda/dot_terms.h).
//  - weighted sum: sum_s |w_s| tol_s (1 + 2u) + 2 gamma(k + 1) sum_s |w_s y_s|.
// A wrong row, block, expert, token or weight moves results by the size of the values, orders of
// magnitude above these bounds. Every case runs each form of the kernels (MoeLayerWeights::Form:
// the tiled kernels, the staged form, the one the backend picks, and the kernel bench's warp-unit
// kernels, tools/kernel_bench/moe_fused_units.h): the bounds do not depend on the form, since
// every form adds the same per-block terms.
// Cost: the host side (quantizing the weights, the scalar reference) runs on every core, and
// only the experts the routing reads get weights of their own (make_kind).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <numeric>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "common/formats/block_layouts.h"
#include "common/formats/half_float.h"
#include "common/formats/quant.h"
#include "common/reference/matmul.h"
#include "common/reference/ops.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/moe_fused.h"
#include "tests/cuda/cuda_test_support.h"
#include "tests/cuda/dot_terms.h"
#include "tests/cuda/iq_test_blocks.h"
#include "tools/kernel_bench/moe_fused_units.h"

namespace moraine {
namespace {

constexpr double kU = 0x1p-24;

double gamma(int64_t k) { return static_cast<double>(k) * kU / (1.0 - static_cast<double>(k) * kU); }

struct Kind {
  TensorType type;
  int64_t rows, cols;
  size_t row_bytes;
  std::vector<uint8_t> bytes;  // all experts back to back
  const uint8_t* row(int64_t e, int64_t r) const { return bytes.data() + (e * rows + r) * row_bytes; }
  size_t expert_bytes() const { return row_bytes * static_cast<size_t>(rows); }
};

// Values with random_values' wide per-block spread, scaled down by `scale`: weights by 1e-3 and
// x by 1e-1 keep h (about |g * u|) far inside the range a Q8_0 block's fp16 scale can hold
// (amax / 127 <= 65504), which quantize_row refuses to exceed, as real activations are.
std::vector<float> scaled_values(std::mt19937& rng, size_t n, float scale) {
  std::vector<float> v = cuda_test::random_values(rng, n);
  for (float& f : v) f *= scale;
  return v;
}

// fn(0) .. fn(n - 1) spread over the host's cores (the scalar reference and the weight
// quantization are the test's cost: one thread took > 60 s for the whole file).
template <class Fn>
void parallel_for(int64_t n, const Fn& fn) {
  const int64_t threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 32);
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < std::min(threads, n); ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

// Each routed expert's values from its own generator (seeded from the case's stream), so experts
// can be made in parallel and the data stay fixed for a seed. Quantizing is the test's cost (the
// K-quant searches: ~0.4 us per element; all 61 experts of the widest case took 37 s), so an
// expert no token chose gets, instead of values of its own, the rows of a routed expert rotated
// by one: a kernel that reads it in place of the right expert still gets another row's values.
Kind make_kind(TensorType t, int64_t experts, int64_t rows, int64_t cols, const std::vector<bool>& routed,
               std::mt19937& rng) {
  Kind k{t, rows, cols, row_bytes(t, cols), {}};
  k.bytes.resize(k.row_bytes * static_cast<size_t>(experts * rows));
  std::vector<uint32_t> seeds(static_cast<size_t>(experts));
  for (uint32_t& s : seeds) s = static_cast<uint32_t>(rng());
  parallel_for(experts, [&](int64_t e) {
    if (!routed[static_cast<size_t>(e)]) return;
    std::mt19937 expert_rng(seeds[static_cast<size_t>(e)]);
    if (formats::is_iq_grid_type(t)) {  // random blocks (iq_test_blocks.h): scales 1e-6 .. 1e-3, |w| < 0.5
      cuda_test::random_iq_blocks(t, k.bytes.data() + e * k.expert_bytes(), rows * (cols / kQK_K), expert_rng, 1e-6f, 1e-3f);
      return;
    }
    const std::vector<float> v = scaled_values(expert_rng, static_cast<size_t>(rows * cols), 1e-3f);
    for (int64_t r = 0; r < rows; ++r)
      quantize_row(t, v.data() + r * cols, k.bytes.data() + (e * rows + r) * k.row_bytes, cols);
  });
  const auto first = std::find(routed.begin(), routed.end(), true);
  const int64_t donor = first == routed.end() ? -1 : first - routed.begin();
  for (int64_t e = 0; e < experts && donor >= 0; ++e) {
    if (routed[static_cast<size_t>(e)]) continue;
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(k.bytes.data() + (e * rows + r) * k.row_bytes, k.row(donor, (r + 1) % rows), k.row_bytes);
  }
  return k;
}

// vec_dot_reference of one row and the bound on the kernel's reordering of its terms.
struct Dot {
  float value;
  double abs_terms;  // sum over terms of |term|
  int64_t terms;     // how many (blocks; IQ4_XS: sub-blocks)
};

Dot reference_dot(TensorType w_type, const uint8_t* w_row, const uint8_t* act_row, int64_t n) {
  const cuda_test::DotTerms t = cuda_test::dot_terms(w_type, w_row, act_row, n);
  return {vec_dot_reference(w_type, n, w_row, act_row), t.abs_sum, t.count};
}

bool has_mins(TensorType t) {
  return t == TensorType::Q2_K || t == TensorType::Q4_K || t == TensorType::Q5_K || t == TensorType::Q4_1 ||
         t == TensorType::Q5_1;
}

// Per element of a weight row, what its format subtracts (dmin * m of the sub-block); 0 for
// formats without mins. A block with its quants zeroed dequantizes to exactly -dmin * m.
std::vector<float> min_parts(TensorType t, const uint8_t* row, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n), 0.0f);
  if (!has_mins(t)) return out;
  std::vector<uint8_t> z(row, row + row_bytes(t, n));
  const size_t bb = type_traits(t).block_bytes;
  for (int64_t b = 0; b < n / type_traits(t).block_elems; ++b) {
    uint8_t* blk = z.data() + static_cast<size_t>(b) * bb;
    if (t == TensorType::Q4_1) {
      std::memset(blk + offsetof(BlockQ4_1, qs), 0, sizeof(BlockQ4_1::qs));
    } else if (t == TensorType::Q5_1) {
      std::memset(blk + offsetof(BlockQ5_1, qh), 0, sizeof(BlockQ5_1::qh) + sizeof(BlockQ5_1::qs));
    } else if (t == TensorType::Q2_K) {
      std::memset(blk + offsetof(BlockQ2_K, qs), 0, sizeof(BlockQ2_K::qs));
    } else if (t == TensorType::Q4_K) {
      std::memset(blk + offsetof(BlockQ4_K, qs), 0, sizeof(BlockQ4_K::qs));
    } else {
      std::memset(blk + offsetof(BlockQ5_K, qh), 0, sizeof(BlockQ5_K::qh));
      std::memset(blk + offsetof(BlockQ5_K, qs), 0, sizeof(BlockQ5_K::qs));
    }
  }
  dequantize_row(t, z.data(), out.data(), n);
  for (float& v : out) v = -v;
  return out;
}

float fp16_round(double v) { return half::fp16_to_fp32(half::fp32_to_fp16(static_cast<float>(v))); }

// D_i for one activation block (header comment): h host values, dh their bounds, v the host's
// dequantized values (same block), q8k whether the block is Q8_K (float scale) or Q8_0 (fp16).
void dequant_bounds(const float* h, const double* dh, const float* v, int n, bool q8k, double* out) {
  double a_lo = 0.0, a_hi = 0.0;
  for (int i = 0; i < n; ++i) {
    a_lo = std::max(a_lo, std::fabs(h[i]) - dh[i]);
    a_hi = std::max(a_hi, std::fabs(h[i]) + dh[i]);
  }
  if (a_hi == 0.0) {
    std::fill(out, out + n, 0.0);
    return;
  }
  // Scales a device could use: inverse for rounding, d for dequantizing (a few ulp of slack for
  // the divisions that make them).
  const double inv_lo = a_hi > 0 ? 127.0 / a_hi * (1 - 8 * kU) : 0.0;
  const double inv_hi = a_lo > 0 ? 127.0 / a_lo * (1 + 8 * kU) : 1e300;
  double d_lo = a_lo / 127.0 * (1 - 8 * kU), d_hi = a_hi / 127.0 * (1 + 8 * kU);
  if (!q8k) {
    d_lo = fp16_round(d_lo) * (1 - kU);  // fp16 rounding is monotone: the ends bound it
    d_hi = fp16_round(d_hi) * (1 + kU);
  }
  for (int i = 0; i < n; ++i) {
    const double lo = h[i] - dh[i], hi = h[i] + dh[i];
    double z_lo = std::min({lo * inv_lo, lo * inv_hi, hi * inv_lo, hi * inv_hi});
    double z_hi = std::max({lo * inv_lo, lo * inv_hi, hi * inv_lo, hi * inv_hi});
    z_lo = std::max(z_lo, -128.0);
    z_hi = std::min(z_hi, 128.0);
    const double q_lo = std::ceil(z_lo - 0.5), q_hi = std::floor(z_hi + 0.5);  // ties either way
    double worst = 0.0;
    for (double q : {q_lo, q_hi})
      for (double d : {d_lo, d_hi}) worst = std::max(worst, std::fabs(d * q - static_cast<double>(v[i])));
    out[i] = worst;
  }
}

// Q8_1 h (Q4_1 / Q5_1 down): per 32-element block, how far the device's s = fp16(d * sum q) can be
// from the host's (header comment): the float-scale dequantization bounds summed, and both fp16
// roundings. Empty for other activation formats.
std::vector<double> q8_1_s_bounds(TensorType ah, const std::vector<float>& h, const std::vector<double>& dh,
                                  const std::vector<uint8_t>& hq, int64_t n_ff) {
  std::vector<double> out;
  if (ah != TensorType::Q8_1) return out;
  for (int64_t b = 0; b < n_ff / kQK; ++b) {
    BlockQ8_1 blk;
    std::memcpy(&blk, hq.data() + static_cast<size_t>(b) * sizeof(BlockQ8_1), sizeof(blk));
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(h[static_cast<size_t>(b * kQK + j)]));
    const double d = static_cast<double>(amax / 127.0f);  // the host's float scale (x86 rule)
    double v[kQK], bound[kQK];
    float vf[kQK];
    for (int j = 0; j < kQK; ++j) {
      v[j] = d * blk.qs[j];
      vf[j] = static_cast<float>(v[j]);
    }
    dequant_bounds(h.data() + b * kQK, dh.data() + b * kQK, vf, kQK, true, bound);
    double moved = 0.0;
    for (int j = 0; j < kQK; ++j) moved += bound[j] + std::fabs(v[j] - static_cast<double>(vf[j]));
    const double s = std::fabs(static_cast<double>(half::fp16_to_fp32(blk.s)));
    // |fp16(y') - fp16(y)| <= |y' - y| + 2^-11 (|y| + |y'|) + 2 * 2^-25, |y| and |y'| within s + moved
    // (and the float product's own rounding, 2^-24 relative): the 1.01 and 2^-23 cover the rest.
    out.push_back(moved * (1.0 + std::ldexp(1.0, -10)) + std::ldexp(1.0, -10) * s * 1.01 + std::ldexp(1.0, -23));
  }
  return out;
}

struct Case {
  TensorType gate, up, down;
  int n_tokens, n_expert, k;
  int64_t n_embd, n_ff;
  bool slot_table;  // slot-table mode with every third expert absent, and slot_rows out
  uint32_t seed;
  bool plain_launches = false;  // every form with both kernels launched plainly (no PDL), as below sm_90
  bool oss = false;   // gpt-oss: per-expert biases and the clamped SwiGLU (reference::biased_expert)
};

// gpt-oss's constants (parts.h ExpertsPart) and its h, as reference::biased_expert computes it.
constexpr float kAlpha = 1.702f, kLimit = 7.0f;
float oss_h(float g, float u) {
  g = std::fmin(g, kLimit);
  u = std::fmax(-kLimit, std::fmin(u, kLimit));
  return g * reference::sigmoid(kAlpha * g) * (u + 1.0f);
}

// Host reference for one slot: the expert's output row and its tolerance.
struct SlotRef {
  std::vector<float> y;
  std::vector<double> tol;
};

struct ExpectedSum {
  float value;
  double tolerance;
};

// bg / bu / bd: expert e's biases (null: plain SwiGLU, no biases). With them (gpt-oss) h is
// reference::biased_expert's: g + bg, u + bu (each side rounds the add of values tg / tu apart:
// 2u more), clamped (1-Lipschitz), g sigmoid(alpha g) (derivative <= 1.23 for any g: 1 + max x
// sigmoid(x)(1 - sigmoid(x)); the device's expf and the alpha product: 10u relative where silu had
// 8u) times (u + 1) (one more rounding each side); y = down h + bd (2u of |y| more).
SlotRef reference_slot(const Kind& gate, const Kind& up, const Kind& down, int64_t e, const float* x,
                       const float* bg = nullptr, const float* bu = nullptr, const float* bd = nullptr) {
  const int64_t n_embd = gate.cols, n_ff = gate.rows;
  const TensorType ah = dot_activation_type(down.type);
  const std::vector<uint8_t> xg = reference::pack_activations(gate.type, x, 1, n_embd).bytes;
  const std::vector<uint8_t> xu = reference::pack_activations(up.type, x, 1, n_embd).bytes;
  std::vector<float> h(static_cast<size_t>(n_ff));
  std::vector<double> dh(static_cast<size_t>(n_ff));
  for (int64_t r = 0; r < n_ff; ++r) {
    const Dot g = reference_dot(gate.type, gate.row(e, r), xg.data(), n_embd);
    const Dot u = reference_dot(up.type, up.row(e, r), xu.data(), n_embd);
    const double tg = 2.0 * gamma(g.terms) * g.abs_terms, tu = 2.0 * gamma(u.terms) * u.abs_terms;
    if (bg != nullptr) {
      const float gb = g.value + bg[r], ub = u.value + bu[r];
      const float gc = std::fmin(gb, kLimit), uc = std::fmax(-kLimit, std::fmin(ub, kLimit)) + 1.0f;
      const float s = gc * reference::sigmoid(kAlpha * gc);
      h[static_cast<size_t>(r)] = oss_h(gb, ub);
      const double tg2 = tg + 2.0 * kU * std::fabs(gb), tu2 = tu + 2.0 * kU * std::fabs(ub) + 2.0 * kU * std::fabs(uc);
      const double ds = 1.23 * tg2 + 10.0 * kU * (std::fabs(s) + 1.23 * tg2);
      dh[static_cast<size_t>(r)] = ds * (std::fabs(uc) + tu2) + std::fabs(s) * tu2 +
                                   2.0 * kU * (std::fabs(s) + ds) * (std::fabs(uc) + tu2);
      continue;
    }
    const float s = reference::silu(g.value);
    h[static_cast<size_t>(r)] = s * u.value;
    const double ds = 1.1 * tg + 8.0 * kU * (std::fabs(s) + 1.1 * tg);
    dh[static_cast<size_t>(r)] = ds * (std::fabs(u.value) + tu) + std::fabs(s) * tu +
                                 2.0 * kU * (std::fabs(s) + ds) * (std::fabs(u.value) + tu);
  }
  const std::vector<uint8_t> hq = reference::pack_activations(down.type, h.data(), 1, n_ff).bytes;
  std::vector<float> hv(static_cast<size_t>(n_ff));
  dequantize_row(ah, hq.data(), hv.data(), n_ff);
  std::vector<double> D(static_cast<size_t>(n_ff));
  const int ab = static_cast<int>(type_traits(ah).block_elems);
  for (int64_t b = 0; b < n_ff / ab; ++b)
    dequant_bounds(h.data() + b * ab, dh.data() + b * ab, hv.data() + b * ab, ab, ah == TensorType::Q8_K,
                   D.data() + b * ab);
  const std::vector<double> s_moves = q8_1_s_bounds(ah, h, dh, hq, n_ff);
  SlotRef out{std::vector<float>(static_cast<size_t>(n_embd)), std::vector<double>(static_cast<size_t>(n_embd))};
  std::vector<float> wrow(static_cast<size_t>(n_ff));
  for (int64_t r = 0; r < n_embd; ++r) {
    const Dot y = reference_dot(down.type, down.row(e, r), hq.data(), n_ff);
    dequantize_row(down.type, down.row(e, r), wrow.data(), n_ff);
    const std::vector<float> mins = min_parts(down.type, down.row(e, r), n_ff);
    double flips = 0.0, parts = 0.0;
    for (size_t i = 0; i < static_cast<size_t>(n_ff); ++i) flips += std::fabs(wrow[i]) * D[i];
    if (has_mins(down.type)) {
      const size_t be = static_cast<size_t>(type_traits(down.type).block_elems);
      for (size_t b = 0; b < static_cast<size_t>(n_ff) / be; ++b) {  // per block: |P1| + |P2| + their change
        double p1 = 0.0, p2 = 0.0, change = 0.0;
        for (size_t i = b * be; i < (b + 1) * be; ++i) {
          const double scaled = static_cast<double>(wrow[i]) + mins[i];
          p1 += scaled * hv[i];
          p2 += static_cast<double>(mins[i]) * hv[i];
          change += (std::fabs(scaled) + std::fabs(mins[i])) * D[i];
        }
        parts += std::fabs(p1) + std::fabs(p2) + change;
        // Q8_1: the term is (W - m) . h + m * s, not W . h: |m| (|s' - s| + sum D) on top of flips.
        if (!s_moves.empty()) {
          double d_sum = 0.0;
          for (size_t i = b * be; i < (b + 1) * be; ++i) d_sum += D[i];
          flips += std::fabs(mins[b * be]) * (s_moves[b] + d_sum);
        }
      }
    }
    out.y[static_cast<size_t>(r)] = bd != nullptr ? y.value + bd[r] : y.value;
    out.tol[static_cast<size_t>(r)] =
        flips * (1.0 + 1e-3) + (2.0 * gamma(y.terms) + 8.0 * kU) * y.abs_terms + 8.0 * kU * parts;
    if (bd != nullptr) out.tol[static_cast<size_t>(r)] += 2.0 * kU * std::fabs(out.y[static_cast<size_t>(r)]);
  }
  return out;
}

// One case's random inputs and the host reference for every slot of a present expert.
struct HostCase {
  Kind gate, up, down;
  std::vector<float> x;
  std::vector<int32_t> chosen;
  std::vector<float> weight;
  std::vector<bool> present;
  std::vector<SlotRef> ref;
  std::mt19937 rng;  // where the case's random stream stands after the inputs
  std::vector<float> bg, bu, bd;   // Case::oss: [n_expert][n_ff], [n_expert][n_ff], [n_expert][n_embd]
};

HostCase make_host_case(const Case& c) {
  std::mt19937 rng(c.seed);
  // Routing: k distinct experts per token in random order, positive weights.
  const int n_slots = c.n_tokens * c.k;
  std::vector<int32_t> chosen(static_cast<size_t>(n_slots));
  std::vector<float> weight(static_cast<size_t>(n_slots));
  std::uniform_real_distribution<float> wdist(0.05f, 1.0f);
  std::vector<int32_t> ids(static_cast<size_t>(c.n_expert));
  std::iota(ids.begin(), ids.end(), 0);
  for (int t = 0; t < c.n_tokens; ++t) {
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int s = 0; s < c.k; ++s) {
      chosen[static_cast<size_t>(t * c.k + s)] = ids[static_cast<size_t>(s)];
      weight[static_cast<size_t>(t * c.k + s)] = wdist(rng);
    }
  }
  std::vector<bool> present(static_cast<size_t>(c.n_expert), true);
  if (c.slot_table)
    for (int e = 0; e < c.n_expert; e += 3) present[static_cast<size_t>(e)] = false;
  std::vector<bool> routed(static_cast<size_t>(c.n_expert), false);  // chosen and present: read by the kernel
  for (const int32_t e : chosen) routed[static_cast<size_t>(e)] = present[static_cast<size_t>(e)];
  Kind gate = make_kind(c.gate, c.n_expert, c.n_ff, c.n_embd, routed, rng);
  Kind up = make_kind(c.up, c.n_expert, c.n_ff, c.n_embd, routed, rng);
  Kind down = make_kind(c.down, c.n_expert, c.n_embd, c.n_ff, routed, rng);
  std::vector<float> x = scaled_values(rng, static_cast<size_t>(c.n_tokens * c.n_embd), 1e-1f);
  // gpt-oss's biases: wide (sd 5) so that gate and up cross the clamp at +-7 in many rows.
  std::vector<float> bg, bu, bd;
  if (c.oss) {
    bg = cuda_test::normal_values(rng, static_cast<size_t>(c.n_expert * c.n_ff), 5.0f);
    bu = cuda_test::normal_values(rng, static_cast<size_t>(c.n_expert * c.n_ff), 5.0f);
    bd = cuda_test::normal_values(rng, static_cast<size_t>(c.n_expert * c.n_embd), 1.0f);
  }

  // Host reference, once per slot whose expert is present.
  std::vector<SlotRef> ref(static_cast<size_t>(n_slots));
  parallel_for(n_slots, [&](int64_t i) {
    const int e = chosen[static_cast<size_t>(i)];
    if (!present[static_cast<size_t>(e)]) return;
    const float* xt = x.data() + (i / c.k) * c.n_embd;
    ref[static_cast<size_t>(i)] =
        c.oss ? reference_slot(gate, up, down, e, xt, bg.data() + e * c.n_ff, bu.data() + e * c.n_ff, bd.data() + e * c.n_embd)
              : reference_slot(gate, up, down, e, xt);
  });
  return {std::move(gate), std::move(up), std::move(down), std::move(x), std::move(chosen), std::move(weight),
          std::move(present), std::move(ref), rng, std::move(bg), std::move(bu), std::move(bd)};
}

// The weighted sum's reference (reference::moe_combine's accumulation) and its tolerance.
ExpectedSum reference_sum(const Case& c, const HostCase& h, int t, int64_t r) {
  float want = 0.0f;
  double tol = 0.0, mag = 0.0;
  for (int s = 0; s < c.k; ++s) {
    const size_t i = static_cast<size_t>(t * c.k + s);
    if (!h.present[static_cast<size_t>(h.chosen[i])]) continue;
    const float y = h.ref[i].y[static_cast<size_t>(r)];
    want += h.weight[i] * y;
    tol += std::fabs(h.weight[i]) * h.ref[i].tol[static_cast<size_t>(r)] * (1.0 + 2.0 * kU);
    mag += std::fabs(static_cast<double>(h.weight[i]) * y);
  }
  return {want, tol + 2.0 * gamma(c.k + 1) * mag};
}

// Slot-table mode's device weights: each present expert's three tensors at scattered places of
// dslabs (reverse expert order, slab bytes apart), as a VRAM cache's slabs would be, and the table.
void upload_slot_table(const Case& c, const HostCase& host, size_t slab, cuda::DeviceBuffer<uint8_t>& dslabs,
                       cuda::DeviceBuffer<cuda::MoeExpertSlot>& dtable) {
  const Kind &gate = host.gate, &up = host.up, &down = host.down;
  std::vector<cuda::MoeExpertSlot> table(static_cast<size_t>(c.n_expert));
  for (int e = 0; e < c.n_expert; ++e) {
    if (!host.present[static_cast<size_t>(e)]) continue;
    uint8_t* base = dslabs.get() + slab * static_cast<size_t>(c.n_expert - 1 - e);
    const size_t ug = (gate.expert_bytes() + 255) / 256 * 256, uu = (up.expert_bytes() + 255) / 256 * 256;
    CUDA_CHECK(cudaMemcpy(base, gate.row(e, 0), gate.expert_bytes(), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(base + ug, up.row(e, 0), up.expert_bytes(), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(base + ug + uu, down.row(e, 0), down.expert_bytes(), cudaMemcpyHostToDevice));
    table[static_cast<size_t>(e)] = {base, base + ug, base + ug + uu};
  }
  dtable.upload(table.data(), table.size());
}

// The slot rows (rows[row_of[i]] for slot i): the reference's within its tolerance for a present
// expert, untouched (NaN) for an absent one.
void expect_slot_rows(const Case& c, const HostCase& host, const std::vector<int32_t>& row_of,
                      const std::vector<float>& rows, const std::string& what) {
  for (int i = 0; i < c.n_tokens * c.k; ++i) {
    const float* got = rows.data() + static_cast<size_t>(row_of[static_cast<size_t>(i)]) * static_cast<size_t>(c.n_embd);
    const bool here = host.present[static_cast<size_t>(host.chosen[static_cast<size_t>(i)])];
    for (int64_t r = 0; r < c.n_embd; ++r) {
      if (!here) {
        ASSERT_TRUE(std::isnan(got[r])) << what << ": slot " << i << " of an absent expert was written";
        continue;
      }
      const SlotRef& s = host.ref[static_cast<size_t>(i)];
      ASSERT_TRUE(std::fabs(static_cast<double>(got[r]) - s.y[static_cast<size_t>(r)]) <= s.tol[static_cast<size_t>(r)])
          << what << ": slot " << i << " row " << r << ": got " << got[r] << ", reference "
          << s.y[static_cast<size_t>(r)] << ", tolerance " << s.tol[static_cast<size_t>(r)];
    }
  }
}

void run_case(const Case& c) {
  const HostCase host = make_host_case(c);
  const Kind &gate = host.gate, &up = host.up, &down = host.down;
  const std::vector<float>& x = host.x;
  const std::vector<int32_t>& chosen = host.chosen;
  const std::vector<float>& weight = host.weight;
  std::mt19937 rng = host.rng;
  const int n_slots = c.n_tokens * c.k;

  // Device weights. Slot-table mode: each present expert's three tensors at scattered places of
  // one buffer (reverse expert order, padded), as a VRAM cache's slabs would be.
  cuda::MoeLayerWeights w;
  w.gate_type = c.gate;
  w.up_type = c.up;
  w.down_type = c.down;
  w.n_embd = c.n_embd;
  w.n_ff = c.n_ff;
  w.n_expert = c.n_expert;
  cuda::DeviceBuffer<uint8_t> dgate(gate.bytes.size()), dup(up.bytes.size()), ddown(down.bytes.size());
  const size_t slab = (gate.expert_bytes() + up.expert_bytes() + down.expert_bytes() + 3 * 256) / 256 * 256 + 256;
  cuda::DeviceBuffer<uint8_t> dslabs(c.slot_table ? slab * static_cast<size_t>(c.n_expert) : 0);
  cuda::DeviceBuffer<cuda::MoeExpertSlot> dtable(static_cast<size_t>(c.n_expert));
  if (!c.slot_table) {
    dgate.upload(gate.bytes.data(), gate.bytes.size());
    dup.upload(up.bytes.data(), up.bytes.size());
    ddown.upload(down.bytes.data(), down.bytes.size());
    w.gate = dgate.get();
    w.up = dup.get();
    w.down = ddown.get();
  } else {
    upload_slot_table(c, host, slab, dslabs, dtable);
    w.slots = dtable.get();
  }

  cuda::DeviceBuffer<float> dbg(host.bg.size()), dbu(host.bu.size()), dbd(host.bd.size());
  if (c.oss) {
    dbg.upload(host.bg.data(), host.bg.size());
    dbu.upload(host.bu.data(), host.bu.size());
    dbd.upload(host.bd.data(), host.bd.size());
    w.gate_bias = dbg.get();
    w.up_bias = dbu.get();
    w.down_bias = dbd.get();
    w.swiglu_clamped = true;
    w.swiglu_alpha = kAlpha;
    w.swiglu_limit = kLimit;
  }
  cuda::DeviceBuffer<float> dx(x.size()), dweight(weight.size()), dsum(static_cast<size_t>(c.n_tokens * c.n_embd));
  cuda::DeviceBuffer<int32_t> dchosen(chosen.size());
  dx.upload(x.data(), x.size());
  dweight.upload(weight.data(), weight.size());
  dchosen.upload(chosen.data(), chosen.size());
  // Slot rows in a permuted order (as ExpertPlan::row_of packs them), NaN-poisoned like the sum.
  std::vector<int32_t> row_of(static_cast<size_t>(n_slots));
  std::iota(row_of.begin(), row_of.end(), 0);
  std::shuffle(row_of.begin(), row_of.end(), rng);
  cuda::DeviceBuffer<int32_t> drow_of(row_of.size());
  drow_of.upload(row_of.data(), row_of.size());
  cuda::DeviceBuffer<float> dslot_rows(static_cast<size_t>(n_slots) * static_cast<size_t>(c.n_embd));

  const size_t ws_bytes = cuda::moe_fused_workspace_bytes(w, cuda::kMoeMaxTokens, c.k);
  cuda::DeviceBuffer<uint8_t> ws(ws_bytes);
  cuda::moe_fused_workspace_init(ws.get(), ws_bytes);

  cuda::MoeRouting routing;
  routing.n_tokens = c.n_tokens;
  routing.k = c.k;
  routing.chosen = dchosen.get();
  routing.weight = dweight.get();
  cuda::MoeOutputs out;
  out.sum = dsum.get();
  if (c.slot_table) {
    out.slot_rows = dslot_rows.get();
    out.slot_row_of = drow_of.get();
  }

  // Twice per form: each second call checks that the first left the workspace's counters zeroed.
  using Form = cuda::MoeLayerWeights::Form;
  struct FormCase {
    const char* name;
    Form form;
    bool units;  // the kernel bench's warp-unit kernels (moe_fused_units.h)
  };
  const FormCase forms[] = {{"the best form (the backend's)", Form::kBest, false},
                            {"the tiled kernels", Form::kTiled, false},
                            {"the staged form where it fits", Form::kStaged, false},
                            {"the bench's warp-unit kernels", Form::kTiled, true}};
  // The form the case asks for: moe_fused, or the bench's warp units.
  auto call_form = [&](const FormCase& form) {
    w.form = form.form;
    w.programmatic_launch = !c.plain_launches;
    if (form.units) {
      kernel_bench::moe_fused_units(w, dx.get(), routing, out, ws.get(), ws_bytes);
    } else {
      cuda::moe_fused(w, dx.get(), routing, out, ws.get(), ws_bytes);
    }
  };
  for (int call = 0; call < 2 * static_cast<int>(std::size(forms)); ++call) {
    const FormCase& form = forms[call / 2];
    if (c.oss && form.units) continue;   // the bench's warp units have no biases or clamped SwiGLU
    dsum.fill_bytes(0xff);
    dslot_rows.fill_bytes(0xff);
    call_form(form);
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> sum(dsum.size()), rows(dslot_rows.size());
    dsum.download(sum.data(), sum.size());
    dslot_rows.download(rows.data(), rows.size());
    const std::string what = std::string(type_name(c.gate)) + "/" + std::string(type_name(c.up)) + "/" +
                             std::string(type_name(c.down)) + " n=" + std::to_string(c.n_tokens) + " experts=" +
                             std::to_string(c.n_expert) + " k=" + std::to_string(c.k) + " call " + std::to_string(call) +
                             " (" + form.name + ")";
    for (int t = 0; t < c.n_tokens; ++t) {
      for (int64_t r = 0; r < c.n_embd; ++r) {
        const ExpectedSum want = reference_sum(c, host, t, r);
        const float got = sum[static_cast<size_t>(t * c.n_embd + r)];
        ASSERT_TRUE(std::fabs(static_cast<double>(got) - want.value) <= want.tolerance)
            << what << ": sum token " << t << " row " << r << ": got " << got << ", reference " << want.value
            << ", tolerance " << want.tolerance;
      }
    }
    if (!c.slot_table) continue;
    expect_slot_rows(c, host, row_of, rows, what);
    if (::testing::Test::HasFatalFailure()) return;
  }

  // MoeOutputs::sum_accumulate, per form: sum starts as random residual values b and
  // must become fl(b + a), a the weighted sum: |got - (b + want)| <= tol + u |b + a|, with
  // |a - want| <= tol, so u (|b + want| + tol) bounds the addition's rounding.
  std::vector<float> base(dsum.size());
  for (float& v : base) v = std::normal_distribution<float>(0.0f, 4.0f)(rng);
  for (const FormCase& form : forms) {
    if (c.oss && form.units) continue;
    out.sum_accumulate = true;
    dsum.upload(base.data(), base.size());
    call_form(form);
    CUDA_CHECK(cudaDeviceSynchronize());
    out.sum_accumulate = false;
    std::vector<float> sum(dsum.size());
    dsum.download(sum.data(), sum.size());
    for (int t = 0; t < c.n_tokens; ++t) {
      for (int64_t r = 0; r < c.n_embd; ++r) {
        const size_t i = static_cast<size_t>(t * c.n_embd + r);
        const ExpectedSum want = reference_sum(c, host, t, r);
        const double expect = static_cast<double>(base[i]) + want.value;
        const double tol = want.tolerance + kU * (std::fabs(expect) + want.tolerance);
        ASSERT_TRUE(std::fabs(static_cast<double>(sum[i]) - expect) <= tol)
            << type_name(c.gate) << " n=" << c.n_tokens << " accumulate ("
            << form.name
            << "): token " << t << " row " << r << ": got " << sum[i] << ", residual " << base[i] << " + reference "
            << want.value << ", tolerance " << tol;
      }
    }
  }
}

class CudaMoeFused : public ::testing::TestWithParam<TensorType> {};

// Decode and verify sizes, odd expert counts; 16 tokens over 7 experts puts up to 16 tokens on
// one expert (one weight read serving them all).
TEST_P(CudaMoeFused, WholeTensorsMatchReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const TensorType t = GetParam();
  run_case({t, t, t, 1, 13, 4, 512, 256, false, 11});
  run_case({t, t, t, 3, 31, 10, 512, 256, false, 12});
  run_case({t, t, t, 8, 13, 4, 512, 256, false, 13});
  run_case({t, t, t, 16, 7, 3, 256, 512, false, 14});
}

TEST_P(CudaMoeFused, SlotTableWithAbsentExpertsMatchesReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const TensorType t = GetParam();
  run_case({t, t, t, 1, 9, 4, 512, 256, true, 21});
  run_case({t, t, t, 8, 11, 4, 512, 256, true, 22});
  run_case({t, t, t, 16, 13, 5, 256, 256, true, 23});
  // The golden models' shape (tests/golden *_k256): one 256-block per row, 4 experts, decode.
  run_case({t, t, t, 1, 4, 2, 256, 256, true, 24});
}

INSTANTIATE_TEST_SUITE_P(Formats, CudaMoeFused,
                         ::testing::Values(TensorType::Q8_0, TensorType::Q2_K, TensorType::Q3_K, TensorType::Q4_K,
                                           TensorType::Q5_K, TensorType::Q6_K, TensorType::MXFP4,
                                           // issue 26 (matvec_formats_legacy.cuh)
                                           TensorType::Q4_0, TensorType::Q4_1, TensorType::Q5_0, TensorType::Q5_1,
                                           TensorType::IQ4_NL, TensorType::IQ4_XS, TensorType::TQ1_0,
                                           TensorType::TQ2_0),
                         [](const auto& p) { return std::string(type_name(p.param)); });

// The importance-matrix grid formats (matvec_formats_iq.cuh) on random blocks. IQ1's delta is
// part of each dequantized weight (not a separate min), so the non-min bound above covers it.
INSTANTIATE_TEST_SUITE_P(IqFormats, CudaMoeFused, ::testing::ValuesIn(cuda_test::kIqGridTypes),
                         [](const auto& p) { return std::string(type_name(p.param)); });

// IQ gate and up of different formats (each row through dot_staged), an IQ or K-quant down, and
// IQ beside Q8_0 (x quantized twice): what a UD hub file mixes per tensor. The last two put an IQ
// up after a K-quant and an issue 26 gate: the tiled kernel 1's copy must be one with dot_staged's
// IQ cases (moe_fused.cu's launch_tiled_gate_up), else up's dots are NaN.
TEST(CudaMoeFusedMixed, MixedIqFormatsMatchReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  run_case({TensorType::IQ2_XXS, TensorType::IQ3_S, TensorType::IQ1_M, 3, 9, 4, 512, 256, false, 41});
  run_case({TensorType::IQ1_S, TensorType::IQ2_S, TensorType::Q4_K, 8, 11, 6, 512, 256, true, 42});
  run_case({TensorType::IQ3_XXS, TensorType::Q8_0, TensorType::IQ2_XS, 1, 7, 3, 256, 512, true, 43});
  run_case({TensorType::Q4_K, TensorType::IQ2_S, TensorType::Q6_K, 3, 9, 4, 512, 256, false, 44});
  run_case({TensorType::Q4_0, TensorType::IQ1_S, TensorType::IQ4_XS, 2, 9, 4, 512, 256, true, 45});
}

// Gate and up quantize x differently (Q8_K and Q8_0), down takes Q8_0 h: three formats at once.
TEST(CudaMoeFusedMixed, MixedFormatsMatchReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  run_case({TensorType::Q4_K, TensorType::Q8_0, TensorType::MXFP4, 3, 9, 4, 512, 256, false, 31});
  run_case({TensorType::MXFP4, TensorType::Q6_K, TensorType::Q5_K, 8, 11, 6, 512, 256, true, 32});
}

// Issue 26's formats mixed: gate and up quantizing x as Q8_1 and Q8_0 (kernel 1 keeps two copies
// of x), Q8_1 and Q8_K h for down, IQ4_XS's per-sub-block terms beside 32-element formats.
TEST(CudaMoeFusedMixed, LegacyAndIq4FormatsMixedMatchReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  run_case({TensorType::Q4_1, TensorType::Q4_0, TensorType::IQ4_XS, 3, 9, 4, 512, 256, false, 33});
  run_case({TensorType::IQ4_NL, TensorType::Q5_1, TensorType::Q5_1, 2, 11, 6, 512, 256, true, 34});
  run_case({TensorType::IQ4_XS, TensorType::Q5_0, TensorType::Q4_1, 4, 13, 4, 768, 512, false, 35, true});
}

// Wide rows and many distinct experts: the tiled kernel 1's grid has fewer CTAs per row tile than
// experts, so each CTA serves several experts in turn (the next one's rows prefetched), and the
// warp-unit kernels' warps take several units each (~1.7 gate/up units per warp here).
TEST(CudaMoeFusedMixed, SeveralExpertsPerCtaMatchReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  run_case({TensorType::Q4_K, TensorType::Q4_K, TensorType::Q6_K, 4, 61, 8, 2048, 512, false, 41});
  run_case({TensorType::Q8_0, TensorType::Q8_0, TensorType::Q8_0, 4, 61, 8, 2048, 512, true, 42});
}

// The staged kernels built per shape (moe_staged.cu: Q4_K gate/up rows of 2048; Q4_K and Q6_K down
// rows of 768 and 512), each against the reference: the 30B-A3B and Qwen3-Next expert sizes with
// a Q6_K down (Q4_K_M files), one and two tokens, slot table and plain tensors.
TEST(CudaMoeFusedMixed, PerShapeStagedKernelsMatchReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  run_case({TensorType::Q4_K, TensorType::Q4_K, TensorType::Q6_K, 1, 24, 8, 2048, 768, true, 43});
  run_case({TensorType::Q4_K, TensorType::Q4_K, TensorType::Q6_K, 2, 24, 8, 2048, 768, false, 44});
  run_case({TensorType::Q4_K, TensorType::Q4_K, TensorType::Q4_K, 2, 24, 10, 2048, 512, true, 45});
}

// gpt-oss's experts (biases on gate, up and down, the clamped SwiGLU: moe_fused's kOss kernels) in
// the formats its files carry (MXFP4 as released, Q4_K / Q8_0 requantized), the 20b shape's k = 4
// of 32 experts at decode and verify sizes, slot table with absent experts and whole tensors.
TEST(CudaMoeFusedOss, BiasedClampedSwigluMatchesReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  for (const TensorType t : {TensorType::MXFP4, TensorType::Q4_K, TensorType::Q8_0}) {
    run_case({t, t, t, 1, 32, 4, 512, 256, false, 61, false, true});
    run_case({t, t, t, 5, 32, 4, 256, 512, true, 62, false, true});
  }
  run_case({TensorType::MXFP4, TensorType::MXFP4, TensorType::Q8_0, 16, 8, 2, 256, 256, true, 63, false, true});
  // gpt-oss-20b's row width (2880: 90 MXFP4 blocks, kernel 1's per-row dot_staged path) and gate /
  // up of different formats (the same path).
  run_case({TensorType::MXFP4, TensorType::MXFP4, TensorType::MXFP4, 2, 32, 4, 2880, 256, false, 64, false, true});
  run_case({TensorType::MXFP4, TensorType::Q8_0, TensorType::Q4_K, 3, 9, 4, 512, 256, true, 65, false, true});
}

// Every form with plain launches (what devices below sm_90 run, and what compute-sanitizer can
// check: under memcheck the programmatic launches were refused with cudaErrorInvalidValue).
TEST(CudaMoeFusedMixed, PlainLaunchesMatchReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  run_case({TensorType::Q4_K, TensorType::Q4_K, TensorType::Q4_K, 3, 13, 4, 512, 256, true, 51, true});
  run_case({TensorType::Q8_0, TensorType::Q8_0, TensorType::Q8_0, 2, 9, 3, 512, 256, false, 52, true});
}

// The staged form (MoeLayerWeights::Form, moe_staged.cu) against the tiled kernels on the same inputs:
// equal bits, since it adds the same per-block terms in the same order per row, forms h with the
// same expression, quantizes it with the same warp quantizer and adds the slots in top-k order.
// At the model shapes it is made for (Qwen3-30B-A3B, and Qwen3-Next's 512 experts top-10 with a
// 512-row FFN), 1, 2 and 4 tokens (where it runs: at one token it must; past its shared memory it
// falls back to the tiled kernels); the sum, the accumulated sum and the slot rows, every
// output NaN-poisoned first and checked written. Weights: each (expert, row) a random pick among
// 64 quantized random rows (quantizing every chosen expert's 1.5M weights per matrix would cost
// the host about a minute per case); a kernel reading a wrong row or expert gets another row's
// values. Only the chosen experts' bytes are uploaded (the rest of the tensors are zero).
struct BitsShape {
  const char* name;
  TensorType type;
  int64_t n_embd, n_ff;
  int n_expert, k;
};

// One kind's tensor of all experts on the device, the chosen experts filled from templates.
cuda::DeviceBuffer<uint8_t> template_tensor(TensorType t, int64_t rows, int64_t cols, int n_expert,
                                            const std::vector<bool>& chosen, std::mt19937& rng) {
  constexpr int kTemplates = 64;
  const size_t rb = row_bytes(t, cols);
  std::vector<uint8_t> templ(rb * kTemplates);
  for (int r = 0; r < kTemplates; ++r) {
    const std::vector<float> v = scaled_values(rng, static_cast<size_t>(cols), 1e-3f);
    quantize_row(t, v.data(), templ.data() + static_cast<size_t>(r) * rb, cols);
  }
  const size_t expert_bytes = rb * static_cast<size_t>(rows);
  cuda::DeviceBuffer<uint8_t> d(expert_bytes * static_cast<size_t>(n_expert));
  d.fill_bytes(0);
  std::vector<uint8_t> host(expert_bytes);
  std::uniform_int_distribution<int> pick(0, kTemplates - 1);
  for (int e = 0; e < n_expert; ++e) {
    if (!chosen[static_cast<size_t>(e)]) continue;
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(host.data() + static_cast<size_t>(r) * rb, templ.data() + static_cast<size_t>(pick(rng)) * rb, rb);
    CUDA_CHECK(cudaMemcpy(d.get() + expert_bytes * static_cast<size_t>(e), host.data(), expert_bytes,
                          cudaMemcpyHostToDevice));
  }
  return d;
}

void expect_staged_bits(const BitsShape& s, int n_tokens, uint32_t seed, bool must_apply) {
  std::mt19937 rng(seed);
  const int n_slots = n_tokens * s.k;
  std::vector<int32_t> chosen(static_cast<size_t>(n_slots));
  std::vector<float> weight(static_cast<size_t>(n_slots));
  std::uniform_real_distribution<float> wdist(0.05f, 1.0f);
  std::vector<int32_t> ids(static_cast<size_t>(s.n_expert));
  std::iota(ids.begin(), ids.end(), 0);
  std::vector<bool> used(static_cast<size_t>(s.n_expert), false);
  for (int t = 0; t < n_tokens; ++t) {
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int j = 0; j < s.k; ++j) {
      chosen[static_cast<size_t>(t * s.k + j)] = ids[static_cast<size_t>(j)];
      weight[static_cast<size_t>(t * s.k + j)] = wdist(rng);
      used[static_cast<size_t>(ids[static_cast<size_t>(j)])] = true;
    }
  }
  cuda::DeviceBuffer<uint8_t> dgate = template_tensor(s.type, s.n_ff, s.n_embd, s.n_expert, used, rng);
  cuda::DeviceBuffer<uint8_t> dup = template_tensor(s.type, s.n_ff, s.n_embd, s.n_expert, used, rng);
  cuda::DeviceBuffer<uint8_t> ddown = template_tensor(s.type, s.n_embd, s.n_ff, s.n_expert, used, rng);
  const std::vector<float> x = scaled_values(rng, static_cast<size_t>(n_tokens * s.n_embd), 1e-1f);
  std::vector<float> base(x.size());
  for (float& v : base) v = std::normal_distribution<float>(0.0f, 4.0f)(rng);
  std::vector<int32_t> row_of(static_cast<size_t>(n_slots));
  std::iota(row_of.begin(), row_of.end(), 0);
  std::shuffle(row_of.begin(), row_of.end(), rng);

  cuda::MoeLayerWeights w;
  w.gate_type = w.up_type = w.down_type = s.type;
  w.n_embd = s.n_embd;
  w.n_ff = s.n_ff;
  w.n_expert = s.n_expert;
  w.gate = dgate.get();
  w.up = dup.get();
  w.down = ddown.get();
  const std::string what = std::string(s.name) + " " + std::string(type_name(s.type)) + " n=" + std::to_string(n_tokens);
  using Form = cuda::MoeLayerWeights::Form;
  w.form = Form::kStaged;
  const bool applies = cuda::moe_fused_staged_applies(w, n_tokens, s.k);
  if (must_apply) {
    ASSERT_TRUE(applies) << what << ": the staged form must run at this shape";
  }
  // What the backend asks for: the planner declines where the form measured slower (Q8_0
  // experts, moe_staged_plan) and takes the rest wherever it fits; tiled means tiled.
  w.form = Form::kBest;
  EXPECT_EQ(cuda::moe_fused_staged_applies(w, n_tokens, s.k), applies && s.type != TensorType::Q8_0) << what;
  w.form = Form::kTiled;
  EXPECT_FALSE(cuda::moe_fused_staged_applies(w, n_tokens, s.k)) << what;
  cuda::DeviceBuffer<float> dx(x.size()), dweight(weight.size()), dsum(x.size());
  cuda::DeviceBuffer<float> dslot_rows(static_cast<size_t>(n_slots) * static_cast<size_t>(s.n_embd));
  cuda::DeviceBuffer<int32_t> dchosen(chosen.size()), drow_of(row_of.size());
  dx.upload(x.data(), x.size());
  dweight.upload(weight.data(), weight.size());
  dchosen.upload(chosen.data(), chosen.size());
  drow_of.upload(row_of.data(), row_of.size());
  const size_t ws_bytes = cuda::moe_fused_workspace_bytes(w, n_tokens, s.k);
  cuda::DeviceBuffer<uint8_t> ws(ws_bytes);
  cuda::moe_fused_workspace_init(ws.get(), ws_bytes);
  cuda::MoeRouting routing;
  routing.n_tokens = n_tokens;
  routing.k = s.k;
  routing.chosen = dchosen.get();
  routing.weight = dweight.get();

  // Outputs of one form: sum, slot rows, then the sum accumulated onto `base`.
  auto run = [&](Form f, std::vector<float>& sum, std::vector<float>& rows, std::vector<float>& acc) {
    w.form = f;
    cuda::MoeOutputs out;
    out.sum = dsum.get();
    out.slot_rows = dslot_rows.get();
    out.slot_row_of = drow_of.get();
    dsum.fill_bytes(0xff);
    dslot_rows.fill_bytes(0xff);
    cuda::moe_fused(w, dx.get(), routing, out, ws.get(), ws_bytes);
    CUDA_CHECK(cudaDeviceSynchronize());
    sum.resize(dsum.size());
    rows.resize(dslot_rows.size());
    dsum.download(sum.data(), sum.size());
    dslot_rows.download(rows.data(), rows.size());
    out.slot_rows = nullptr;
    out.slot_row_of = nullptr;
    out.sum_accumulate = true;
    dsum.upload(base.data(), base.size());
    cuda::moe_fused(w, dx.get(), routing, out, ws.get(), ws_bytes);
    CUDA_CHECK(cudaDeviceSynchronize());
    acc.resize(dsum.size());
    dsum.download(acc.data(), acc.size());
  };
  std::vector<float> sum0, rows0, acc0, sum1, rows1, acc1;
  run(Form::kTiled, sum0, rows0, acc0);
  std::string form;
  auto same_bits = [&](const char* name, const std::vector<float>& a, const std::vector<float>& b) {
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(std::isfinite(a[i])) << what << " " << name << "[" << i << "]: the tiled kernels left " << a[i];
      uint32_t ua, ub;
      std::memcpy(&ua, &a[i], 4);
      std::memcpy(&ub, &b[i], 4);
      ASSERT_EQ(ua, ub) << what << " (" << form << (applies ? "" : ", falls back") << ") " << name << "[" << i
                        << "]: tiled " << a[i] << ", " << form << " " << b[i];
    }
  };
  // The staged form wherever it fits, and the backend's choice.
  for (const Form f : {Form::kStaged, Form::kBest}) {
    form = f == Form::kStaged ? "staged" : "best";
    run(f, sum1, rows1, acc1);
    same_bits("sum", sum0, sum1);
    same_bits("slot rows", rows0, rows1);
    same_bits("accumulated sum", acc0, acc1);
  }
}

TEST(CudaMoeFusedStaged, SameBitsAsTiledAtModelShapes) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const BitsShape shapes[] = {{"qwen3-30b-a3b", TensorType::Q4_K, 2048, 768, 128, 8},
                              {"qwen3-30b-a3b", TensorType::Q8_0, 2048, 768, 128, 8},
                              {"qwen3-next", TensorType::Q4_K, 2048, 512, 512, 10}};
  uint32_t seed = 61;
  for (const BitsShape& s : shapes)
    for (int n : {1, 2, 4}) expect_staged_bits(s, n, seed++, n == 1);
}

// Argument checks come before any CUDA call, so these run without a device too.
TEST(CudaMoeFusedArguments, RejectsBadShapesFormatsAndWorkspaces) {
  cuda::MoeLayerWeights w;
  w.gate_type = w.up_type = w.down_type = TensorType::Q4_K;
  w.n_embd = 512;
  w.n_ff = 256;
  w.n_expert = 8;
  const auto fake = reinterpret_cast<const void*>(uintptr_t{256});
  w.gate = w.up = w.down = fake;
  EXPECT_NO_THROW(cuda::moe_fused_check(w));
  cuda::MoeLayerWeights bad = w;
  bad.down_type = TensorType::Q8_K;  // an activation format: no matvec kernel
  EXPECT_THROW(cuda::moe_fused_check(bad), std::invalid_argument);
  for (const TensorType t : cuda_test::kIqGridTypes) {  // the grid formats pass the check
    cuda::MoeLayerWeights iq = w;
    iq.gate_type = iq.up_type = iq.down_type = t;
    EXPECT_NO_THROW(cuda::moe_fused_check(iq)) << type_name(t);
  }
  bad = w;
  bad.n_ff = 200;  // not a multiple of 256
  EXPECT_THROW(cuda::moe_fused_check(bad), std::invalid_argument);
  bad = w;
  bad.gate = reinterpret_cast<const void*>(uintptr_t{260});  // misaligned
  EXPECT_THROW(cuda::moe_fused_check(bad), std::invalid_argument);
  bad = w;
  bad.up = nullptr;  // neither a slot table nor all three tensors
  EXPECT_THROW(cuda::moe_fused_check(bad), std::invalid_argument);
  EXPECT_THROW(cuda::moe_fused_workspace_bytes(w, 17, 8), std::invalid_argument);
  EXPECT_THROW(cuda::moe_fused_workspace_bytes(w, 1, 0), std::invalid_argument);

  cuda::MoeRouting routing;
  routing.n_tokens = 2;
  routing.k = 4;
  routing.chosen = reinterpret_cast<const int32_t*>(fake);
  routing.weight = reinterpret_cast<const float*>(fake);
  cuda::MoeOutputs out;
  out.sum = reinterpret_cast<float*>(uintptr_t{256});
  const auto x = reinterpret_cast<const float*>(fake);
  const size_t need = cuda::moe_fused_workspace_bytes(w, 2, 4);
  void* ws = reinterpret_cast<void*>(uintptr_t{4096});
  EXPECT_THROW(cuda::moe_fused(w, x, routing, out, ws, need - 1, nullptr), std::invalid_argument);  // too small
  cuda::MoeRouting many = routing;
  many.n_tokens = 17;
  EXPECT_THROW(cuda::moe_fused(w, x, many, out, ws, 1 << 30, nullptr), std::invalid_argument);
  cuda::MoeOutputs none;
  EXPECT_THROW(cuda::moe_fused(w, x, routing, none, ws, 1 << 30, nullptr), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
