#include "common/model/layer_tensors.h"

#include <stdexcept>

namespace moraine::model {

namespace {

class SlotList {
 public:
  SlotList(const HParams& hp, int64_t il, std::vector<TensorSlot>& out) : d_(*hp.desc), il_(il), out_(out) {}
  void add(TensorRole r, std::vector<int64_t> shape, bool optional = false) {
    out_.push_back({r, d_.gguf_name(r, il_), std::move(shape), il_, optional});
  }

 private:
  const ArchDesc& d_;
  int64_t il_;
  std::vector<TensorSlot>& out_;
};

void attention(const HParams& hp, const AttentionPart& a, SlotList& s) {
  const int64_t E = hp.n_embd, hd = hp.head_dim, q_dim = hp.n_head * hd, kv_dim = hp.n_head_kv * hd;
  s.add(TensorRole::AttnQ, {E, a.output_gate ? 2 * q_dim : q_dim});
  s.add(TensorRole::AttnK, {E, kv_dim});
  s.add(TensorRole::AttnV, {E, kv_dim});
  s.add(TensorRole::AttnO, {q_dim, E});
  if (a.qk_norm) {
    s.add(TensorRole::AttnQNorm, {hd});
    s.add(TensorRole::AttnKNorm, {hd});
  }
  if (a.qkv_bias) {
    s.add(TensorRole::AttnQBias, {q_dim});
    s.add(TensorRole::AttnKBias, {kv_dim});
    s.add(TensorRole::AttnVBias, {kv_dim});
  }
  if (a.o_bias) s.add(TensorRole::AttnOBias, {E});
  if (a.sinks) s.add(TensorRole::AttnSinks, {hp.n_head});
}

// llama.cpp's deepseek2 tensors: k_b is stored per head transposed ({nope, rank, n_head}), so
// k_b's head h, as a matrix, maps a query's nope part to the latent (the absorbed form).
void mla(const HParams& hp, const MlaPart& m, SlotList& s) {
  const int64_t E = hp.n_embd, H = hp.n_head, qk = m.nope_dim + m.rope_dim;
  if (m.q_lora_rank > 0) {
    s.add(TensorRole::MlaQA, {E, m.q_lora_rank});
    s.add(TensorRole::MlaQANorm, {m.q_lora_rank});
    s.add(TensorRole::MlaQB, {m.q_lora_rank, H * qk});
  } else {
    s.add(TensorRole::AttnQ, {E, H * qk});
  }
  s.add(TensorRole::MlaKvAMqa, {E, m.kv_lora_rank + m.rope_dim});
  s.add(TensorRole::MlaKvANorm, {m.kv_lora_rank});
  if (m.split_kv_b) {
    s.add(TensorRole::MlaKB, {m.nope_dim, m.kv_lora_rank, H});
    s.add(TensorRole::MlaVB, {m.kv_lora_rank, m.v_dim, H});
  } else {
    s.add(TensorRole::MlaKvB, {m.kv_lora_rank, H * (m.nope_dim + m.v_dim)});
  }
  s.add(TensorRole::AttnO, {H * m.v_dim, E});
}

void delta_net(const HParams& hp, const DeltaNetPart& p, SlotList& s) {
  const int64_t E = hp.n_embd, conv_dim = hp.ssm_conv_dim(), v_dim = hp.ssm_value_dim(), nv = hp.ssm_n_v_heads;
  s.add(TensorRole::DnQkv, {E, conv_dim});
  s.add(TensorRole::DnGate, {E, v_dim});
  if (p.split_ba) {
    s.add(TensorRole::DnBeta, {E, nv});
    s.add(TensorRole::DnAlpha, {E, nv});
  } else {
    s.add(TensorRole::DnBa, {E, 2 * nv});
  }
  s.add(TensorRole::DnConv, {hp.ssm_conv_kernel, conv_dim});
  s.add(TensorRole::DnDtBias, {nv});
  s.add(TensorRole::DnA, {nv});
  s.add(TensorRole::DnNorm, {hp.ssm_head_v_dim});
  s.add(TensorRole::DnOut, {v_dim, E});
}

void ffn(const HParams& hp, const FfnPart& f, SlotList& s) {
  const int64_t E = hp.n_embd, X = hp.n_expert;
  if (f.kind == FfnKind::Dense) {
    s.add(TensorRole::FfnGate, {E, f.dense_ff});
    s.add(TensorRole::FfnUp, {E, f.dense_ff});
    s.add(TensorRole::FfnDown, {f.dense_ff, E});
    return;
  }
  const int64_t F = f.experts.n_ff;
  s.add(TensorRole::Router, {E, X});
  if (f.router.logit_bias) s.add(TensorRole::RouterBias, {X});
  if (f.router.score_bias) s.add(TensorRole::ScoreBias, {X});
  s.add(TensorRole::GateExps, {E, F, X});
  s.add(TensorRole::UpExps, {E, F, X});
  s.add(TensorRole::DownExps, {F, E, X});
  if (f.experts.biases) {
    s.add(TensorRole::GateExpsBias, {F, X});
    s.add(TensorRole::UpExpsBias, {F, X});
    s.add(TensorRole::DownExpsBias, {E, X});
  }
  if (f.shared.present) {
    const int64_t Fs = f.shared.n_ff;
    if (f.shared.gated) s.add(TensorRole::SharedRouter, {E});
    s.add(TensorRole::GateShexp, {E, Fs});
    s.add(TensorRole::UpShexp, {E, Fs});
    s.add(TensorRole::DownShexp, {Fs, E});
  }
}

}  // namespace

std::vector<TensorSlot> layer_tensors(const HParams& hp, int64_t il) {
  if (hp.desc == nullptr) throw std::logic_error("layer_tensors: the hyper-parameters have no architecture description");
  const LayerRecipe r = hp.recipe(il);
  std::vector<TensorSlot> out;
  SlotList s(hp, il, out);
  const int64_t E = hp.n_embd;
  s.add(TensorRole::AttnNorm, {E});
  switch (r.mixer.kind) {
    case MixerKind::Attention: attention(hp, r.mixer.attn, s); break;
    case MixerKind::GatedDeltaNet: delta_net(hp, r.mixer.delta, s); break;
    case MixerKind::Mla: mla(hp, r.mixer.mla, s); break;
  }
  s.add(TensorRole::FfnNorm, {E});
  ffn(hp, r.ffn, s);
  if (il >= hp.n_layer) {
    s.add(TensorRole::NextnEhProj, {2 * E, E});
    s.add(TensorRole::NextnEnorm, {E});
    s.add(TensorRole::NextnHnorm, {E});
    s.add(TensorRole::NextnEmbedTokens, {E, hp.n_vocab}, true);
    s.add(TensorRole::NextnSharedHeadHead, {E, hp.n_vocab}, true);
    s.add(TensorRole::NextnSharedHeadNorm, {E}, true);
  }
  return out;
}

std::vector<TensorSlot> model_tensors(const HParams& hp) {
  std::vector<TensorSlot> out;
  SlotList g(hp, -1, out);
  g.add(TensorRole::TokEmbd, {hp.n_embd, hp.n_vocab});
  for (int64_t il = 0; il < hp.n_layer + hp.n_nextn; ++il) {
    std::vector<TensorSlot> l = layer_tensors(hp, il);
    out.insert(out.end(), l.begin(), l.end());
  }
  g.add(TensorRole::OutputNorm, {hp.n_embd});
  g.add(TensorRole::Output, {hp.n_embd, hp.n_vocab}, true);
  return out;
}

}  // namespace moraine::model
