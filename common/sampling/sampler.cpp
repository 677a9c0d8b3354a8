#include "common/sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace moraine::sampling {

// Two passes instead of one loop: the loop `if (logits[i] > logits[best]) best = i` carries a load
// whose address depends on the previous iteration's result (598 us per token over 151,936
// logits, 17% of an all-in-VRAM step; docs/perf-log.md#session-7-sampler). Here the maximum
// comes from 16 independent lanes (one vector max instruction per 16 logits: `v > m ? v : m` is
// exactly x86's maxps), then the first index holding it. Same answer as the one loop: a NaN never
// wins (nor does anything against a NaN at index 0, which then stays the answer), ties go to the
// lowest index.
int32_t argmax(std::span<const float> logits) {
  if (logits.empty()) throw std::invalid_argument("argmax: empty logits");
  constexpr size_t kLanes = 16;
  const float* x = logits.data();
  const size_t n = logits.size();
  float lane[kLanes];
  for (float& m : lane) m = x[0];
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t j = 0; j < kLanes; ++j) lane[j] = x[i + j] > lane[j] ? x[i + j] : lane[j];
  }
  float best = x[0];
  for (float m : lane) best = m > best ? m : best;
  for (; i < n; ++i) best = x[i] > best ? x[i] : best;
  if (best != best) return 0;   // x[0] is NaN: nothing compares greater
  for (size_t k = 0; k < n; ++k) {
    if (x[k] == best) return static_cast<int32_t>(k);
  }
  return 0;   // not reached: best is one of the values
}

void apply_penalties(std::span<float> logits, std::span<const int32_t> history, const PenaltyParams& p) {
  if (!p.active()) return;
  const size_t from = p.last_n > 0 && history.size() > static_cast<size_t>(p.last_n) ? history.size() - static_cast<size_t>(p.last_n) : 0;
  // Sparse counts: the window holds at most last_n distinct tokens of a 150k vocabulary.
  std::vector<std::pair<int32_t, int32_t>> counts;
  for (size_t i = from; i < history.size(); ++i) {
    const int32_t id = history[i];
    if (id < 0 || static_cast<size_t>(id) >= logits.size()) continue;
    auto it = std::find_if(counts.begin(), counts.end(), [&](const auto& c) { return c.first == id; });
    if (it == counts.end()) {
      counts.emplace_back(id, 1);
    } else {
      ++it->second;
    }
  }
  const bool repeat = p.repeat != 1.0f && p.repeat != 0.0f;
  for (const auto& [id, n] : counts) {
    float& l = logits[static_cast<size_t>(id)];
    if (repeat) l = l > 0.0f ? l / p.repeat : l * p.repeat;
    l -= static_cast<float>(n) * p.frequency + p.presence;
  }
}

LogSoftmax::LogSoftmax(std::span<const float> logits) : logits_(logits) {
  if (logits.empty()) throw std::invalid_argument("log softmax: empty logits");
  const double mx = logits[static_cast<size_t>(argmax(logits))];
  double z = 0.0;
  for (float l : logits) z += std::exp(static_cast<double>(l) - mx);
  lse_ = mx + std::log(z);
}

std::vector<std::pair<int32_t, float>> LogSoftmax::top(size_t k) const {
  k = std::min(k, logits_.size());
  std::vector<int32_t> ids(logits_.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(), [&](int32_t a, int32_t b) {
    return logits_[static_cast<size_t>(a)] > logits_[static_cast<size_t>(b)] ||
           (logits_[static_cast<size_t>(a)] == logits_[static_cast<size_t>(b)] && a < b);
  });
  std::vector<std::pair<int32_t, float>> out;
  for (size_t i = 0; i < k; ++i) out.emplace_back(ids[i], (*this)(ids[i]));
  return out;
}

Sampler::Sampler(SamplerParams p) : p_(p), rng_(p.seed) {
  if (!std::isfinite(p_.temperature)) throw std::invalid_argument("sampler: temperature must be finite");
  if (!(p_.top_p > 0.0f)) throw std::invalid_argument("sampler: top_p must be > 0");
  if (!(p_.min_p >= 0.0f && p_.min_p <= 1.0f)) throw std::invalid_argument("sampler: min_p must be in [0, 1]");
}

// The min-p cut of what the other cuts kept, as llama.cpp's chain applies it (before the
// temperature): a token stays when its probability at temperature 1 is at least min_p times the
// top token's, i.e. logit - max >= ln(min_p). The weights are exp((logit - max) / T), so that is
// w >= min_p^(1/T) (the top token's weight is 1).
void Sampler::cut_min_p(Kept& k) const {
  if (p_.min_p <= 0.0f) return;
  const double threshold = std::pow(static_cast<double>(p_.min_p), 1.0 / static_cast<double>(p_.temperature));
  size_t out = 0;
  for (size_t i = 0; i < k.ids.size(); ++i) {
    if (k.w[i] >= threshold) {
      k.ids[out] = k.ids[i];
      k.w[out] = k.w[i];
      ++out;
    }
  }
  k.ids.resize(out);
  k.w.resize(out);
}

// The kept tokens, most likely first (ties: lower id), with their unnormalised weights
// exp((logit - max) / T) and the normaliser the top-p cut measures mass against.
//
// Sorting only what a cut needs: a full sort of the vocabulary per token took 20-22 ms, a 50 tok/s
// ceiling (docs/perf-log.md#session-7-sampler). Top-k sorts its k; top-p sorts the tokens above a
// weight threshold once they hold the mass; no cut sorts nothing (sample() draws in id order,
// distribution() still lists every token sorted).
Sampler::Kept Sampler::kept(std::span<const float> logits, bool sorted_all) const {
  Kept k = kept_before_min_p(logits, sorted_all);
  cut_min_p(k);
  return k;
}

Sampler::Kept Sampler::kept_before_min_p(std::span<const float> logits, bool sorted_all) const {
  const size_t V = logits.size();
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  const float inv_t = 1.0f / p_.temperature;
  const auto weight = [&](size_t id, float mx) { return static_cast<double>(std::exp((logits[id] - mx) * inv_t)); };
  Kept k;
  // How many of `ids` (most likely first; w_of(i) the weight of ids[i]) it takes to hold top_p of
  // the mass z; ids.size() when they do not.
  const auto top_p_count = [&](const std::vector<int32_t>& ids, const auto& w_of) {
    double cum = 0.0;
    for (size_t i = 0; i < ids.size(); ++i) {
      cum += w_of(i) / k.z;
      if (cum >= p_.top_p) return i + 1;
    }
    return ids.size();
  };
  if (p_.top_k > 0 && static_cast<size_t>(p_.top_k) < V) {   // top-k, then top-p among the k
    k.ids.resize(V);
    std::iota(k.ids.begin(), k.ids.end(), 0);
    std::partial_sort(k.ids.begin(), k.ids.begin() + p_.top_k, k.ids.end(), by_logit);
    k.ids.resize(static_cast<size_t>(p_.top_k));
    for (int32_t id : k.ids) k.w.push_back(weight(id, logits[k.ids[0]]));
    for (double x : k.w) k.z += x;
    if (p_.top_p < 1.0f) {
      const size_t n = top_p_count(k.ids, [&](size_t i) { return k.w[i]; });
      k.ids.resize(n);
      k.w.resize(n);
    }
    return k;
  }
  const float mx = logits[argmax(logits)];
  std::vector<double> w_all(V);
  for (size_t i = 0; i < V; ++i) w_all[i] = weight(i, mx);
  for (double x : w_all) k.z += x;   // apart: summing into k.z beside the stores reloads it each time
  if (p_.top_p >= 1.0f && !sorted_all) {   // no cut: every token, in id order
    k.ids.resize(V);
    std::iota(k.ids.begin(), k.ids.end(), 0);
    k.w = std::move(w_all);
    return k;
  }
  // The smallest prefix whose mass reaches top_p lies among the tokens of weight >= tau as soon
  // as those hold top_p of the mass (every other token weighs less than each of them): gather
  // them with one plain scan, sort only them; lower tau until they do (a flat distribution).
  for (double tau = p_.top_p >= 1.0f ? 0.0 : k.z * 1e-4;; tau *= 1e-3) {
    std::vector<int32_t> ids;
    double held = 0.0;
    for (size_t i = 0; i < V; ++i) {
      if (w_all[i] >= tau) {
        ids.push_back(static_cast<int32_t>(i));
        held += w_all[i];
      }
    }
    const bool all = ids.size() == V || tau <= 0.0;
    if (held < p_.top_p * k.z && !all) continue;
    std::sort(ids.begin(), ids.end(), by_logit);
    const size_t n = p_.top_p < 1.0f ? top_p_count(ids, [&](size_t i) { return w_all[ids[i]]; }) : ids.size();
    if (n == ids.size() && p_.top_p < 1.0f && !all) continue;   // held it only by rounding: widen
    k.ids.assign(ids.begin(), ids.begin() + n);
    for (int32_t id : k.ids) k.w.push_back(w_all[id]);
    return k;
  }
}

std::vector<std::pair<int32_t, float>> Sampler::distribution(std::span<const float> logits) const {
  if (logits.empty()) throw std::invalid_argument("sampler: empty logits");
  if (p_.temperature <= 0.0f) return {{argmax(logits), 1.0f}};
  const Kept k = kept(logits, true);
  double total = 0.0;
  for (double x : k.w) total += x;
  std::vector<std::pair<int32_t, float>> out(k.ids.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = {k.ids[i], static_cast<float>(k.w[i] / total)};
  return out;
}

double Sampler::uniform01() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

int32_t Sampler::sample(std::span<const float> logits) {
  if (logits.empty()) throw std::invalid_argument("sampler: empty logits");
  if (p_.temperature <= 0.0f) return argmax(logits);
  const Kept k = kept(logits, false);
  double total = 0.0;
  for (double x : k.w) total += x;
  const double u = uniform01() * total;
  double cum = 0.0;
  for (size_t i = 0; i < k.ids.size(); ++i) {
    cum += k.w[i];
    if (u < cum) return k.ids[i];
  }
  return k.ids.back();   // u landed in the rounding gap above the last cumulative sum
}

Sampler::Verdict Sampler::verify(std::span<const float> logits, int32_t draft) {
  if (logits.empty()) throw std::invalid_argument("sampler: empty logits");
  if (p_.temperature <= 0.0f) {
    const int32_t best = argmax(logits);
    return {best, best == draft};
  }
  const Kept k = kept(logits, false);
  double total = 0.0, w_draft = 0.0;
  for (size_t i = 0; i < k.ids.size(); ++i) {
    total += k.w[i];
    if (k.ids[i] == draft) w_draft = k.w[i];
  }
  // u < p(draft) with u uniform in [0, 1): a draft the cuts dropped (weight 0) is never accepted.
  if (uniform01() * total < w_draft) return {draft, true};
  const double rest = total - w_draft;
  const double u = uniform01() * rest;
  double cum = 0.0;
  int32_t last = -1;
  for (size_t i = 0; i < k.ids.size(); ++i) {
    if (k.ids[i] == draft) continue;
    cum += k.w[i];
    last = k.ids[i];
    if (u < cum) return {last, false};
  }
  // u landed in the rounding gap above the last sum; no other token at all only when the draft
  // holds all the mass, which the first draw then always accepts.
  return {last >= 0 ? last : draft, last < 0};
}

}  // namespace moraine::sampling
