#include "common/reference/executor.h"

#include <stdexcept>
#include <utility>
#include <string>

#include "common/formats/quant.h"
#include "common/model/sequence_state.h"
#include "common/reference/matmul.h"
#include "common/reference/ops.h"

namespace moraine::reference {

ReferenceExecutor::ReferenceExecutor(const model::Model& model, ExecutorOptions opt)
    : m_(model), pool_(opt.n_threads, opt.min_parallel_work), order_(opt.dot_order), kv_type_(opt.kv_type),
      kv_perturb_seed_(opt.kv_perturb_seed), mla_form_(opt.mla_form) {
  model::check_supported(m_, model::reference_support());
  reset();
}

void ReferenceExecutor::reset() {
  const model::HParams& hp = m_.hp;
  state_.assign(hp.n_layer, LayerState{});
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    if (!m_.layers[il].recurrent) continue;
    state_[il].conv_state.assign((hp.ssm_conv_kernel - 1) * hp.ssm_conv_dim(), 0.0f);
    state_[il].ssm_state.assign(hp.ssm_n_v_heads * hp.ssm_head_k_dim * hp.ssm_head_v_dim, 0.0f);
  }
  n_past_ = 0;
  window_first_ = 0;
  snapshot_pos_ = -1;
  mtp_state_ = LayerState{};
  mtp_n_past_ = 0;
}

void ReferenceExecutor::swap_sequence(Sequence& other) {
  std::swap(state_, other.state);
  std::swap(snapshot_, other.snapshot);
  std::swap(n_past_, other.n_past);
  std::swap(window_first_, other.window_first);
  std::swap(snapshot_pos_, other.snapshot_pos);
  std::swap(mtp_n_past_, other.mtp_n_past);
  std::swap(mtp_state_, other.mtp_state);
}

int64_t ReferenceExecutor::k_width(int64_t il) const {
  const model::LayerWeights& L = block(il);
  if (L.recurrent) return 0;
  if (L.recipe.mixer.kind == model::MixerKind::Mla) return L.recipe.mixer.mla.kv_lora_rank + L.recipe.mixer.mla.rope_dim;
  return m_.hp.n_head_kv * m_.hp.head_dim;
}

int64_t ReferenceExecutor::v_width(int64_t il) const {
  return block(il).recipe.mixer.kind == model::MixerKind::Mla ? 0 : k_width(il);
}

bool ReferenceExecutor::has_recurrent() const {
  for (const auto& L : m_.layers)
    if (L.recurrent) return true;
  return false;
}

void ReferenceExecutor::snapshot() {
  snapshot_.assign(state_.size(), LayerState{});
  for (size_t il = 0; il < state_.size(); ++il) {
    snapshot_[il].conv_state = state_[il].conv_state;
    snapshot_[il].ssm_state = state_[il].ssm_state;
  }
  snapshot_pos_ = n_past_;
}

void ReferenceExecutor::rewind(int64_t n_past) {
  if (n_past < 0 || n_past > n_past_)
    throw std::logic_error("reference executor: rewind to " + std::to_string(n_past) + " positions, but " +
                           std::to_string(n_past_) + " are cached");
  if (has_recurrent() && n_past != snapshot_pos_)
    throw std::logic_error("reference executor: a model with recurrent (DeltaNet) layers rewinds only to its snapshot (" +
                           (snapshot_pos_ < 0 ? std::string("none taken") : "at " + std::to_string(snapshot_pos_)) +
                           "), not to " + std::to_string(n_past));
  for (size_t il = 0; il < state_.size(); ++il) {
    LayerState& S = state_[il];
    if (m_.layers[il].recurrent) {
      S.conv_state = snapshot_[il].conv_state;
      S.ssm_state = snapshot_[il].ssm_state;
      continue;
    }
    S.k_cache.resize(static_cast<size_t>(n_past * k_width(static_cast<int64_t>(il))));
    S.v_cache.resize(static_cast<size_t>(n_past * v_width(static_cast<int64_t>(il))));
  }
  n_past_ = n_past;
  window_first_ = 0;
}

void ReferenceExecutor::embed(std::span<const int32_t> tokens, float* x) const {
  const model::HParams& hp = m_.hp;
  const int64_t d = hp.n_embd;
  for (size_t t = 0; t < tokens.size(); ++t) {
    const int32_t id = tokens[t];
    if (id < 0 || id >= hp.n_vocab) {
      throw std::invalid_argument("token id " + std::to_string(id) + " at position " +
                                  std::to_string(n_past_ + static_cast<int64_t>(t)) +
                                  " is outside the vocabulary [0, " + std::to_string(hp.n_vocab) + ")");
    }
    dequantize_row(m_.tok_embd.type, m_.tok_embd.row(id), x + t * d, d);
  }
}

void ReferenceExecutor::mixer_step(int64_t il, float* x, int64_t n, float* h) {
  const model::HParams& hp = m_.hp;
  const int64_t d = hp.n_embd;
  const float eps = static_cast<float>(hp.rms_eps);
  const model::LayerWeights& L = block(il);
  for (int64_t t = 0; t < n; ++t) rms_norm(x + t * d, L.attn_norm.data(), d, eps, h + t * d);
  if (L.recurrent) {
    delta_net_block(il, h, n, x);
  } else if (L.recipe.mixer.kind == model::MixerKind::Mla) {
    mla_block(il, h, n, x);
  } else {
    attention_block(il, h, n, x);
  }
  for (int64_t t = 0; t < n; ++t) rms_norm(x + t * d, L.ffn_norm.data(), d, eps, h + t * d);
}

void ReferenceExecutor::output_norm(const float* x, int64_t rows, float* h) const {
  const int64_t d = m_.hp.n_embd;
  const float eps = static_cast<float>(m_.hp.rms_eps);
  for (int64_t t = 0; t < rows; ++t) rms_norm(x + t * d, m_.output_norm.data(), d, eps, h + t * d);
}

void ReferenceExecutor::output_logits(const float* x, int64_t rows, float* h, float* logits) {
  output_norm(x, rows, h);
  matmul(m_.output, h, rows, logits, pool_, order_);
}

std::vector<float> ReferenceExecutor::forward(std::span<const int32_t> tokens, bool all_logits, std::vector<float>* hidden) {
  const model::HParams& hp = m_.hp;
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n == 0) return {};
  const int64_t d = hp.n_embd;

  std::vector<float> x(n * d);
  embed(tokens, x.data());
  std::vector<float> h(n * d);
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    mixer_step(il, x.data(), n, h.data());
    ffn_block(il, h.data(), n, x.data());
  }
  advance(n);

  const int64_t first = all_logits ? 0 : n - 1;
  const int64_t rows = n - first;
  std::vector<float> logits(rows * hp.n_vocab);
  output_logits(x.data() + first * d, rows, h.data(), logits.data());
  if (hidden != nullptr) hidden->assign(h.begin(), h.begin() + rows * d);
  return logits;
}

size_t ReferenceExecutor::state_bytes() const {
  size_t sum = 0;
  for (const LayerState& S : state_)
    for (const std::vector<float>* v : {&S.k_cache, &S.v_cache, &S.conv_state, &S.ssm_state}) sum += v->size() * sizeof(float);
  return model::sequence_state_bytes(4 * state_.size(), sum);
}

void ReferenceExecutor::save_state(std::span<uint8_t> out) const {
  model::SequenceStateWriter w(out, n_past_, static_cast<int64_t>(state_.size()));
  for (const LayerState& S : state_) {
    for (const std::vector<float>* v : {&S.k_cache, &S.v_cache, &S.conv_state, &S.ssm_state})
      w.part(v->data(), v->size() * sizeof(float));
  }
}

void ReferenceExecutor::load_state(std::span<const uint8_t> in) {
  model::SequenceStateReader r(in, static_cast<int64_t>(state_.size()));
  const int64_t n = r.n_past();
  std::vector<LayerState> loaded(state_.size());
  for (size_t il = 0; il < state_.size(); ++il) {
    LayerState& L = loaded[il];
    L.k_cache.resize(static_cast<size_t>(n * k_width(static_cast<int64_t>(il))));
    L.v_cache.resize(static_cast<size_t>(n * v_width(static_cast<int64_t>(il))));
    L.conv_state.resize(state_[il].conv_state.size());   // reset() sized the recurrent ones
    L.ssm_state.resize(state_[il].ssm_state.size());
    for (std::vector<float>* v : {&L.k_cache, &L.v_cache, &L.conv_state, &L.ssm_state}) r.part(v->data(), v->size() * sizeof(float));
  }
  r.finish();
  state_ = std::move(loaded);
  n_past_ = n;
  window_first_ = 0;
  snapshot_pos_ = -1;
}

}  // namespace moraine::reference
