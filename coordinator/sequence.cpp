#include "coordinator/sequence.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "common/tokenizer/utf8.h"

namespace moraine::group {
namespace {

// The most alternatives a chunk lists per token, as OpenAI's API allows.
constexpr uint32_t kMaxTopLogprobs = 20;

sampling::SamplerParams sampler_params(const generate::SamplingParams& sp) {
  if (!std::isfinite(sp.temperature()) || sp.temperature() < 0.0f) throw std::invalid_argument("temperature must be >= 0");
  if (!(sp.top_p() >= 0.0f && sp.top_p() <= 1.0f)) throw std::invalid_argument("top_p must be in [0, 1]");
  if (!(sp.min_p() >= 0.0f && sp.min_p() <= 1.0f)) throw std::invalid_argument("min_p must be in [0, 1]");
  return {sp.temperature(), static_cast<int32_t>(sp.top_k()), sp.top_p() > 0 ? sp.top_p() : 1.0f, sp.seed(), sp.min_p()};
}

sampling::PenaltyParams penalty_params(const generate::SamplingParams& sp) {
  for (float v : {sp.presence_penalty(), sp.frequency_penalty(), sp.repeat_penalty()})
    if (!std::isfinite(v)) throw std::invalid_argument("penalties must be finite");
  if (sp.repeat_penalty() < 0.0f) throw std::invalid_argument("repeat_penalty must be >= 0");
  return {sp.repeat_penalty() == 0.0f ? 1.0f : sp.repeat_penalty(), sp.frequency_penalty(), sp.presence_penalty(),
          sp.repeat_last_n() > 0 ? static_cast<int32_t>(sp.repeat_last_n()) : 64};
}

}  // namespace

Sequence::Sequence(const generate::SamplingParams& sp, const tokenizer::Tokenizer* tok, std::vector<int32_t> prompt,
                   int64_t context_positions)
    : context(std::move(prompt)), sp_(sp), tok_(tok), prompt_tokens_(context.size()), sampler_(sampler_params(sp)),
      penalties_(penalty_params(sp)), stop_(std::vector<std::string>(sp.stop().begin(), sp.stop().end())) {
  if (sp.top_logprobs() > kMaxTopLogprobs)
    throw std::invalid_argument("top_logprobs must be at most " + std::to_string(kMaxTopLogprobs));
  if (stop_.active() && !tok_) throw std::invalid_argument("stop strings need the model's tokenizer");
  if (const std::string why = stop_limit_problem({sp.stop().begin(), sp.stop().end()}); !why.empty())
    throw std::invalid_argument(why);
  const int64_t p = static_cast<int64_t>(prompt_tokens_);
  if (p >= context_positions) {
    throw std::out_of_range("the prompt has " + std::to_string(p) + " tokens, but the context holds " +
                            std::to_string(context_positions) + " (prompt and generated tokens together)");
  }
  if (sp.max_tokens() > 0) {
    max_new_ = sp.max_tokens();
  } else {
    max_new_ = sp.max_tokens_to_context() ? static_cast<uint32_t>(context_positions - p) : 16;
  }
  if (p + max_new_ > context_positions) {
    throw std::out_of_range("the prompt has " + std::to_string(p) + " tokens and max_tokens asks for " +
                            std::to_string(max_new_) + ", " + std::to_string(p + max_new_) + " in all, but the context holds " +
                            std::to_string(context_positions));
  }
  if (tok_) dec_ = std::make_unique<tokenizer::StreamingDecoder>(*tok_, sp.render_special());
}

int32_t Sequence::sample(std::span<const float> logits) {
  std::span<const float> use = logits;
  if (penalties_.active()) {
    penalised_.assign(logits.begin(), logits.end());
    sampling::apply_penalties(penalised_, context, penalties_);
    use = penalised_;
  }
  const int32_t id = sampler_.sample(use);
  pending_logprobs_.clear();
  record_logprob(logits, id);
  return id;
}

std::vector<int32_t> Sequence::speculate(std::span<const float> rows, size_t n_vocab, std::span<const int32_t> draft) {
  const size_t n_rows = draft.size() + 1, V = n_vocab;
  if (V == 0 || rows.size() != n_rows * V)
    throw std::invalid_argument("speculation: " + std::to_string(rows.size()) + " logits for a draft of " +
                                std::to_string(draft.size()) + " (expected " + std::to_string(n_rows) + " rows of " +
                                std::to_string(V) + ")");
  pending_logprobs_.clear();
  if (penalties_.active()) history_.assign(context.begin(), context.end());
  std::vector<int32_t> out;
  for (size_t i = 0; i < n_rows; ++i) {
    const std::span<const float> row = rows.subspan(i * V, V);
    std::span<const float> use = row;
    if (penalties_.active()) {
      penalised_.assign(row.begin(), row.end());
      sampling::apply_penalties(penalised_, history_, penalties_);
      use = penalised_;
    }
    sampling::Sampler::Verdict v;
    if (i < draft.size()) {
      v = sampler_.verify(use, draft[i]);
    } else {
      v.token = sampler_.sample(use);   // every draft accepted: the bonus token from the last row
    }
    record_logprob(row, v.token);
    out.push_back(v.token);
    if (!v.accepted) break;
    if (penalties_.active()) history_.push_back(v.token);
  }
  return out;
}

void Sequence::record_logprob(std::span<const float> logits, int32_t id) {
  if (!sp_.logprobs()) return;
  // The model's own distribution (the raw logits), as OpenAI reports it, not the sampler's cut one.
  const sampling::LogSoftmax ls(logits);
  generate::TokenLogprob lp;
  lp.set_id(static_cast<uint32_t>(id));
  lp.set_logprob(ls(id));
  if (tok_) lp.set_text(tokenizer::replace_invalid_utf8(tok_->decode(std::vector<int32_t>{id}, false)));
  for (const auto& [alt, l] : ls.top(sp_.top_logprobs())) {
    generate::TopLogprob& t = *lp.add_top();
    t.set_id(static_cast<uint32_t>(alt));
    t.set_logprob(l);
    if (tok_) t.set_text(tokenizer::replace_invalid_utf8(tok_->decode(std::vector<int32_t>{alt}, false)));
  }
  pending_logprobs_.push_back(std::move(lp));
}

bool Sequence::accept(int32_t id, generate::GenerateChunk& chunk) {
  context.push_back(id);
  ++generated_;
  chunk.add_token_ids(static_cast<uint32_t>(id));
  if (!pending_logprobs_.empty() && pending_logprobs_.front().id() == static_cast<uint32_t>(id)) {
    *chunk.add_logprobs() = std::move(pending_logprobs_.front());
    pending_logprobs_.pop_front();
  } else {
    pending_logprobs_.clear();   // a token decided elsewhere (the gpu_worker's greedy one)
  }
  const bool eos = !sp_.ignore_eos() && tok_ && tok_->is_end_of_generation(id);
  const bool length = generated_ >= max_new_;
  std::string text;
  // proto3 strings must be UTF-8: a tiny test vocabulary can decode to stray bytes.
  if (dec_) text = tokenizer::replace_invalid_utf8(dec_->push(id));
  if ((eos || length) && dec_) text += tokenizer::replace_invalid_utf8(dec_->flush());
  const StopMatcher::Step s = stop_.push(text);
  if (s.stopped) {
    chunk.set_text(chunk.text() + s.text);
    finish_ = generate::FINISH_STOP;
    return true;
  }
  chunk.set_text(chunk.text() + s.text);
  if (eos || length) {
    chunk.set_text(chunk.text() + stop_.flush());
    finish_ = eos ? generate::FINISH_STOP : generate::FINISH_LENGTH;
    return true;
  }
  return false;
}

}  // namespace moraine::group
