// The CPU backend's MTP drafts (Backend::mtp_step): the reference executor's MTP head kept one
// slot behind the trunk. Slot i needs token i+1, so after a step of rows at positions p .. p+n-1
// the head has run every slot whose next token is settled (up to the row decode goes on from).
// It keeps the trunk's output-normed hidden row of every cached position (n_embd floats each: 8 MB
// for the built-in model's 8,192 positions), so that after any rewind (a rejected draft, a reused
// prompt prefix) the slots from there on can run again.
#pragma once
#include <cstdint>
#include <vector>

#include "common/reference/executor.h"

namespace moraine::gpu_worker {

class MtpHead {
 public:
  explicit MtpHead(reference::ReferenceExecutor& exec) : exec_(exec) {}
  // With the trunk's reset: an empty sequence, which the head follows from its first step.
  void reset();
  // A step the head did not see (Backend::mtp_skip), a loaded sequence: it cannot follow until reset.
  void lose() { ok_ = false; }
  bool following() const { return ok_; }
  // After a step at positions p .. p+n-1 of `tokens` whose final residual rows are x [n][n_embd]:
  // Backend::mtp_step's contract (-1 when the head cannot follow).
  int64_t step(const float* x, const int32_t* tokens, int64_t n, int64_t p, int64_t base_row, int32_t base_token,
               int64_t max_drafts, int32_t* drafts);
  // The trunk now caches positions [0, n_past): slots from n_past - 1 on are taken back.
  void rewind(int64_t n_past);

 private:
  const float* hidden_at(int64_t pos) const;   // the kept row of position pos, or nullptr
  reference::ReferenceExecutor& exec_;
  bool ok_ = true;
  std::vector<float> hidden_;     // rows of positions [0, hidden_end_)
  int64_t hidden_end_ = 0;
  std::vector<float> logits_, chain_h_, chain_out_;
};

}  // namespace moraine::gpu_worker
