// Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalties, with a seeded std::mt19937_64 so a run is
// reproducible from its seed on any platform (uniforms come from the raw 64-bit draws, not from
// std::uniform_real_distribution, whose algorithm the standard leaves to each library).
#pragma once
#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

namespace moraine::sampling {

struct SamplerParams {
  float temperature = 0.0f;  // <= 0: greedy (argmax)
  int32_t top_k = 0;         // <= 0: no top-k cut
  float top_p = 1.0f;        // >= 1: no nucleus cut
  uint64_t seed = 0;
  float min_p = 0.0f;        // <= 0: no cut; else drop tokens below min_p * the top token's probability (at temperature 1, as llama.cpp)
};

// Repetition penalties over the last `last_n` tokens of the history, as llama.cpp's sampler and
// OpenAI's API define them: an occurred token's logit is divided by `repeat` when positive and
// multiplied by it when negative, then `frequency` * its count and `presence` once are subtracted.
struct PenaltyParams {
  float repeat = 1.0f;       // 1 (or 0): off
  float frequency = 0.0f;
  float presence = 0.0f;
  int32_t last_n = 64;       // <= 0: the whole history
  bool active() const { return (repeat != 1.0f && repeat != 0.0f) || frequency != 0.0f || presence != 0.0f; }
};
// Applies `p` to `logits` in place; tokens of the history outside the vocabulary are ignored.
void apply_penalties(std::span<float> logits, std::span<const int32_t> history, const PenaltyParams& p);

// log softmax of one logit among all of them (for OpenAI's logprobs): logits[id] - log sum exp.
struct LogSoftmax {
  explicit LogSoftmax(std::span<const float> logits);
  float operator()(int32_t id) const { return static_cast<float>(static_cast<double>(logits_[static_cast<size_t>(id)]) - lse_); }
  // The k most likely tokens (ties: lower id first) with their log-probabilities.
  std::vector<std::pair<int32_t, float>> top(size_t k) const;

 private:
  std::span<const float> logits_;
  double lse_ = 0.0;
};

// Index of the largest logit; ties go to the lowest index. Throws on an empty span.
int32_t argmax(std::span<const float> logits);

class Sampler {
 public:
  explicit Sampler(SamplerParams p);

  // The distribution the sampler draws from, as (token, probability) sorted by probability
  // descending (ties: lower token first): top-k cut, softmax at the temperature, top-p cut
  // (the smallest prefix whose mass reaches top_p), min-p cut (among those, the tokens whose
  // probability at temperature 1 is at least min_p times the top one's), renormalised. Greedy gives one entry.
  std::vector<std::pair<int32_t, float>> distribution(std::span<const float> logits) const;

  int32_t sample(std::span<const float> logits);

  // Speculative sampling's test of one verify row whose draft token is `draft`. The drafters are
  // deterministic (suffix matches, the MTP head's argmax), so the draft distribution q is a point
  // mass on `draft` and the standard rule reduces to: accept with probability p(draft), p being
  // distribution() of these logits; else draw from max(0, p - q) renormalised, i.e. p without
  // `draft`. The token returned is distributed as p exactly, as sample()'s would be, but from
  // other random draws (one, or two on a rejection), so a seed's stream differs from plain
  // sampling's. Greedy: the argmax, accepted when it is the draft, with no random draw.
  struct Verdict {
    int32_t token = -1;
    bool accepted = false;
  };
  Verdict verify(std::span<const float> logits, int32_t draft);

  const SamplerParams& params() const { return p_; }

 private:
  struct Kept {
    std::vector<int32_t> ids;   // the kept tokens, by probability descending; with no cut in sample(), every id in order
    std::vector<double> w;      // their weights exp((logit - max) / temperature)
    double z = 0.0;             // the weights' sum over what the top-p cut measures against
  };
  // sorted_all: list every token sorted even when no cut applies (distribution()).
  Kept kept(std::span<const float> logits, bool sorted_all) const;
  Kept kept_before_min_p(std::span<const float> logits, bool sorted_all) const;
  void cut_min_p(Kept& k) const;
  double uniform01();  // [0, 1) with 53 random bits
  SamplerParams p_;
  std::mt19937_64 rng_;
};

}  // namespace moraine::sampling
