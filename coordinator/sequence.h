// One request's generation state (a sequence): its context, sampler, penalties, detokenizer,
// stop strings and log-probabilities. The coordinator keeps one per Generate call, never in
// globals, so that several sequences can be stepped in turn (and later batched).
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <vector>

#include "common/sampling/sampler.h"
#include "common/tokenizer/streaming_decoder.h"
#include "common/tokenizer/tokenizer.h"
#include "coordinator/stop_strings.h"
#include "proto/generate.pb.h"

namespace moraine::group {

class Sequence {
 public:
  // Throws std::invalid_argument for sampling fields out of range, std::out_of_range when the
  // prompt and max_tokens do not fit the context (the message has the numbers).
  Sequence(const generate::SamplingParams& sp, const tokenizer::Tokenizer* tok, std::vector<int32_t> prompt,
           int64_t context_positions);

  // The sampler needs the logits on the host (not the gpu_worker's greedy token): sampling
  // other than greedy, log-probabilities, or penalties.
  bool needs_logits() const { return sp_.temperature() > 0.0f || sp_.logprobs() || penalties_.active(); }
  // The next token from the last row's logits: penalties over the context, then the sampler;
  // records the token's log-probability for accept() when asked for.
  int32_t sample(std::span<const float> logits);
  // A verify window's tokens by speculative sampling (sampling::Sampler::verify): `rows` holds
  // draft.size() + 1 logits rows of n_vocab, row i the model's after the context and draft[0..i). Row i's
  // distribution is the one sample() would draw from at that position (penalties over the context
  // extended by draft[0..i)), so the tokens returned (the accepted drafts, then the first
  // rejection's replacement or the last row's bonus token) are distributed as plain sampling's.
  // Does not append them: accept() does, in order. Throws std::invalid_argument for rows that are
  // not draft.size() + 1 rows of n_vocab.
  std::vector<int32_t> speculate(std::span<const float> rows, size_t n_vocab, std::span<const int32_t> draft);
  // Appends a decided token and fills `chunk` with it (id, text, log-probability). Returns true
  // when the sequence ends with it (EOS, a stop string, max_tokens); finish() then says why.
  bool accept(int32_t id, generate::GenerateChunk& chunk);

  std::vector<int32_t> context;   // the prompt, then the accepted tokens
  size_t prompt_tokens() const { return prompt_tokens_; }
  uint32_t max_new() const { return max_new_; }
  uint32_t generated() const { return generated_; }
  generate::FinishReason finish() const { return finish_; }
  const generate::SamplingParams& sampling() const { return sp_; }

 private:
  generate::SamplingParams sp_;
  const tokenizer::Tokenizer* tok_;
  size_t prompt_tokens_;
  uint32_t max_new_ = 16, generated_ = 0;
  sampling::Sampler sampler_;
  sampling::PenaltyParams penalties_;
  std::unique_ptr<tokenizer::StreamingDecoder> dec_;
  StopMatcher stop_;
  std::vector<float> penalised_;   // the logits with penalties applied (when active)
  // sample()'s token's log-probability, or speculate()'s tokens', in order.
  std::deque<generate::TokenLogprob> pending_logprobs_;
  std::vector<int32_t> history_;   // speculate()'s: the context and the drafts accepted so far
  void record_logprob(std::span<const float> logits, int32_t id);
  generate::FinishReason finish_ = generate::FINISH_REASON_UNSPECIFIED;
};

}  // namespace moraine::group
