#include "common/reference/executor.h"

#include <stdexcept>
#include <string>

#include "common/formats/quant.h"
#include "common/reference/matmul.h"
#include "common/reference/ops.h"

namespace moraine::reference {

ReferenceExecutor::ReferenceExecutor(const model::Model& model, ExecutorOptions opt)
    : m_(model), pool_(opt.n_threads, opt.min_parallel_work) {
  reset();
}

void ReferenceExecutor::reset() {
  const model::HParams& hp = m_.hp;
  state_.assign(hp.n_layer, LayerState{});
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    if (!m_.layers[il].recurrent) continue;
    state_[il].conv_state.assign((hp.ssm_conv_kernel - 1) * hp.ssm_conv_dim(), 0.0f);
    state_[il].ssm_state.assign(hp.ssm_n_v_heads * hp.ssm_head_k_dim * hp.ssm_head_v_dim, 0.0f);
  }
  n_past_ = 0;
}

std::vector<float> ReferenceExecutor::forward(std::span<const int32_t> tokens, bool all_logits) {
  const model::HParams& hp = m_.hp;
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n == 0) return {};
  const int64_t d = hp.n_embd;

  std::vector<float> x(n * d);
  for (int64_t t = 0; t < n; ++t) {
    const int32_t id = tokens[t];
    if (id < 0 || id >= hp.n_vocab) {
      throw std::invalid_argument("token id " + std::to_string(id) + " at position " +
                                  std::to_string(n_past_ + t) + " is outside the vocabulary [0, " +
                                  std::to_string(hp.n_vocab) + ")");
    }
    dequantize_row(m_.tok_embd.type, m_.tok_embd.row(id), x.data() + t * d, d);
  }

  std::vector<float> h(n * d);
  const float eps = static_cast<float>(hp.rms_eps);
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    const model::LayerWeights& L = m_.layers[il];
    for (int64_t t = 0; t < n; ++t) rms_norm(x.data() + t * d, L.attn_norm.data(), d, eps, h.data() + t * d);
    if (L.recurrent) {
      delta_net_block(il, h.data(), n, x.data());
    } else {
      attention_block(il, h.data(), n, x.data());
    }
    for (int64_t t = 0; t < n; ++t) rms_norm(x.data() + t * d, L.ffn_norm.data(), d, eps, h.data() + t * d);
    moe_block(il, h.data(), n, x.data());
  }
  n_past_ += n;

  const int64_t first = all_logits ? 0 : n - 1;
  const int64_t rows = n - first;
  for (int64_t t = first; t < n; ++t) {
    rms_norm(x.data() + t * d, m_.output_norm.data(), d, eps, h.data() + (t - first) * d);
  }
  std::vector<float> logits(rows * hp.n_vocab);
  matmul(m_.output, h.data(), rows, logits.data(), pool_);
  return logits;
}

}  // namespace moraine::reference
