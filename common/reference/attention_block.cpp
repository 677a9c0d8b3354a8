// Full (softmax) attention as the layer's AttentionPart asks: GQA, NEOX RoPE over the first n_rot
// dims (YaRN-scaled when the part says so); optional per-head RMSNorm on q and k (qwen), a
// per-head output gate carried in the q projection ([query | gate] per head, out *= sigmoid(gate),
// qwen3next), q/k/v/o biases, a learned sink logit per head and a sliding window (gpt-oss).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/formats/half_float.h"
#include "common/reference/executor.h"
#include "common/reference/matmul.h"
#include "common/reference/ops.h"

namespace moraine::reference {

void ReferenceExecutor::attention_block(int64_t il, const float* h, int64_t n, float* x) {
  const model::HParams& hp = m_.hp;
  const model::AttentionWeights& A = block(il).attn;
  LayerState& S = block_state(il);
  const int64_t pos0 = block_pos0(il);   // the first row's position (set_window; the MTP block's own)
  const int64_t hd = hp.head_dim;
  const int64_t n_head = hp.n_head;
  const int64_t kv_dim = hp.n_head_kv * hd;
  const int64_t q_rows = A.q.n_rows;  // n_head * hd, doubled when the gate rides along
  const int64_t q_stride = A.q_has_gate ? 2 * hd : hd;
  const float eps = static_cast<float>(hp.rms_eps);
  const model::AttentionPart& part = block(il).recipe.mixer.attn;
  const bool yarn = part.rope.scaling == model::RopeScaling::Yarn;

  const auto rotate = [&](float* head, int64_t pos) {
    if (yarn) rope_neox_yarn(head, hp.n_rot, pos, part.rope);
    else rope_neox(head, hp.n_rot, pos, hp.rope_freq_base);
  };
  const auto add_bias = [](float* rows, int64_t n_rows, const std::vector<float>& b) {
    const int64_t w = static_cast<int64_t>(b.size());
    for (int64_t r = 0; r < n_rows; ++r)
      for (int64_t i = 0; i < w; ++i) rows[r * w + i] += b[i];
  };

  std::vector<float> qg(n * q_rows), k(n * kv_dim), v(n * kv_dim);
  matmul(A.q, h, n, qg.data(), pool_, order_);
  matmul(A.k, h, n, k.data(), pool_, order_);
  matmul(A.v, h, n, v.data(), pool_, order_);
  if (!A.q_bias.empty()) add_bias(qg.data(), n, A.q_bias);
  if (!A.k_bias.empty()) add_bias(k.data(), n, A.k_bias);
  if (!A.v_bias.empty()) add_bias(v.data(), n, A.v_bias);

  // Normalise and rotate; append k and v to the cache before attending so token t of this
  // batch sees exactly positions 0..n_past+t, as it would if decoded alone.
  std::vector<float> q(n * n_head * hd);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = pos0 + t;
    for (int64_t hh = 0; hh < n_head; ++hh) {
      float* qh = q.data() + (t * n_head + hh) * hd;
      const float* src = qg.data() + t * q_rows + hh * q_stride;
      if (A.q_norm.empty()) std::copy_n(src, hd, qh);
      else rms_norm(src, A.q_norm.data(), hd, eps, qh);
      rotate(qh, pos);
    }
    for (int64_t hh = 0; hh < hp.n_head_kv; ++hh) {
      float* kh = k.data() + t * kv_dim + hh * hd;
      if (!A.k_norm.empty()) rms_norm(kh, A.k_norm.data(), hd, eps, kh);
      rotate(kh, pos);
    }
  }
  // A draw per (seed, layer, position, element, K or V).
  const auto draw = [&](uint64_t seed, int64_t i, int w) {
    return cache_draw(seed, il, static_cast<uint64_t>((pos0 + i / kv_dim) * kv_dim + i % kv_dim), w);
  };
  if (kv_type_ == model::KvType::F16) {   // the cache holds halves: attention reads their floats
    for (int64_t i = 0; i < n * kv_dim; ++i) {
      for (int w = 0; w < 2; ++w) {
        float& e = (w == 0 ? k : v)[i];
        uint16_t code = half::fp32_to_fp16(e);
        // In another float order (dot_order != 0) a value this close to the midpoint between two
        // halves could have come out on the other side of it, as the CUDA backend's own K and V
        // (a few float ulps from these) sometimes do: such values round either way, by a draw.
        // 2^-20 relative covers ~8 ulps. Without this the F16 golden bound missed the H200's
        // qwen3moe_odd q8_0 gap (0.0065 of max against an order-only gap of 0.0031).
        const float r = half::fp16_to_fp32(code);
        if (order_ != 0 && order_ != kFloatDots && std::isfinite(r) && (code & 0x7fffu) != 0 && std::fabs(e) != std::fabs(r)) {
          const uint16_t other = static_cast<uint16_t>(std::fabs(e) > std::fabs(r) ? code + 1 : code - 1);   // the neighbour on e's side
          const float mid = 0.5f * (r + half::fp16_to_fp32(other));
          if (std::fabs(e - mid) <= 0x1p-20f * std::fabs(e) && draw(order_, i, w) != 0) code = other;
        }
        e = half::fp16_to_fp32(code);
      }
    }
  }
  if (kv_perturb_seed_ != 0) {   // ExecutorOptions::kv_perturb_seed: a sign per (layer, position, element)
    for (int64_t i = 0; i < n * kv_dim; ++i) {
      for (int w = 0; w < 2; ++w) (w == 0 ? k : v)[i] *= draw(kv_perturb_seed_, i, w) != 0 ? 1.0f + 0x1p-11f : 1.0f - 0x1p-11f;
    }
  }
  S.k_cache.insert(S.k_cache.end(), k.begin(), k.end());
  S.v_cache.insert(S.v_cache.end(), v.begin(), v.end());

  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t group = n_head / hp.n_head_kv;
  std::vector<float> out(n * n_head * hd);
  const int64_t n_ctx = pos0 + n;
  pool_.parallel_for(n * n_head, n_ctx * hd * 2, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(n_ctx);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / n_head;
      const int64_t hh = i % n_head;
      const int64_t kvh = hh / group;
      const int64_t n_kv = pos0 + t + 1;
      float* o = out.data() + i * hd;
      // A sliding layer sees the last sliding_window positions, itself included.
      const int64_t first = part.sliding_window > 0 ? std::max<int64_t>(0, n_kv - part.sliding_window) : 0;
      const float* kc = S.k_cache.data() + first * kv_dim + kvh * hd;
      const float* vc = S.v_cache.data() + first * kv_dim + kvh * hd;
      if (A.sinks.empty()) {
        attend_one_head(q.data() + i * hd, kc, vc, n_kv - first, kv_dim, hd, scale, scores.data(), o);
      } else {
        attend_one_head_sink(q.data() + i * hd, kc, vc, n_kv - first, kv_dim, hd, scale, A.sinks[hh], scores.data(), o);
      }
      if (A.q_has_gate) {
        const float* gate = qg.data() + t * q_rows + hh * q_stride + hd;
        for (int64_t j = 0; j < hd; ++j) o[j] *= sigmoid(gate[j]);
      }
    }
  });

  std::vector<float> y(n * hp.n_embd);
  matmul(A.o, out.data(), n, y.data(), pool_, order_);
  if (!A.o_bias.empty()) add_bias(y.data(), n, A.o_bias);
  for (int64_t i = 0; i < n * hp.n_embd; ++i) x[i] += y[i];
}

}  // namespace moraine::reference
