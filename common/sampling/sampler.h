// Token sampling: greedy, temperature, top-k, top-p, with a seeded std::mt19937_64 so a run is
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
};

// Index of the largest logit; ties go to the lowest index. Throws on an empty span.
int32_t argmax(std::span<const float> logits);

class Sampler {
 public:
  explicit Sampler(SamplerParams p);

  // The distribution the sampler draws from, as (token, probability) sorted by probability
  // descending (ties: lower token first): top-k cut, softmax at the temperature, top-p cut
  // (the smallest prefix whose mass reaches top_p), renormalised. Greedy gives one entry.
  std::vector<std::pair<int32_t, float>> distribution(std::span<const float> logits) const;

  int32_t sample(std::span<const float> logits);

  const SamplerParams& params() const { return p_; }

 private:
  struct Kept {
    std::vector<int32_t> ids;   // the kept tokens, by probability descending; with no cut in sample(), every id in order
    std::vector<double> w;      // their weights exp((logit - max) / temperature)
    double z = 0.0;             // the weights' sum over what the top-p cut measures against
  };
  // sorted_all: list every token sorted even when no cut applies (distribution()).
  Kept kept(std::span<const float> logits, bool sorted_all) const;
  double uniform01();  // [0, 1) with 53 random bits
  SamplerParams p_;
  std::mt19937_64 rng_;
};

}  // namespace moraine::sampling
