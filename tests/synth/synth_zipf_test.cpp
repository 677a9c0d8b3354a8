// The routers of a synthetic file make expert popularity follow a Zipf law of the asked
// exponent. Checked directly from the file's tensors, with this model of the router's input:
//
//   h = the embedding row of a random token (which carries the file's constant "massive"
//       coordinate), plus N(0, 0.2 * (l + 0.5) / n_layer) on every other coordinate for what
//       the blocks before layer l added (0.2 over the depth: measured from llama.cpp's final
//       logits, see SynthLlama), except the slow subspace S (moraine.synth.slow_dim_*), which
//       the embedding leaves at zero and each attention layer's recency heads add
//       moraine.synth.slow_variance / (number of attention layers) of variance to
//       (tools/synth/router_locality.h);
//   router input = RMSNorm(h) * the layer's ffn_norm / post_attention_norm weight.
//
// Top-k of (router * input) over 4096 to 65536 such tokens gives per-expert counts; sorted, their
// log-log slope against rank must be -S where the Zipf law is not capped at one pick per token.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "common/gguf/gguf.h"
#include "synth_run.h"
#include "tests/interop/llama_oracle.h"

namespace moraine::test {
namespace {

using gguf::GgufFile;
using gguf::TensorInfo;

std::vector<float> row_of(const TensorInfo& t, int64_t r) {
  const int64_t n = t.shape[0];
  std::vector<float> out(static_cast<size_t>(n));
  dequantize_row(t.type, t.data + row_bytes(t.type, n) * static_cast<size_t>(r), out.data(), n);
  return out;
}

// Least-squares slope of log(count) against log(rank), ranks 1-based, over [first, last).
double loglog_slope(const std::vector<double>& sorted_counts, size_t first, size_t last) {
  double sx = 0, sy = 0, sxx = 0, sxy = 0, n = 0;
  for (size_t r = first; r < last; ++r) {
    if (sorted_counts[r] <= 0) continue;
    const double x = std::log(static_cast<double>(r + 1)), y = std::log(sorted_counts[r]);
    sx += x, sy += y, sxx += x * x, sxy += x * y, n += 1;
  }
  return (n * sxy - sx * sy) / (n * sxx - sx * sx);
}

// Picks per token of each rank under Zipf(s) capped at 1, summing to k (bisection on the scale).
std::vector<double> capped_zipf(int64_t E, int64_t k, double s) {
  auto at = [&](double c, int64_t r) { return std::min(1.0, c * std::pow(static_cast<double>(r + 1), -s)); };
  double lo = 0, hi = 1e6;
  for (int it = 0; it < 200; ++it) {
    const double c = 0.5 * (lo + hi);
    double t = 0;
    for (int64_t r = 0; r < E; ++r) t += at(c, r);
    (t < static_cast<double>(k) ? lo : hi) = c;
  }
  std::vector<double> p(static_cast<size_t>(E));
  for (int64_t r = 0; r < E; ++r) p[static_cast<size_t>(r)] = at(hi, r);
  return p;
}

struct LayerCounts {
  std::vector<double> sorted;  // per-expert picks per token, descending
  int64_t hottest = -1;
};

LayerCounts route(const GgufFile& f, const std::string& arch, int64_t layer, int64_t n_tokens, std::mt19937_64& rng) {
  const int64_t L = static_cast<int64_t>(*f.get_u64(arch + ".block_count"));
  const int64_t k = static_cast<int64_t>(*f.get_u64(arch + ".expert_used_count"));
  const double eps = *f.get_f64(arch + ".attention.layer_norm_rms_epsilon");
  const TensorInfo& embd = *f.find_tensor("token_embd.weight");
  const std::string b = "blk." + std::to_string(layer) + ".";
  const TensorInfo& router = *f.find_tensor(b + "ffn_gate_inp.weight");
  const TensorInfo* norm = f.find_tensor(b + (arch == "qwen3next" ? "post_attention_norm.weight" : "ffn_norm.weight"));
  const int64_t H = router.shape[0], E = router.shape[1];
  const int64_t massive = static_cast<int64_t>(*f.get_u64("moraine.synth.massive_dim"));
  const std::vector<float> g = row_of(*norm, 0);
  std::vector<std::vector<float>> W;
  for (int64_t e = 0; e < E; ++e) W.push_back(row_of(router, e));

  const double added_var = 0.2 * (static_cast<double>(layer) + 0.5) / static_cast<double>(L);
  std::normal_distribution<double> normal(0.0, std::sqrt(added_var));
  const int64_t s0 = static_cast<int64_t>(*f.get_u64("moraine.synth.slow_dim_first"));
  const int64_t sn = static_cast<int64_t>(*f.get_u64("moraine.synth.slow_dim_count"));
  const int64_t interval = arch == "qwen3next" ? static_cast<int64_t>(*f.get_u64(arch + ".full_attention_interval")) : 1;
  int64_t attn_total = 0, attn_upto = 0;
  for (int64_t il = 0; il < L; ++il) {
    const bool attn = (il + 1) % interval == 0;
    attn_total += attn;
    attn_upto += attn && il <= layer;
  }
  const double slow_final = *f.get_f64("moraine.synth.slow_variance");
  std::normal_distribution<double> slow(0.0, std::sqrt(slow_final * static_cast<double>(attn_upto) / static_cast<double>(attn_total)));
  std::uniform_int_distribution<int64_t> pick(0, embd.shape[1] - 1);
  std::vector<double> count(static_cast<size_t>(E), 0.0);
  std::vector<double> x(static_cast<size_t>(H)), logit(static_cast<size_t>(E));
  std::vector<int64_t> order(static_cast<size_t>(E));
  for (int64_t t = 0; t < n_tokens; ++t) {
    const std::vector<float> h = row_of(embd, pick(rng));
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) {
      const bool in_s = i >= s0 && i < s0 + sn;
      x[static_cast<size_t>(i)] = in_s ? slow(rng) : h[static_cast<size_t>(i)] + (i == massive ? 0.0 : normal(rng));
      ss += x[static_cast<size_t>(i)] * x[static_cast<size_t>(i)];
    }
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(H) + eps);
    for (int64_t i = 0; i < H; ++i) x[static_cast<size_t>(i)] *= inv * g[static_cast<size_t>(i)];
    for (int64_t e = 0; e < E; ++e) {
      double d = 0;
      for (int64_t i = 0; i < H; ++i) d += W[static_cast<size_t>(e)][static_cast<size_t>(i)] * x[static_cast<size_t>(i)];
      logit[static_cast<size_t>(e)] = d;
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t c) { return logit[static_cast<size_t>(a)] > logit[static_cast<size_t>(c)]; });
    for (int64_t i = 0; i < k; ++i) count[static_cast<size_t>(order[static_cast<size_t>(i)])] += 1.0;
  }
  LayerCounts out;
  out.hottest = std::max_element(count.begin(), count.end()) - count.begin();
  for (double& c : count) c /= static_cast<double>(n_tokens);
  std::sort(count.begin(), count.end(), std::greater<>());
  out.sorted = count;
  return out;
}

struct Case {
  std::string shape_args;
  std::string arch;
};

void check_zipf(const Case& c, double s, int64_t n_tokens) {
  ScratchDir dir("synth-zipf");
  const std::string path = dir.file("z.gguf");
  char zipf[32];
  std::snprintf(zipf, sizeof zipf, "%g", s);
  const SynthRun r = run_synth(c.shape_args + " --vocab-size 16384 --seed 5 --zipf " + zipf + " -o " + path, dir.path());
  ASSERT_EQ(r.status, 0) << r.err;
  const GgufFile f = GgufFile::open(path);
  const int64_t L = static_cast<int64_t>(*f.get_u64(c.arch + ".block_count"));
  const int64_t E = static_cast<int64_t>(*f.get_u64(c.arch + ".expert_count"));
  const int64_t k = static_cast<int64_t>(*f.get_u64(c.arch + ".expert_used_count"));
  const std::vector<double> target = capped_zipf(E, k, s);
  // Fit where the law is not capped at one pick per token.
  size_t first = 0;
  while (first < target.size() && target[first] > 0.95) ++first;

  std::mt19937_64 rng(1234);
  std::set<int64_t> hottest;
  for (int64_t layer : {int64_t{0}, L - 1}) {
    SCOPED_TRACE("layer " + std::to_string(layer));
    const LayerCounts lc = route(f, c.arch, layer, n_tokens, rng);
    hottest.insert(lc.hottest);
    const double slope = loglog_slope(lc.sorted, first, lc.sorted.size());
    std::printf("%s zipf %.1f layer %lld: slope %.3f (ranks %zu..%zu), top picks/token %.3f (target %.3f), "
                "least %.4f (target %.4f)\n",
                c.shape_args.c_str(), s, static_cast<long long>(layer), slope, first + 1, lc.sorted.size(),
                lc.sorted[0], target[0], lc.sorted.back(), target.back());
    EXPECT_NEAR(slope, -s, 0.1);
    if (s > 0) {
      EXPECT_NEAR(lc.sorted[first], target[first], 0.2 * target[first]);
    } else {
      EXPECT_LT(lc.sorted.front() / lc.sorted.back(), 1.4);  // flat, up to sampling noise
    }
  }
  // The hot expert differs between layers (a popularity permutation per layer).
  if (s > 0) {
    EXPECT_EQ(hottest.size(), 2u);
  }
}

const Case kMoe{"--shape qwen3moe-tiny --layers 4 --experts 64", "qwen3moe"};           // top-2 of 64
const Case kNext{"--shape qwen3next-tiny --layers 4 --experts 64", "qwen3next"};        // top-4 of 64
const Case kMoe30b{"--shape qwen3moe-30b-a3b --layers 2 --map _exps.=q4_0", "qwen3moe"};  // top-8 of 128

// Tokens are drawn from 16384 embedding rows; uniform routing needs the most of them, since
// sorting noisy counts alone makes a negative slope.
TEST(SynthZipf, QwenMoeTinyZipfOne) { check_zipf(kMoe, 1.0, 16384); }
TEST(SynthZipf, QwenMoeTinyUniform) { check_zipf(kMoe, 0.0, 65536); }
TEST(SynthZipf, QwenNextTinyZipfOne) { check_zipf(kNext, 1.0, 16384); }
TEST(SynthZipf, QwenNextTinySteeper) { check_zipf(kNext, 1.5, 16384); }
// The real 30B router: top-8 of 128 at S = 1 caps the hottest expert at one pick per token.
TEST(SynthZipf, QwenMoe30bZipfOne) { check_zipf(kMoe30b, 1.0, 4096); }

}  // namespace
}  // namespace moraine::test
