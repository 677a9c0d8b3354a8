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
}

void WeightInit::fill_rows(const TensorSpec& t, int64_t row_begin, int64_t row_end, float* out) const {
  const int64_t n = t.shape[0];
  const int64_t H = shape_.hidden, j = massive_dim_;
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
        break;
      case Role::Norm:
        fill_uniform(rng, row, n, 0.05f / kSqrt3);
        for (int64_t i = 0; i < n; ++i) row[i] += 1.0f;
        if (n == H) row[j] = 1.0f;
        break;
      case Role::HeadNorm:
        fill_uniform(rng, row, n, 0.05f / kSqrt3);
        for (int64_t i = 0; i < n; ++i) row[i] += 1.0f;
        break;
      case Role::InProj:
      case Role::SharedGate:
      case Role::Output:
        fill_uniform(rng, row, n, 1.0f / std::sqrt(fan_in));
        if (n == H) row[j] = 0.0f;
        break;
      case Role::OutProj:
        // Every output projection's rows run over the hidden state (rows of expert e follow
        // those of e - 1), so the row's output coordinate is r mod hidden.
        fill_uniform(rng, row, n, layer_scale / std::sqrt(fan_in));
        if (r % H == j) std::fill(row, row + n, 0.0f);
        break;
      case Role::Router: {
        const RouterInputModel m = router_input_model(H, j, t.layer, shape_.n_layer);
        // After RMSNorm the token-dependent coordinates have variance v / rms^2 each; scale the
        // row so their dot with it has std kLogitNoise, and element j = bias * rms / m.
        const double noise_norm = std::sqrt(static_cast<double>(H - 1) * m.offaxis_var) / m.rms();
        fill_uniform(rng, row, n, static_cast<float>(kLogitNoise / noise_norm));
        // Give every row the same norm: a row 3% longer than the others would be picked ~13%
        // more often from the top-k tail (measured: without this, --zipf 0 routed the most
        // popular of 64 experts 1.8x as often as the least).
        row[j] = 0.0f;
        double ss = 0;
        for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(row[i]) * row[i];
        const double want = kLogitNoise / noise_norm * std::sqrt(static_cast<double>(n - 1));
        const float rescale = ss > 0 ? static_cast<float>(want / std::sqrt(ss)) : 0.0f;
        for (int64_t i = 0; i < n; ++i) row[i] *= rescale;
        const int64_t rank = layer_rank_.at(static_cast<size_t>(t.layer))[static_cast<size_t>(r)];
        row[j] = static_cast<float>(kLogitNoise * rank_bias_[static_cast<size_t>(rank)] * m.rms() / m.massive_value);
        break;
      }
      case Role::Conv:
        fill_uniform(rng, row, n, 1.0f / std::sqrt(fan_in));
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

}  // namespace moraine::synth
