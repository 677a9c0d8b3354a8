#include "common/reference/ops.h"

#include <algorithm>
#include <cmath>

namespace moraine::reference {

void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out) {
  // Sum of squares in double as llama.cpp's CPU backend does: on quantized files a last-bit
  // difference here can flip an int8 activation rounding downstream.
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float mean = static_cast<float>(ss / static_cast<double>(n));
  const float inv = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w ? x[i] * inv * w[i] : x[i] * inv;
}

void l2_norm(float* x, int64_t n, float eps) {
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss + eps);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void rope_neox(float* head, int64_t n_rot, int64_t pos, double freq_base) {
  const int64_t half = n_rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double theta = static_cast<double>(pos) *
                         std::pow(freq_base, -2.0 * static_cast<double>(i) / static_cast<double>(n_rot));
    const float c = static_cast<float>(std::cos(theta));
    const float s = static_cast<float>(std::sin(theta));
    const float x0 = head[i];
    const float x1 = head[i + half];
    head[i] = x0 * c - x1 * s;
    head[i + half] = x0 * s + x1 * c;
  }
}

namespace {

// Pair i's rotation under YaRN as ggml_rope_ext computes it; pairs(i, c, s) applies it.
template <class Pairs>
void rope_yarn_pairs(int64_t n_rot, int64_t pos, const model::RopePart& rope, Pairs pairs) {
  const model::YarnRamp r = model::yarn_ramp(rope, n_rot);
  const double freq_base = rope.freq_base, low = r.low, high = r.high, mscale = r.mscale;
  const int64_t half = n_rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double extrap = static_cast<double>(pos) *
                          std::pow(freq_base, -2.0 * static_cast<double>(i) / static_cast<double>(n_rot));
    const double y = (static_cast<double>(i) - low) / std::max(0.001, high - low);
    const double ramp = 1.0 - std::min(1.0, std::max(0.0, y));   // 1: keep the unscaled frequency
    const double theta = extrap / rope.yarn_factor * (1.0 - ramp) + extrap * ramp;
    pairs(i, static_cast<float>(std::cos(theta) * mscale), static_cast<float>(std::sin(theta) * mscale));
  }
}

}  // namespace

void rope_neox_yarn(float* head, int64_t n_rot, int64_t pos, const model::RopePart& rope) {
  const int64_t half = n_rot / 2;
  rope_yarn_pairs(n_rot, pos, rope, [&](int64_t i, float c, float s) {
    const float x0 = head[i];
    const float x1 = head[i + half];
    head[i] = x0 * c - x1 * s;
    head[i + half] = x0 * s + x1 * c;
  });
}

void rope_norm(float* head, int64_t n_rot, int64_t pos, double freq_base, const model::RopePart* yarn) {
  const auto rotate = [&](int64_t i, float c, float s) {
    const float x0 = head[2 * i];
    const float x1 = head[2 * i + 1];
    head[2 * i] = x0 * c - x1 * s;
    head[2 * i + 1] = x0 * s + x1 * c;
  };
  if (yarn != nullptr) {
    rope_yarn_pairs(n_rot, pos, *yarn, rotate);
    return;
  }
  for (int64_t i = 0; i < n_rot / 2; ++i) {
    const double theta = static_cast<double>(pos) *
                         std::pow(freq_base, -2.0 * static_cast<double>(i) / static_cast<double>(n_rot));
    rotate(i, static_cast<float>(std::cos(theta)), static_cast<float>(std::sin(theta)));
  }
}

void attend_one_head_sink(const float* q, const float* k, const float* v, int64_t n_kv, int64_t kv_stride,
                          int64_t head_dim, float scale, float sink, float* scores, float* out) {
  float mx = sink;
  for (int64_t j = 0; j < n_kv; ++j) {
    const float* kj = k + j * kv_stride;
    float s = 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) s += q[d] * kj[d];
    scores[j] = s * scale;
    mx = std::fmax(mx, scores[j]);
  }
  float sum = std::exp(sink - mx);
  for (int64_t j = 0; j < n_kv; ++j) {
    scores[j] = std::exp(scores[j] - mx);
    sum += scores[j];
  }
  const float inv = 1.0f / sum;
  for (int64_t d = 0; d < head_dim; ++d) out[d] = 0.0f;
  for (int64_t j = 0; j < n_kv; ++j) {
    const float p = scores[j] * inv;
    const float* vj = v + j * kv_stride;
    for (int64_t d = 0; d < head_dim; ++d) out[d] += p * vj[d];
  }
}

float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

void attend_rows(const float* q, int64_t kdim, const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                 int64_t vdim, int64_t n_kv, float scale, float* scores, float* out) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < n_kv; ++j) {
    const float* kj = k + j * k_stride;
    float s = 0.0f;
    for (int64_t d = 0; d < kdim; ++d) s += q[d] * kj[d];
    scores[j] = s * scale;
    mx = std::fmax(mx, scores[j]);
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < n_kv; ++j) {
    scores[j] = std::exp(scores[j] - mx);
    sum += scores[j];
  }
  const float inv = 1.0f / sum;
  for (int64_t d = 0; d < vdim; ++d) out[d] = 0.0f;
  for (int64_t j = 0; j < n_kv; ++j) {
    const float p = scores[j] * inv;
    const float* vj = v + j * v_stride;
    for (int64_t d = 0; d < vdim; ++d) out[d] += p * vj[d];
  }
}

void attend_one_head(const float* q, const float* k, const float* v, int64_t n_kv,
                     int64_t kv_stride, int64_t head_dim, float scale, float* scores, float* out) {
  attend_rows(q, head_dim, k, kv_stride, v, kv_stride, head_dim, n_kv, scale, scores, out);
}

void conv1d_silu_step(const float* w, int64_t kernel, int64_t channels, float* state,
                      const float* x, float* out) {
  const int64_t hist = kernel - 1;
  for (int64_t c = 0; c < channels; ++c) {
    const float* wc = w + c * kernel;
    float acc = 0.0f;
    for (int64_t j = 0; j < hist; ++j) acc += wc[j] * state[j * channels + c];
    acc += wc[hist] * x[c];
    out[c] = silu(acc);
  }
  // Shift the window: drop the oldest input, append x.
  for (int64_t j = 0; j + 1 < hist; ++j) {
    for (int64_t c = 0; c < channels; ++c) state[j * channels + c] = state[(j + 1) * channels + c];
  }
  if (hist > 0) {
    for (int64_t c = 0; c < channels; ++c) state[(hist - 1) * channels + c] = x[c];
  }
}

void delta_rule_step(float* S, const float* q, const float* k, const float* v, float g,
                     float beta, int64_t dk, int64_t dv, float scale, float* o) {
  const float decay = std::exp(g);
  for (int64_t i = 0; i < dk * dv; ++i) S[i] *= decay;
  // u = beta * (v - S^T k), computed column by column of S.
  for (int64_t j = 0; j < dv; ++j) o[j] = 0.0f;  // o holds S^T k for now
  for (int64_t i = 0; i < dk; ++i) {
    const float ki = k[i];
    const float* Si = S + i * dv;
    for (int64_t j = 0; j < dv; ++j) o[j] += Si[j] * ki;
  }
  for (int64_t j = 0; j < dv; ++j) o[j] = beta * (v[j] - o[j]);
  for (int64_t i = 0; i < dk; ++i) {
    const float ki = k[i];
    float* Si = S + i * dv;
    for (int64_t j = 0; j < dv; ++j) Si[j] += ki * o[j];
  }
  for (int64_t j = 0; j < dv; ++j) o[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    const float qi = q[i] * scale;
    const float* Si = S + i * dv;
    for (int64_t j = 0; j < dv; ++j) o[j] += Si[j] * qi;
  }
}

}  // namespace moraine::reference
