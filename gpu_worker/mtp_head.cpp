#include "gpu_worker/mtp_head.h"

#include <algorithm>
#include <span>
#include <stdexcept>
#include <string>

#include "common/sampling/sampler.h"

namespace moraine::gpu_worker {

void MtpHead::reset() {
  ok_ = true;
  hidden_end_ = 0;
}

const float* MtpHead::hidden_at(int64_t pos) const {
  if (pos < 0 || pos >= hidden_end_) return nullptr;
  return hidden_.data() + pos * exec_.model().hp.n_embd;
}

int64_t MtpHead::step(const float* x, const int32_t* tokens, int64_t n, int64_t p, int64_t base_row, int32_t base_token,
                      int64_t max_drafts, int32_t* drafts) {
  if (n <= 0 || base_row < 0 || base_row >= n || max_drafts < 0)
    throw std::invalid_argument("MTP: base row " + std::to_string(base_row) + " of a step of " + std::to_string(n) +
                                " rows, " + std::to_string(max_drafts) + " drafts");
  if (!ok_) return -1;
  const int64_t d = exec_.model().hp.n_embd;
  // Slots [s, settled) have their hidden rows and next tokens (slot i: token i+1 = tokens[i+1-p]).
  const int64_t s = exec_.mtp_n_past(), settled = p + base_row;
  if (hidden_end_ != p || s != std::max<int64_t>(0, p - 1)) {
    ok_ = false;   // the head missed positions: it cannot follow this sequence
    return -1;
  }
  hidden_.resize(static_cast<size_t>((p + n) * d));
  exec_.output_norm(x, n, hidden_.data() + p * d);
  hidden_end_ = p + n;
  if (settled > s)
    exec_.mtp_forward(hidden_at(s), std::span<const int32_t>(tokens + (s + 1 - p), static_cast<size_t>(settled - s)), 0,
                      nullptr, nullptr);
  if (max_drafts == 0) return 0;
  // The chain: each drafted slot takes the head's own output row and the token drafted before it.
  const int64_t V = exec_.n_vocab();
  logits_.resize(static_cast<size_t>(V));
  chain_h_.assign(hidden_at(settled), hidden_at(settled) + d);
  chain_out_.resize(static_cast<size_t>(d));
  int32_t token = base_token;
  for (int64_t k = 0; k < max_drafts; ++k) {
    exec_.mtp_forward(chain_h_.data(), std::span<const int32_t>(&token, 1), 1, logits_.data(), chain_out_.data());
    token = sampling::argmax({logits_.data(), logits_.size()});
    drafts[k] = token;
    chain_h_.swap(chain_out_);
  }
  exec_.mtp_rewind(settled);
  return max_drafts;
}

void MtpHead::rewind(int64_t n_past) {
  const int64_t keep = std::max<int64_t>(0, n_past - 1);
  if (exec_.mtp_n_past() > keep) exec_.mtp_rewind(keep);
  hidden_end_ = std::min(hidden_end_, n_past);
}

}  // namespace moraine::gpu_worker
