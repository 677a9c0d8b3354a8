// Binds each layer's tensors, as its recipe and the description's tensor table list them
// (layer_tensors.cpp), into the LayerWeights fields of their roles.
#include <stdexcept>

#include "common/formats/quant.h"
#include "common/model/layer_tensors.h"
#include "common/model/model.h"
#include "common/model/model_error.h"

namespace moraine::model {

namespace {

std::vector<float>* vector_field(TensorRole r, LayerWeights& L, NextnWeights* n) {
  switch (r) {
    case TensorRole::AttnNorm: return &L.attn_norm;
    case TensorRole::FfnNorm: return &L.ffn_norm;
    case TensorRole::AttnQNorm: return &L.attn.q_norm;
    case TensorRole::AttnKNorm: return &L.attn.k_norm;
    case TensorRole::AttnQBias: return &L.attn.q_bias;
    case TensorRole::AttnKBias: return &L.attn.k_bias;
    case TensorRole::AttnVBias: return &L.attn.v_bias;
    case TensorRole::AttnOBias: return &L.attn.o_bias;
    case TensorRole::AttnSinks: return &L.attn.sinks;
    case TensorRole::MlaQANorm: return &L.mla.q_a_norm;
    case TensorRole::MlaKvANorm: return &L.mla.kv_a_norm;
    case TensorRole::DnDtBias: return &L.delta.dt_bias;
    case TensorRole::DnA: return &L.delta.a;
    case TensorRole::DnNorm: return &L.delta.norm;
    case TensorRole::RouterBias: return &L.moe.router_bias;
    case TensorRole::ScoreBias: return &L.moe.score_bias;
    case TensorRole::GateExpsBias: return &L.moe.gate_bias;
    case TensorRole::UpExpsBias: return &L.moe.up_bias;
    case TensorRole::DownExpsBias: return &L.moe.down_bias;
    case TensorRole::SharedRouter: return &L.moe.shared_router;
    case TensorRole::NextnEnorm: return n ? &n->enorm : nullptr;
    case TensorRole::NextnHnorm: return n ? &n->hnorm : nullptr;
    case TensorRole::NextnSharedHeadNorm: return n ? &n->shared_head_norm : nullptr;
    default: return nullptr;
  }
}

Matrix* matrix_field(TensorRole r, LayerWeights& L, NextnWeights* n) {
  const bool mla = L.recipe.mixer.kind == MixerKind::Mla;
  switch (r) {
    case TensorRole::AttnQ: return mla ? &L.mla.q : &L.attn.q;
    case TensorRole::AttnO: return mla ? &L.mla.o : &L.attn.o;
    case TensorRole::MlaQA: return &L.mla.q_a;
    case TensorRole::MlaQB: return &L.mla.q_b;
    case TensorRole::MlaKvAMqa: return &L.mla.kv_a_mqa;
    case TensorRole::MlaKvB: return &L.mla.kv_b;
    case TensorRole::AttnK: return &L.attn.k;
    case TensorRole::AttnV: return &L.attn.v;
    case TensorRole::DnQkv: return &L.delta.qkv;
    case TensorRole::DnGate: return &L.delta.z;
    case TensorRole::DnBa: return &L.delta.ba;
    case TensorRole::DnBeta: return &L.delta.beta;
    case TensorRole::DnAlpha: return &L.delta.alpha;
    case TensorRole::DnOut: return &L.delta.out;
    case TensorRole::Router: return &L.moe.router;
    case TensorRole::GateShexp: return &L.moe.shared_gate;
    case TensorRole::UpShexp: return &L.moe.shared_up;
    case TensorRole::DownShexp: return &L.moe.shared_down;
    case TensorRole::FfnGate: return &L.dense.gate;
    case TensorRole::FfnUp: return &L.dense.up;
    case TensorRole::FfnDown: return &L.dense.down;
    case TensorRole::NextnEhProj: return n ? &n->eh_proj : nullptr;
    case TensorRole::NextnEmbedTokens: return n ? &n->embed_tokens : nullptr;
    case TensorRole::NextnSharedHeadHead: return n ? &n->shared_head_head : nullptr;
    default: return nullptr;
  }
}

ExpertTensor* experts_field(TensorRole r, LayerWeights& L) {
  switch (r) {
    case TensorRole::GateExps: return &L.moe.gate;
    case TensorRole::UpExps: return &L.moe.up;
    case TensorRole::DownExps: return &L.moe.down;
    case TensorRole::MlaKB: return &L.mla.k_b;   // one "expert" per head
    case TensorRole::MlaVB: return &L.mla.v_b;
    default: return nullptr;
  }
}

void bind_slot(const HParams& hp, TensorBinder& b, const TensorSlot& s, LayerWeights& L, NextnWeights* n) {
  if (s.optional && !b.has(s.name)) return;
  if (s.role == TensorRole::DnQkv && !b.has(s.name) && hp.desc->find(TensorRole::DnQkvzLegacy) != nullptr &&
      b.has(hp.desc->gguf_name(TensorRole::DnQkvzLegacy, s.layer))) {
    // The legacy fused ssm_in, grouped per key head as [q | k | v_group | z_group].
    L.delta.qkvz = b.matrix(hp.desc->gguf_name(TensorRole::DnQkvzLegacy, s.layer), hp.n_embd,
                            hp.ssm_conv_dim() + hp.ssm_value_dim());
    return;
  }
  if (s.role == TensorRole::DnGate && L.delta.qkvz) return;   // part of the legacy ssm_in
  if (s.role == TensorRole::DnConv) {
    // Bound as a matrix for the shape check, then copied to float once: it is tiny.
    const Matrix conv = b.matrix(s.name, s.shape[0], s.shape[1]);
    L.delta.conv.resize(static_cast<size_t>(s.shape[0] * s.shape[1]));
    for (int64_t c = 0; c < s.shape[1]; ++c) {
      dequantize_row(conv.type, conv.row(c), L.delta.conv.data() + c * s.shape[0], s.shape[0]);
    }
    return;
  }
  if (std::vector<float>* v = vector_field(s.role, L, n)) {
    *v = s.shape.size() == 1 ? b.vector(s.name, s.shape[0]) : b.floats(s.name, s.shape);
  } else if (Matrix* m = matrix_field(s.role, L, n)) {
    *m = b.matrix(s.name, s.shape[0], s.shape[1]);
  } else if (ExpertTensor* e = experts_field(s.role, L)) {
    *e = b.experts(s.name, s.shape[0], s.shape[1], s.shape[2]);
  } else {
    throw std::logic_error(std::string("bind_layers: no field for tensor role ") + tensor_role_name(s.role));
  }
}

void bind_block(const HParams& hp, TensorBinder& b, int64_t il, LayerWeights& L, NextnWeights* n) {
  L.recipe = hp.recipe(il);
  L.recurrent = L.recipe.mixer.kind == MixerKind::GatedDeltaNet;
  L.attn.q_has_gate = L.recipe.mixer.kind == MixerKind::Attention && L.recipe.mixer.attn.output_gate;
  for (const TensorSlot& s : layer_tensors(hp, il)) bind_slot(hp, b, s, L, n);
}

}  // namespace

void bind_layers(Model& m, TensorBinder& b) {
  const HParams& hp = m.hp;
  m.layers.resize(hp.n_layer);
  for (int64_t il = 0; il < hp.n_layer; ++il) bind_block(hp, b, il, m.layers[il], nullptr);
  m.nextn.resize(hp.n_nextn);
  for (int64_t j = 0; j < hp.n_nextn; ++j) bind_block(hp, b, hp.n_layer + j, m.nextn[j].block, &m.nextn[j]);
}

void check_supported(const Model& m, const BackendSupport& support) {
  const std::string where = m.file.paths().empty() ? std::string("model") : m.file.paths()[0];
  for (int64_t il = 0; il < m.hp.n_layer; ++il) {
    for (Feature f : layer_features(m.layers[il].recipe, m.hp.head_dim)) {
      if (!support.has(f)) {
        throw ModelError(where + ": " + m.hp.arch_string() + " layer " + std::to_string(il) + " uses " +
                         feature_name(f) + ", which the " + support.name() + " does not implement");
      }
    }
  }
}

}  // namespace moraine::model
