// Multi-head latent attention (deepseek2), as llama.cpp's deepseek2 graph computes it:
//   q = q_b(norm(q_a(h))) or q(h), per head [nope | rope];   [c | k_pe] = kv_a_mqa(h)
//   c = norm(c) (the latent), k_pe and q's rope dims rotated (NORM pairing, DeepSeek's YaRN)
//   head hd: k = [K_hd c | k_pe], v = V_hd c;  out = o(concat_hd softmax(q.k * kq_scale) v)
// The cache holds [c | k_pe] per position, nothing per head. Two forms of the same attention:
// absorbed (q_nope through K_hd into latent space, scores and the weighted sum on the latents,
// then V_hd: what llama.cpp does with attn_k_b / attn_v_b) and expanded (K_hd c and V_hd c for
// every cached position each step: what it does with the older attn_kv_b). Auto takes the
// file's; the other one runs on dequantized copies of the decompression matrices (tests).
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/formats/half_float.h"
#include "common/formats/quant.h"
#include "common/reference/executor.h"
#include "common/reference/matmul.h"
#include "common/reference/ops.h"

namespace moraine::reference {

namespace {


std::vector<float> dequantized(const model::Matrix& m) {
  std::vector<float> f(static_cast<size_t>(m.n_rows * m.n_cols));
  for (int64_t r = 0; r < m.n_rows; ++r) dequantize_row(m.type, m.row(r), f.data() + r * m.n_cols, m.n_cols);
  return f;
}

// The decompression matrices as floats whatever the layout: kf[hd][r][j] (q_nope . kf[hd][r] is
// the absorbed query's latent dim r) and vf[hd][i][r] (value dim i = vf[hd][i] . c).
struct Decompression {
  std::vector<float> kf, vf;
};

Decompression decompression(const model::MlaWeights& W, const model::MlaPart& P, int64_t n_head) {
  const int64_t R = P.kv_lora_rank, N = P.nope_dim, Vd = P.v_dim;
  Decompression d;
  if (P.split_kv_b) {
    d.kf = dequantized(W.k_b.all);   // rows hd * R + r, N wide
    d.vf = dequantized(W.v_b.all);   // rows hd * Vd + i, R wide
    return d;
  }
  const std::vector<float> kv = dequantized(W.kv_b);   // rows hd * (N + Vd) + (j | N + i), R wide
  d.kf.resize(static_cast<size_t>(n_head * R * N));
  d.vf.resize(static_cast<size_t>(n_head * Vd * R));
  for (int64_t hd = 0; hd < n_head; ++hd) {
    const float* rows = kv.data() + hd * (N + Vd) * R;
    for (int64_t j = 0; j < N; ++j)
      for (int64_t r = 0; r < R; ++r) d.kf[(hd * R + r) * N + j] = rows[j * R + r];
    for (int64_t i = 0; i < Vd * R; ++i) d.vf[hd * Vd * R + i] = rows[N * R + i];
  }
  return d;
}

// One step of one MLA layer: what both forms read.
struct MlaStep {
  const model::MlaWeights& W;
  const model::MlaPart& P;
  int64_t H, n, pos0;
  const float* q;            // [n][H][nope + rope], the rope dims rotated
  const float* cache;        // [pos0 + n][kv_lora_rank + rope]
  const Decompression& dq;   // float copies (when not native)
  bool native;               // the layout's own matrices
  ThreadPool& pool;
  DotOrderSeed order;
};

// Absorbed: per (token, head) [q_nope K_hd | q_pe], one dot with the cached [c | k_pe], the
// weighted sum of the latents, then V_hd.
void absorbed_attention(const MlaStep& st, float* out) {
  const model::MlaWeights& W = st.W;
  const model::MlaPart& P = st.P;
  const int64_t H = st.H, n = st.n, pos0 = st.pos0, R = P.kv_lora_rank, Np = P.nope_dim, Rp = P.rope_dim;
  const int64_t Vd = P.v_dim, qk = Np + Rp, kw = R + Rp, n_ctx = pos0 + n;
  const float* q = st.q;
  const float* cache = st.cache;
  ThreadPool& pool = st.pool;
  // Per (token, head) [q_nope K_hd | q_pe]: one dot with the cached [c | k_pe].
  std::vector<float> qcat(n * H * kw), olat(n * H * R);
  std::vector<float> qn(n * Np), qa(n * R);
  for (int64_t hd = 0; hd < H; ++hd) {
    for (int64_t t = 0; t < n; ++t) std::copy_n(q + (t * H + hd) * qk, Np, qn.data() + t * Np);
    if (st.native) {
      matmul(W.k_b.expert(hd), qn.data(), n, qa.data(), pool, st.order);
    } else {
      for (int64_t t = 0; t < n; ++t)
        for (int64_t r = 0; r < R; ++r) {
          const float* kr = st.dq.kf.data() + (hd * R + r) * Np;
          float s = 0.0f;
          for (int64_t j = 0; j < Np; ++j) s += kr[j] * qn[t * Np + j];
          qa[t * R + r] = s;
        }
    }
    for (int64_t t = 0; t < n; ++t) {
      float* qc = qcat.data() + (t * H + hd) * kw;
      std::copy_n(qa.data() + t * R, R, qc);
      std::copy_n(q + (t * H + hd) * qk + Np, Rp, qc + R);
    }
  }
  pool.parallel_for(n * H, n_ctx * kw * 2, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(n_ctx);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n_kv = pos0 + i / H + 1;
      attend_rows(qcat.data() + i * kw, kw, cache, kw, cache, kw, R, n_kv, static_cast<float>(P.kq_scale), scores.data(),
             olat.data() + i * R);
    }
  });
  std::vector<float> ol(n * R), oh(n * Vd);
  for (int64_t hd = 0; hd < H; ++hd) {
    for (int64_t t = 0; t < n; ++t) std::copy_n(olat.data() + (t * H + hd) * R, R, ol.data() + t * R);
    if (st.native) {
      matmul(W.v_b.expert(hd), ol.data(), n, oh.data(), pool, st.order);
    } else {
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = 0; i < Vd; ++i) {
          const float* vr = st.dq.vf.data() + (hd * Vd + i) * R;
          float s = 0.0f;
          for (int64_t r = 0; r < R; ++r) s += vr[r] * ol[t * R + r];
          oh[t * Vd + i] = s;
        }
    }
    for (int64_t t = 0; t < n; ++t) std::copy_n(oh.data() + t * Vd, Vd, out + (t * H + hd) * Vd);
  }
}

// Expanded: every cached position's per-head key [K_hd c | k_pe] and value V_hd c, then MHA.
void expanded_attention(const MlaStep& st, float* out) {
  const model::MlaWeights& W = st.W;
  const model::MlaPart& P = st.P;
  const int64_t H = st.H, n = st.n, pos0 = st.pos0, R = P.kv_lora_rank, Np = P.nope_dim, Rp = P.rope_dim;
  const int64_t Vd = P.v_dim, qk = Np + Rp, kw = R + Rp, n_ctx = pos0 + n;
  const float* q = st.q;
  const float* cache = st.cache;
  ThreadPool& pool = st.pool;
  // Every cached position's per-head key [K_hd c | k_pe] and value V_hd c, then plain MHA.
  std::vector<float> lat(n_ctx * R), kx(n_ctx * H * qk), vx(n_ctx * H * Vd);
  for (int64_t p = 0; p < n_ctx; ++p) std::copy_n(cache + p * kw, R, lat.data() + p * R);
  if (st.native) {
    std::vector<float> kvx(n_ctx * H * (Np + Vd));
    matmul(W.kv_b, lat.data(), n_ctx, kvx.data(), pool, st.order);
    for (int64_t p = 0; p < n_ctx; ++p)
      for (int64_t hd = 0; hd < H; ++hd) {
        const float* src = kvx.data() + (p * H + hd) * (Np + Vd);
        std::copy_n(src, Np, kx.data() + (p * H + hd) * qk);
        std::copy_n(src + Np, Vd, vx.data() + (p * H + hd) * Vd);
      }
  } else {
    for (int64_t p = 0; p < n_ctx; ++p)
      for (int64_t hd = 0; hd < H; ++hd) {
        const float* c = lat.data() + p * R;
        float* kn = kx.data() + (p * H + hd) * qk;
        for (int64_t j = 0; j < Np; ++j) kn[j] = 0.0f;
        for (int64_t r = 0; r < R; ++r) {
          const float* kr = st.dq.kf.data() + (hd * R + r) * Np;
          for (int64_t j = 0; j < Np; ++j) kn[j] += kr[j] * c[r];
        }
        for (int64_t i = 0; i < Vd; ++i) {
          const float* vr = st.dq.vf.data() + (hd * Vd + i) * R;
          float s = 0.0f;
          for (int64_t r = 0; r < R; ++r) s += vr[r] * c[r];
          vx[(p * H + hd) * Vd + i] = s;
        }
      }
  }
  for (int64_t p = 0; p < n_ctx; ++p)
    for (int64_t hd = 0; hd < H; ++hd) std::copy_n(cache + p * kw + R, Rp, kx.data() + (p * H + hd) * qk + Np);
  pool.parallel_for(n * H, n_ctx * qk * 2, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(n_ctx);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n_kv = pos0 + i / H + 1, hd = i % H;
      attend_rows(q + i * qk, qk, kx.data() + hd * qk, H * qk, vx.data() + hd * Vd, H * Vd, Vd, n_kv,
             static_cast<float>(P.kq_scale), scores.data(), out + i * Vd);
    }
  });
}

}  // namespace

void ReferenceExecutor::mla_block(int64_t il, const float* h, int64_t n, float* x) {
  const model::HParams& hp = m_.hp;
  const model::LayerWeights& L = m_.layers[il];
  const model::MlaWeights& W = L.mla;
  const model::MlaPart& P = L.recipe.mixer.mla;
  const model::RopePart& rope = L.recipe.mixer.attn.rope;
  LayerState& S = state_[il];
  const int64_t pos0 = n_past_ + window_first_;
  const int64_t H = hp.n_head, R = P.kv_lora_rank, Np = P.nope_dim, Rp = P.rope_dim, Vd = P.v_dim;
  const int64_t qk = Np + Rp, kw = R + Rp;
  const float eps = static_cast<float>(hp.rms_eps);
  const bool yarn = rope.scaling == model::RopeScaling::Yarn;
  const auto rotate = [&](float* v, int64_t pos) {
    rope_norm(v, Rp, pos, rope.freq_base, yarn ? &rope : nullptr);
    if (!yarn && rope.attn_factor != 1.0)
      for (int64_t i = 0; i < Rp; ++i) v[i] *= static_cast<float>(rope.attn_factor);
  };

  std::vector<float> q(n * H * qk);
  if (P.q_lora_rank > 0) {
    std::vector<float> qa(n * P.q_lora_rank);
    matmul(W.q_a, h, n, qa.data(), pool_, order_);
    for (int64_t t = 0; t < n; ++t) {
      float* row = qa.data() + t * P.q_lora_rank;
      rms_norm(row, W.q_a_norm.data(), P.q_lora_rank, eps, row);
    }
    matmul(W.q_b, qa.data(), n, q.data(), pool_, order_);
  } else {
    matmul(W.q, h, n, q.data(), pool_, order_);
  }
  std::vector<float> kv(n * kw);
  matmul(W.kv_a_mqa, h, n, kv.data(), pool_, order_);
  for (int64_t t = 0; t < n; ++t) {
    float* row = kv.data() + t * kw;
    rms_norm(row, W.kv_a_norm.data(), R, eps, row);
    rotate(row + R, pos0 + t);
    for (int64_t hd = 0; hd < H; ++hd) rotate(q.data() + (t * H + hd) * qk + Np, pos0 + t);
  }
  if (kv_type_ == model::KvType::F16) {   // the cache holds halves
    for (float& e : kv) e = half::fp16_to_fp32(half::fp32_to_fp16(e));
  }
  if (kv_perturb_seed_ != 0) {   // ExecutorOptions::kv_perturb_seed on the latent + rotary-key row, as on K and V
    for (int64_t i = 0; i < n * kw; ++i)
      kv[i] *= cache_draw(kv_perturb_seed_, il, static_cast<uint64_t>(pos0 * kw + i), 0) != 0 ? 1.0f + 0x1p-11f : 1.0f - 0x1p-11f;
  }
  S.k_cache.insert(S.k_cache.end(), kv.begin(), kv.end());

  const bool absorbed = mla_form_ == MlaForm::Absorbed || (mla_form_ == MlaForm::Auto && P.split_kv_b);
  // The form the file's layout gives runs on its matrices; the other one on float copies.
  const bool native = absorbed == P.split_kv_b;
  const Decompression dq = native ? Decompression{} : decompression(W, P, H);
  std::vector<float> out(n * H * Vd);

  const MlaStep st{W, P, H, n, pos0, q.data(), S.k_cache.data(), dq, native, pool_, order_};
  if (absorbed) absorbed_attention(st, out.data());
  else expanded_attention(st, out.data());

  std::vector<float> y(n * hp.n_embd);
  matmul(W.o, out.data(), n, y.data(), pool_, order_);
  for (int64_t i = 0; i < n * hp.n_embd; ++i) x[i] += y[i];
}

}  // namespace moraine::reference
