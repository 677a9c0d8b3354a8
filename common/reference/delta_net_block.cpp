// Gated DeltaNet token mixer of qwen3next (see common/model/qwen3next.cpp for the formulas), and
// qwen35moe's layout of it (value heads tiled over key heads, beta and alpha projected apart).
// Projections run batched; the causal conv1d and the delta-rule recurrence run token by token
// (the chunked parallel form is mathematically the same and belongs in faster paths).
#include <cmath>
#include <vector>

#include "common/reference/executor.h"
#include "common/reference/matmul.h"
#include "common/reference/ops.h"

namespace moraine::reference {

void ReferenceExecutor::delta_net_block(int64_t il, const float* h, int64_t n, float* x) {
  const model::HParams& hp = m_.hp;
  const model::DeltaNetWeights& W = m_.layers[il].delta;
  LayerState& S = state_[il];
  const int64_t dk = hp.ssm_head_k_dim;
  const int64_t dv = hp.ssm_head_v_dim;
  const int64_t nk = hp.ssm_n_k_heads;
  const int64_t nv = hp.ssm_n_v_heads;
  const int64_t r = nv / nk;  // value heads per key head
  const int64_t key_dim = nk * dk;
  const int64_t v_dim = nv * dv;
  const int64_t conv_dim = hp.ssm_conv_dim();
  const float eps = static_cast<float>(hp.rms_eps);

  // mixed: [n][q all heads | k all heads | v all heads]; z: [n][v_dim].
  std::vector<float> mixed(n * conv_dim), z(n * v_dim);
  if (W.qkv) {
    matmul(W.qkv, h, n, mixed.data(), pool_, order_);
    matmul(W.z, h, n, z.data(), pool_, order_);
  } else {
    // Legacy ssm_in: per key head g, [q(dk) | k(dk) | v(r*dv) | z(r*dv)].
    const int64_t gsz = 2 * dk + 2 * r * dv;
    std::vector<float> qkvz(n * gsz * nk);
    matmul(W.qkvz, h, n, qkvz.data(), pool_, order_);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t g = 0; g < nk; ++g) {
        const float* src = qkvz.data() + t * gsz * nk + g * gsz;
        float* dst = mixed.data() + t * conv_dim;
        for (int64_t i = 0; i < dk; ++i) dst[g * dk + i] = src[i];
        for (int64_t i = 0; i < dk; ++i) dst[key_dim + g * dk + i] = src[dk + i];
        for (int64_t i = 0; i < r * dv; ++i) dst[2 * key_dim + g * r * dv + i] = src[2 * dk + i];
        for (int64_t i = 0; i < r * dv; ++i) z[t * v_dim + g * r * dv + i] = src[2 * dk + r * dv + i];
      }
    }
  }

  const model::DeltaNetPart& part = m_.layers[il].recipe.mixer.delta;
  std::vector<float> ba(n * 2 * nv), beta(n * nv), gdecay(n * nv);
  if (part.split_ba) {
    // ssm_beta then ssm_alpha, each one row per value head: ba = [t][b(nv)] then [t][a(nv)].
    matmul(W.beta, h, n, ba.data(), pool_, order_);
    matmul(W.alpha, h, n, ba.data() + n * nv, pool_, order_);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t hv = 0; hv < nv; ++hv) {
        beta[t * nv + hv] = sigmoid(ba[t * nv + hv]);
        gdecay[t * nv + hv] = W.a[hv] * softplus(ba[n * nv + t * nv + hv] + W.dt_bias[hv]);
      }
    }
  } else {
    // ba: per key head g, [b(r) | a(r)]; value head g*r+i takes b[i] and a[i] of its group.
    matmul(W.ba, h, n, ba.data(), pool_, order_);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t g = 0; g < nk; ++g) {
        for (int64_t i = 0; i < r; ++i) {
          const int64_t hv = g * r + i;
          const float b = ba[t * 2 * nv + g * 2 * r + i];
          const float a = ba[t * 2 * nv + g * 2 * r + r + i];
          beta[t * nv + hv] = sigmoid(b);
          gdecay[t * nv + hv] = W.a[hv] * softplus(a + W.dt_bias[hv]);
        }
      }
    }
  }

  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
  std::vector<float> conv_out(conv_dim), core(n * v_dim);
  for (int64_t t = 0; t < n; ++t) {
    conv1d_silu_step(W.conv.data(), hp.ssm_conv_kernel, conv_dim, S.conv_state.data(),
                     mixed.data() + t * conv_dim, conv_out.data());
    float* q = conv_out.data();
    float* k = conv_out.data() + key_dim;
    const float* v = conv_out.data() + 2 * key_dim;
    for (int64_t g = 0; g < nk; ++g) {
      l2_norm(q + g * dk, dk, eps);
      l2_norm(k + g * dk, dk, eps);
    }
    pool_.parallel_for(nv, dk * dv * 4, [&](int64_t h0, int64_t h1) {
      for (int64_t hv = h0; hv < h1; ++hv) {
        const int64_t g = part.v_heads_tiled ? hv % nk : hv / r;   // the key head this value head reads
        float* o = core.data() + t * v_dim + hv * dv;
        delta_rule_step(S.ssm_state.data() + hv * dk * dv, q + g * dk, k + g * dk, v + hv * dv,
                        gdecay[t * nv + hv], beta[t * nv + hv], dk, dv, scale, o);
        // Gated RMSNorm: rmsnorm(o) * w * silu(z).
        rms_norm(o, W.norm.data(), dv, eps, o);
        const float* zh = z.data() + t * v_dim + hv * dv;
        for (int64_t j = 0; j < dv; ++j) o[j] *= silu(zh[j]);
      }
    });
  }

  std::vector<float> y(n * hp.n_embd);
  matmul(W.out, core.data(), n, y.data(), pool_, order_);
  for (int64_t i = 0; i < n * hp.n_embd; ++i) x[i] += y[i];
}

}  // namespace moraine::reference
