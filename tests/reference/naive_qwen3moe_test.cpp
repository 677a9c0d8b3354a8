// An independent, deliberately naive qwen3moe forward in double precision, reading weights by
// name straight from the GGUF (not through moraine_model's binding), against the reference
// executor. Covers what the transformers goldens do not: norm_topk_prob = false
// (expert_weights_norm) and the loader's tensor conventions, on fresh random weights.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <complex>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "common/gguf/gguf.h"
#include "common/model/model.h"
#include "common/reference/executor.h"
#include "synthetic_model.h"

namespace moraine::testing {
namespace {

using Vec = std::vector<double>;

struct Naive {
  const gguf::GgufFile& f;
  SyntheticSpec s;
  bool norm_topk;

  // Rows of a tensor as doubles: W[r][c] with c the contiguous (ggml shape[0]) index.
  std::vector<Vec> rows(const std::string& name, int64_t first_row, int64_t n_rows) const {
    const gguf::TensorInfo* t = f.find_tensor(name);
    if (t == nullptr) throw std::runtime_error("naive: no tensor " + name);
    const int64_t cols = t->shape[0];
    std::vector<Vec> out;
    std::vector<float> tmp(cols);
    for (int64_t r = first_row; r < first_row + n_rows; ++r) {
      dequantize_row(t->type, t->data + r * row_bytes(t->type, cols), tmp.data(), cols);
      out.emplace_back(tmp.begin(), tmp.end());
    }
    return out;
  }
  std::vector<Vec> mat(const std::string& name) const {
    const gguf::TensorInfo* t = f.find_tensor(name);
    return rows(name, 0, t->n_rows());
  }
  Vec vec(const std::string& name) const { return mat(name)[0]; }

  static Vec mv(const std::vector<Vec>& W, const Vec& x) {
    Vec y(W.size());
    for (size_t r = 0; r < W.size(); ++r) y[r] = std::inner_product(W[r].begin(), W[r].end(), x.begin(), 0.0);
    return y;
  }
  Vec rms(const Vec& x, const Vec& w, size_t off = 0, size_t n = 0) const {
    if (n == 0) n = x.size();
    double ss = 0;
    for (size_t i = 0; i < n; ++i) ss += x[off + i] * x[off + i];
    const double inv = 1.0 / std::sqrt(ss / n + 1e-6);
    Vec y(n);
    for (size_t i = 0; i < n; ++i) y[i] = x[off + i] * inv * w[i];
    return y;
  }
  void rope(Vec& h, int64_t pos) const {
    const int64_t half = s.n_rot / 2;
    for (int64_t i = 0; i < half; ++i) {
      std::complex<double> z(h[i], h[i + half]);
      z *= std::polar(1.0, pos * std::pow(10000.0, -2.0 * i / s.n_rot));
      h[i] = z.real();
      h[i + half] = z.imag();
    }
  }
  static std::string blk(int64_t l, const char* n) { return "blk." + std::to_string(l) + "." + n; }

  std::vector<Vec> forward(const std::vector<int32_t>& tokens) const {
    const int64_t T = static_cast<int64_t>(tokens.size()), hd = s.head_dim, E = s.n_embd;
    std::vector<Vec> x;
    for (int32_t id : tokens) x.push_back(rows("token_embd.weight", id, 1)[0]);
    for (int64_t l = 0; l < s.n_layer; ++l) {
      const auto Wq = mat(blk(l, "attn_q.weight")), Wk = mat(blk(l, "attn_k.weight")),
                 Wv = mat(blk(l, "attn_v.weight")), Wo = mat(blk(l, "attn_output.weight"));
      const Vec qn = vec(blk(l, "attn_q_norm.weight")), kn = vec(blk(l, "attn_k_norm.weight"));
      std::vector<std::vector<Vec>> Q(T), K(T), V(T);  // [t][head] -> head vector
      for (int64_t t = 0; t < T; ++t) {
        const Vec h = rms(x[t], vec(blk(l, "attn_norm.weight")));
        const Vec q = mv(Wq, h), k = mv(Wk, h), v = mv(Wv, h);
        for (int64_t hh = 0; hh < s.n_head; ++hh) {
          Q[t].push_back(rms(q, qn, hh * hd, hd));
          rope(Q[t].back(), t);
        }
        for (int64_t hh = 0; hh < s.n_head_kv; ++hh) {
          K[t].push_back(rms(k, kn, hh * hd, hd));
          rope(K[t].back(), t);
          V[t].emplace_back(v.begin() + hh * hd, v.begin() + (hh + 1) * hd);
        }
      }
      for (int64_t t = 0; t < T; ++t) {
        Vec att(s.n_head * hd, 0.0);
        for (int64_t hh = 0; hh < s.n_head; ++hh) {
          const int64_t g = hh / (s.n_head / s.n_head_kv);
          Vec p(t + 1);
          for (int64_t j = 0; j <= t; ++j) {
            p[j] = std::exp(std::inner_product(Q[t][hh].begin(), Q[t][hh].end(), K[j][g].begin(), 0.0) /
                            std::sqrt(double(hd)));
          }
          const double z = std::accumulate(p.begin(), p.end(), 0.0);
          for (int64_t j = 0; j <= t; ++j)
            for (int64_t d = 0; d < hd; ++d) att[hh * hd + d] += p[j] / z * V[j][g][d];
        }
        const Vec o = mv(Wo, att);
        for (int64_t i = 0; i < E; ++i) x[t][i] += o[i];

        const Vec h = rms(x[t], vec(blk(l, "ffn_norm.weight")));
        Vec pr = mv(mat(blk(l, "ffn_gate_inp.weight")), h);
        const double mx = *std::max_element(pr.begin(), pr.end());
        double z = 0;
        for (double& v : pr) z += (v = std::exp(v - mx));
        for (double& v : pr) v /= z;
        std::vector<int64_t> idx(s.n_expert);
        std::iota(idx.begin(), idx.end(), 0);
        std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return pr[a] > pr[b]; });
        double wsum = 0;
        for (int64_t k = 0; k < s.n_expert_used; ++k) wsum += pr[idx[k]];
        Vec out(E, 0.0);
        for (int64_t k = 0; k < s.n_expert_used; ++k) {
          const int64_t e = idx[k];
          const double w = norm_topk ? pr[e] / wsum : pr[e];
          const Vec g = mv(rows(blk(l, "ffn_gate_exps.weight"), e * s.n_ff_exp, s.n_ff_exp), h);
          const Vec u = mv(rows(blk(l, "ffn_up_exps.weight"), e * s.n_ff_exp, s.n_ff_exp), h);
          Vec a(s.n_ff_exp);
          for (int64_t i = 0; i < s.n_ff_exp; ++i) a[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
          const Vec d = mv(rows(blk(l, "ffn_down_exps.weight"), e * E, E), a);
          for (int64_t i = 0; i < E; ++i) out[i] += w * d[i];
        }
        for (int64_t i = 0; i < E; ++i) x[t][i] += out[i];
      }
    }
    std::vector<Vec> logits;
    const auto Wout = mat("output.weight");
    for (int64_t t = 0; t < T; ++t) logits.push_back(mv(Wout, rms(x[t], vec("output_norm.weight"))));
    return logits;
  }
};

class NaiveQwen3Moe : public ::testing::TestWithParam<bool> {};

TEST_P(NaiveQwen3Moe, ExecutorMatchesNaiveDoubleForward) {
  const bool norm_topk = GetParam();
  SyntheticSpec s;
  s.seed = norm_topk ? 301 : 302;
  SyntheticModel sm(s);
  sm.meta.set("qwen3moe.expert_weights_norm", gguf::Value::boolean(norm_topk));
  const std::string path = temp_path("naive");
  sm.write(path);
  {
    const gguf::GgufFile f = gguf::GgufFile::open(path);
    model::Model m = model::Model::load(path);
    ASSERT_EQ(m.hp.norm_topk_prob, norm_topk);
    std::mt19937_64 rng(s.seed);
    std::vector<int32_t> tokens(10);
    for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % s.n_vocab);

    reference::ReferenceExecutor ex(m, {1});
    const std::vector<float> got = ex.forward(tokens, true);
    const std::vector<Vec> want = Naive{f, s, norm_topk}.forward(tokens);
    double max_ref = 0, max_diff = 0;
    for (size_t t = 0; t < want.size(); ++t) {
      for (int64_t v = 0; v < s.n_vocab; ++v) {
        max_ref = std::max(max_ref, std::fabs(want[t][v]));
        max_diff = std::max(max_diff, std::fabs(want[t][v] - got[t * s.n_vocab + v]));
      }
    }
    std::printf("[ norm_topk=%d ] max |logit| %.3f, max |diff| %.3g\n", norm_topk, max_ref, max_diff);
    EXPECT_LE(max_diff, 1e-5 * max_ref);

    // The flag must matter: the other setting gives other logits.
    const std::vector<Vec> other = Naive{f, s, !norm_topk}.forward(tokens);
    double sep = 0;
    for (size_t t = 0; t < other.size(); ++t)
      for (int64_t v = 0; v < s.n_vocab; ++v) sep = std::max(sep, std::fabs(other[t][v] - want[t][v]));
    EXPECT_GT(sep, 100 * max_diff);
  }
  std::filesystem::remove(path);
}

INSTANTIATE_TEST_SUITE_P(Renormalise, NaiveQwen3Moe, ::testing::Bool());

}  // namespace
}  // namespace moraine::testing
