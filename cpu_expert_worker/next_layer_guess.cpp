#include "cpu_expert_worker/next_layer_guess.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "common/formats/quant.h"

namespace moraine::cpu_worker {

NextLayerGuess::NextLayerGuess(const model::Model& m)
    : n_layer_(m.hp.n_layer), n_embd_(m.hp.n_embd), n_expert_(m.hp.n_expert), k_(m.hp.n_expert_used) {
  if (n_layer_ < 1 || n_expert_ < 1 || k_ < 1 || k_ > n_expert_) throw std::invalid_argument("next-layer guess: a model without routed experts");
  const int64_t folds = n_layer_ - 1;
  q_.resize(static_cast<size_t>(folds * n_expert_ * n_embd_));
  scale_.resize(static_cast<size_t>(folds * n_expert_));
  choice_bias_.assign(static_cast<size_t>(folds * n_expert_), 0.0f);
  sigmoid_choice_.assign(static_cast<size_t>(folds), false);
  std::vector<float> w(static_cast<size_t>(n_embd_)), ratio(static_cast<size_t>(n_embd_));
  for (int64_t il = 0; il < folds; ++il) {
    const model::LayerWeights& from = m.layers[static_cast<size_t>(il)];
    const model::LayerWeights& to = m.layers[static_cast<size_t>(il + 1)];
    const model::Matrix& router = to.moe.router;
    if (to.recipe.ffn.kind != model::FfnKind::Moe) continue;   // a dense layer: nothing to guess (scale 0)
    // The choice's own biases (gpt-oss's on the logits, the sigmoid routers' score bias after it).
    sigmoid_choice_[static_cast<size_t>(il)] = to.recipe.ffn.router.kind == model::RouterKind::SigmoidGroupTopK;
    for (int64_t e = 0; e < n_expert_; ++e) {
      float& b = choice_bias_[static_cast<size_t>(il * n_expert_ + e)];
      if (!to.moe.router_bias.empty()) b += to.moe.router_bias[static_cast<size_t>(e)];
      if (!to.moe.score_bias.empty()) b += to.moe.score_bias[static_cast<size_t>(e)];
    }
    if (from.ffn_norm.size() != static_cast<size_t>(n_embd_) || to.ffn_norm.size() != static_cast<size_t>(n_embd_) ||
        router.n_cols != n_embd_ || router.n_rows != n_expert_) {
      throw std::invalid_argument("next-layer guess: layer " + std::to_string(il + 1) + "'s router or the ffn norms have unexpected sizes");
    }
    // A zero (or non-finite) weight of layer il's norm leaves nothing of x in h: that
    // coordinate drops out of the guess.
    for (int64_t i = 0; i < n_embd_; ++i) {
      const float r = to.ffn_norm[static_cast<size_t>(i)] / from.ffn_norm[static_cast<size_t>(i)];
      ratio[static_cast<size_t>(i)] = std::isfinite(r) ? r : 0.0f;
    }
    for (int64_t e = 0; e < n_expert_; ++e) {
      dequantize_row(router.type, router.row(e), w.data(), n_embd_);
      float top = 0;
      for (int64_t i = 0; i < n_embd_; ++i) {
        float& v = w[static_cast<size_t>(i)];
        v = std::isfinite(v) ? v * ratio[static_cast<size_t>(i)] : 0.0f;
        top = std::max(top, std::fabs(v));
      }
      const float scale = top / 127.0f;
      scale_[static_cast<size_t>(il * n_expert_ + e)] = scale;
      int8_t* q = q_.data() + static_cast<size_t>((il * n_expert_ + e) * n_embd_);
      for (int64_t i = 0; i < n_embd_; ++i) {
        q[i] = scale > 0 ? static_cast<int8_t>(std::lrint(w[static_cast<size_t>(i)] / scale)) : int8_t{0};
      }
    }
  }
  logits_.resize(static_cast<size_t>(n_expert_));
  order_.resize(static_cast<size_t>(n_expert_));
}

void NextLayerGuess::logits(int64_t il, const float* h, cpu::ThreadPool& pool, std::vector<float>& out) const {
  if (il < 0 || il >= n_layer_ - 1) throw std::invalid_argument("next-layer guess: no layer after " + std::to_string(il));
  out.resize(static_cast<size_t>(n_expert_));
  const int64_t jobs = (n_expert_ + kRowsPerJob - 1) / kRowsPerJob;
  pool.run(jobs, [&](int64_t j, int) {
    const int64_t e1 = std::min(n_expert_, (j + 1) * kRowsPerJob);
    for (int64_t e = j * kRowsPerJob; e < e1; ++e) {
      const int8_t* q = row(il, e);
      // Sixteen partial sums: independent chains the compiler can keep in one vector register.
      float acc[16] = {};
      int64_t i = 0;
      for (; i + 16 <= n_embd_; i += 16) {
        for (int l = 0; l < 16; ++l) acc[l] += static_cast<float>(q[i + l]) * h[i + l];
      }
      float sum = 0;
      for (; i < n_embd_; ++i) sum += static_cast<float>(q[i]) * h[i];
      for (float a : acc) sum += a;
      out[static_cast<size_t>(e)] = sum * scale_[static_cast<size_t>(il * n_expert_ + e)];
    }
  });
}

void NextLayerGuess::guess(int64_t il, const float* h, int64_t n, cpu::ThreadPool& pool, std::vector<int32_t>& out, int64_t k) {
  if (k <= 0) k = k_;
  k = std::min(k, n_expert_);
  const size_t first = out.size();
  for (int64_t t = 0; t < n; ++t) {
    logits(il, h + t * n_embd_, pool, logits_);
    const float* bias = choice_bias_.data() + il * n_expert_;
    for (int64_t e = 0; e < n_expert_; ++e) {
      float& l = logits_[static_cast<size_t>(e)];
      l = (sigmoid_choice_[static_cast<size_t>(il)] ? 1.0f / (1.0f + std::exp(-l)) : l) + bias[e];
    }
    for (int64_t e = 0; e < n_expert_; ++e) order_[static_cast<size_t>(e)] = static_cast<int32_t>(e);
    std::partial_sort(order_.begin(), order_.begin() + k, order_.end(), [&](int32_t a, int32_t b) {
      const float la = logits_[static_cast<size_t>(a)], lb = logits_[static_cast<size_t>(b)];
      return la > lb || (la == lb && a < b);
    });
    for (int64_t s = 0; s < k; ++s) {
      const int32_t e = order_[static_cast<size_t>(s)];
      if (std::find(out.begin() + static_cast<std::ptrdiff_t>(first), out.end(), e) == out.end()) out.push_back(e);
    }
  }
}

float NextLayerGuess::error_bound(int64_t il, int64_t e, const float* h) const {
  // Each int8 weight is within half a step of the F32 fold's; the float sums add a relative
  // error of at most ~n_embd * 2^-24 of sum |q h| (far below the rounding term for n_embd < 10^5).
  double abs_h = 0, abs_qh = 0;
  const int8_t* q = row(il, e);
  for (int64_t i = 0; i < n_embd_; ++i) {
    abs_h += std::fabs(h[i]);
    abs_qh += std::fabs(static_cast<double>(q[i]) * h[i]);
  }
  const double s = scale_[static_cast<size_t>(il * n_expert_ + e)];
  return static_cast<float>(s * (0.5 * abs_h + abs_qh * static_cast<double>(n_embd_) * 0x1p-23));
}

}  // namespace moraine::cpu_worker
