// The MTP head (executor.h, mtp_forward): qwen3next's multi-token-prediction block as
// tools/train/model.py's Qwen3Next.forward(with_mtp=True) computes it.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "common/reference/executor.h"
#include "common/reference/matmul.h"
#include "common/reference/ops.h"

namespace moraine::reference {

void ReferenceExecutor::mtp_forward(const float* hidden, std::span<const int32_t> next_tokens, int64_t logit_rows,
                                    float* logits, float* hidden_out) {
  if (!has_mtp()) throw std::logic_error("reference executor: the model has no nextn (MTP) block");
  const model::HParams& hp = m_.hp;
  const model::NextnWeights& N = m_.nextn[0];
  const int64_t n = static_cast<int64_t>(next_tokens.size()), d = hp.n_embd;
  const float eps = static_cast<float>(hp.rms_eps);
  if (logit_rows < 0 || logit_rows > n)
    throw std::invalid_argument("MTP: logits of " + std::to_string(logit_rows) + " slots of " + std::to_string(n));
  if (n == 0) return;
  // The MTP block's own embedding table where the file has one, else the trunk's (qwen3next ties them).
  const model::Matrix& embd = N.embed_tokens ? N.embed_tokens : m_.tok_embd;
  std::vector<float> e(static_cast<size_t>(d)), cat(static_cast<size_t>(n * 2 * d)), x(static_cast<size_t>(n * d)),
      h(static_cast<size_t>(n * d));
  for (int64_t t = 0; t < n; ++t) {
    const int32_t id = next_tokens[static_cast<size_t>(t)];
    if (id < 0 || id >= hp.n_vocab)
      throw std::invalid_argument("MTP: token id " + std::to_string(id) + " of slot " + std::to_string(mtp_n_past_ + t) +
                                  " is outside the vocabulary [0, " + std::to_string(hp.n_vocab) + ")");
    dequantize_row(embd.type, embd.row(id), e.data(), d);
    // Embedding first, then the hidden (model.py: torch.cat((e, pre_fc_norm_hidden(h)))).
    rms_norm(e.data(), N.enorm.data(), d, eps, cat.data() + t * 2 * d);
    rms_norm(hidden + t * d, N.hnorm.data(), d, eps, cat.data() + t * 2 * d + d);
  }
  matmul(N.eh_proj, cat.data(), n, x.data(), pool_, order_);
  const int64_t il = hp.n_layer;   // block(il), block_state(il), block_pos0(il): the MTP block's
  mixer_step(il, x.data(), n, h.data());
  ffn_block(il, h.data(), n, x.data());
  mtp_n_past_ += n;
  if (logit_rows == 0) return;
  const std::vector<float>& norm = N.shared_head_norm.empty() ? m_.output_norm : N.shared_head_norm;
  const int64_t first = n - logit_rows;
  for (int64_t r = 0; r < logit_rows; ++r) rms_norm(x.data() + (first + r) * d, norm.data(), d, eps, h.data() + r * d);
  matmul(N.shared_head_head ? N.shared_head_head : m_.output, h.data(), logit_rows, logits, pool_, order_);
  if (hidden_out != nullptr) std::copy_n(h.data(), logit_rows * d, hidden_out);
}

void ReferenceExecutor::mtp_rewind(int64_t n) {
  if (n < 0 || n > mtp_n_past_)
    throw std::logic_error("reference executor: MTP rewind to " + std::to_string(n) + " slots, but " +
                           std::to_string(mtp_n_past_) + " are cached");
  const int64_t w = k_width(m_.hp.n_layer);
  mtp_state_.k_cache.resize(static_cast<size_t>(n * w));
  mtp_state_.v_cache.resize(static_cast<size_t>(n * w));
  mtp_n_past_ = n;
}

}  // namespace moraine::reference
