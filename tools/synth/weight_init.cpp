#include "tools/synth/weight_init.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "tools/synth/random_stream.h"
#include "tools/synth/router_skew.h"

namespace moraine::synth {

namespace {

constexpr float kSqrt3 = 1.7320508f;  // a uniform on [-a, a] has std a / sqrt(3)

// out[i] = std * U(-sqrt3, sqrt3): unit-variance uniform noise scaled to `std`.
void fill_uniform(RowRandom& rng, float* out, int64_t n, float std_dev) {
  const float a = kSqrt3 * std_dev;
  int64_t i = 0;
  for (; i + 1 < n; i += 2) {
    float x, y;
    rng.next_pair(x, y);
    out[i] = a * x;
    out[i + 1] = a * y;
  }
  if (i < n) {
    float x, y;
    rng.next_pair(x, y);
    out[i] = a * x;
  }
}

}  // namespace

WeightInit::WeightInit(const ShapeSpec& shape, uint64_t seed, double zipf) : shape_(shape), seed_(seed) {
  uint64_t st = seed ^ 0x3A55'1BE0ull;
  massive_dim_ = static_cast<int64_t>(splitmix64(st) % static_cast<uint64_t>(shape.hidden));
  rank_bias_ = calibrate_rank_biases(shape.n_expert, shape.n_expert_used, zipf, seed);
  for (int64_t il = 0; il < shape.n_layer; ++il) layer_rank_.push_back(popularity_ranks(shape.n_expert, seed, il));
  recency_ = design_recency(shape, massive_dim_);
}

RouterInputModel WeightInit::router_input(int64_t layer) const {
  RouterInputModel m = router_input_model(shape_.hidden, massive_dim_, layer, shape_.n_layer);
  m.slow_count = recency_.slow_count;
  m.slow_var = recency_.slow_var[static_cast<size_t>(layer)];
  return m;
}

namespace {

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::char_traits<char>::length(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// Scales row[i] for the i where pick(i) so that their norm is `norm`.
template <class Pick>
void set_norm(float* row, int64_t n, double norm, Pick pick) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += pick(i) ? static_cast<double>(row[i]) * row[i] : 0.0;
  const float f = ss > 0 ? static_cast<float>(norm / std::sqrt(ss)) : 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    if (pick(i)) row[i] *= f;
  }
}

}  // namespace

void WeightInit::fill_rows(const TensorSpec& t, int64_t row_begin, int64_t row_end, float* out) const {
  const int64_t n = t.shape[0];
  const int64_t H = shape_.hidden, j = massive_dim_;
  const RecencyDesign& S = recency_;
  const uint64_t key = hash_name(t.name, seed_);
  const float fan_in = static_cast<float>(n);
  const float layer_scale = 1.0f / std::sqrt(2.0f * static_cast<float>(std::max<int64_t>(shape_.n_layer, 1)));
  for (int64_t r = row_begin; r < row_end; ++r) {
    float* row = out + (r - row_begin) * n;
    RowRandom rng(key, static_cast<uint64_t>(r));
    switch (t.role) {
      case Role::Embedding:
        fill_uniform(rng, row, n, 1.0f);
        row[j] = std::sqrt(static_cast<float>(H));
        for (int64_t i = 0; i < n; ++i) {
          if (S.slow(i)) row[i] = 0.0f;   // only the recency heads write S
        }
        break;
      case Role::Norm:
        fill_uniform(rng, row, n, 0.05f / kSqrt3);
        for (int64_t i = 0; i < n; ++i) row[i] += 1.0f;
        if (n == H) row[j] = 1.0f;
        break;
      case Role::HeadNorm:
        fill_uniform(rng, row, n, 0.05f / kSqrt3);
        for (int64_t i = 0; i < n; ++i) row[i] += 1.0f;
        // The recency heads' score scale (shared by every head of the layer: one norm per layer).
        if (ends_with(t.name, "attn_q_norm.weight") || ends_with(t.name, "attn_k_norm.weight")) {
          for (int64_t i = 0; i < std::min(n, shape_.n_rot); ++i) row[i] = static_cast<float>(std::sqrt(S.amp));
        }
        break;
      case Role::InProj:
      case Role::SharedGate:
      case Role::Output:
        fill_uniform(rng, row, n, 1.0f / std::sqrt(fan_in));
        if (n == H) row[j] = 0.0f;
        if (t.layer >= 0 && S.attention(t.layer)) recency_in_proj(t, r, row);
        break;
      case Role::OutProj:
        // Every output projection's rows run over the hidden state (rows of expert e follow
        // those of e - 1), so the row's output coordinate is r mod hidden.
        fill_uniform(rng, row, n, layer_scale / std::sqrt(fan_in));
        if (r % H == j) std::fill(row, row + n, 0.0f);
        if (ends_with(t.name, "attn_output.weight")) {
          // The recency heads write S and nothing else; nothing else writes S. Inputs are the
          // heads' outputs, head h at [h * head_dim, (h + 1) * head_dim).
          const int64_t hd = shape_.head_dim;
          if (S.slow(r)) {
            std::fill(row, row + n, 0.0f);
            const int64_t i = r - S.slow_first, g = i / S.dims_per_head;
            row[g * S.group * hd + i % S.dims_per_head] = static_cast<float>(S.out_gain[static_cast<size_t>(t.layer)]);
          } else {
            for (int64_t g = 0; g < S.heads; ++g) std::fill_n(row + g * S.group * hd, hd, 0.0f);
          }
        } else if (S.slow(r % H)) {
          std::fill(row, row + n, 0.0f);
        }
        break;
      case Role::Router: {
        const RouterInputModel m = router_input(t.layer);
        // After RMSNorm a token-dependent coordinate has variance v / rms^2 (slow_var / rms^2 in
        // S); scale the row so its dot with them has std kLogitNoise, a share kSlowShare of the
        // variance from S when S holds anything at this layer, and element j = bias * rms / m.
        const bool slow = m.slow_var > 0;
        const double share = slow ? kSlowShare : 0.0;
        fill_uniform(rng, row, n, 1.0f);
        row[j] = 0.0f;
        // Every row gets exactly the same norms: a row 3% longer than the others would be picked
        // ~13% more often from the top-k tail (measured: without this, --zipf 0 routed the most
        // popular of 64 experts 1.8x as often as the least).
        set_norm(row, n, kLogitNoise * std::sqrt(1.0 - share) * m.rms() / std::sqrt(m.offaxis_var),
                 [&](int64_t i) { return i != j && !S.slow(i); });
        if (slow) {
          set_norm(row, n, kLogitNoise * std::sqrt(share) * m.rms() / std::sqrt(m.slow_var),
                   [&](int64_t i) { return S.slow(i); });
        } else {
          for (int64_t i = 0; i < n; ++i) {
            if (S.slow(i)) row[i] = 0.0f;
          }
        }
        const int64_t rank = layer_rank_.at(static_cast<size_t>(t.layer))[static_cast<size_t>(r)];
        row[j] = static_cast<float>(kLogitNoise * rank_bias_[static_cast<size_t>(rank)] * m.rms() / m.massive_value);
        break;
      }
      case Role::Conv:
        fill_uniform(rng, row, n, 1.0f / std::sqrt(fan_in));
        break;
      case Role::Bias:
        // Small beside the projections' O(1) outputs; nothing biases the massive coordinate.
        fill_uniform(rng, row, n, 0.05f / kSqrt3);
        if (n == H) row[j] = 0.0f;
        break;
      case Role::Sink:
        fill_uniform(rng, row, n, 1.0f);
        break;
      case Role::DtBias:
        fill_uniform(rng, row, n, 0.5f / kSqrt3);
        for (int64_t i = 0; i < n; ++i) row[i] += 1.0f;
        break;
      case Role::Decay:
        fill_uniform(rng, row, n, 1.0f / kSqrt3);
        for (int64_t i = 0; i < n; ++i) row[i] = -std::exp(row[i]);
        break;
    }
  }
}

void WeightInit::recency_in_proj(const TensorSpec& t, int64_t r, float* row) const {
  const int64_t hd = shape_.head_dim, n = t.shape[0];
  const bool q = ends_with(t.name, "attn_q.weight"), k = ends_with(t.name, "attn_k.weight");
  if (!q && !k) return;
  // qwen3next's q rows are per head [head_dim query | head_dim gate].
  const int64_t per_head = q && shape_.next() ? 2 * hd : hd;
  const int64_t head = r / per_head, within = r % per_head;
  // A recency q head, or the kv head of one (kv head g serves recency head g).
  if (q ? recency_.recency_head(head) < 0 : head >= recency_.heads) return;
  std::fill(row, row + n, 0.0f);
  if (within < shape_.n_rot) {
    row[massive_dim_] = 1.0f;   // constant on the rotated dims; the q/k norm fixes the scale
  } else if (within >= hd) {
    // The head's output gate: ~8 for every token, sigmoid ~1, so the smoothed values pass.
    const RouterInputModel m = router_input(t.layer);
    row[massive_dim_] = static_cast<float>(8.0 * m.rms() / m.massive_value);
  }
}

}  // namespace moraine::synth
