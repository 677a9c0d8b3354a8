// qwen3next (Qwen3-Next-80B-A3B) tensors. Layers alternate two token mixers: a Gated DeltaNet
// (linear attention with a recurrent state) in most layers, gated full attention in every
// full_attention_interval-th. Every layer:
//   h = x + mixer(n1(x));   y = h + moe(n2(h)) + sigmoid(dot(n2(h), g_s)) * shared_expert(n2(h))
// Gated attention: q projection yields [query | gate] per head; per-head RMSNorm on q and k;
//   NEOX RoPE over the first n_rot dims (partial rotary); out = o(attn * sigmoid(gate)).
// Gated DeltaNet: qkv = conv1d_causal(qkv_proj(x)) -> silu; q, k L2-normalised per head;
//   g = a * softplus(alpha + dt_bias) (a = -exp(A_log)); beta = sigmoid(b); per value head:
//   S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q / sqrt(d_k);
//   out = ssm_out(rmsnorm(o) * w * silu(z)).
// Norm weights are stored with HF's "1 + w" already folded in by the converter, except the
// gated norm (ssm_norm), whose HF weight is used as is.
#include "common/model/model.h"

#include "common/formats/quant.h"

namespace moraine::model {

namespace {

void bind_attention(const HParams& hp, TensorBinder& b, int64_t il, AttentionWeights& a) {
  const int64_t q_dim = hp.n_head * hp.head_dim;
  const int64_t kv_dim = hp.n_head_kv * hp.head_dim;
  a.q = b.matrix(blk(il, "attn_q.weight"), hp.n_embd, 2 * q_dim);
  a.k = b.matrix(blk(il, "attn_k.weight"), hp.n_embd, kv_dim);
  a.v = b.matrix(blk(il, "attn_v.weight"), hp.n_embd, kv_dim);
  a.o = b.matrix(blk(il, "attn_output.weight"), q_dim, hp.n_embd);
  a.q_norm = b.vector(blk(il, "attn_q_norm.weight"), hp.head_dim);
  a.k_norm = b.vector(blk(il, "attn_k_norm.weight"), hp.head_dim);
  a.q_has_gate = true;
}

void bind_delta(const HParams& hp, TensorBinder& b, int64_t il, DeltaNetWeights& d) {
  const int64_t conv_dim = hp.ssm_conv_dim();
  const int64_t v_dim = hp.ssm_value_dim();
  if (b.has(blk(il, "attn_qkv.weight"))) {
    d.qkv = b.matrix(blk(il, "attn_qkv.weight"), hp.n_embd, conv_dim);
    d.z = b.matrix(blk(il, "attn_gate.weight"), hp.n_embd, v_dim);
  } else {
    d.qkvz = b.matrix(blk(il, "ssm_in.weight"), hp.n_embd, conv_dim + v_dim);
  }
  d.ba = b.matrix(blk(il, "ssm_ba.weight"), hp.n_embd, 2 * hp.ssm_n_v_heads);
  // Bound as a matrix for the shape check, then copied to float once: it is tiny.
  Matrix conv = b.matrix(blk(il, "ssm_conv1d.weight"), hp.ssm_conv_kernel, conv_dim);
  d.conv.resize(static_cast<size_t>(conv_dim * hp.ssm_conv_kernel));
  for (int64_t c = 0; c < conv_dim; ++c) {
    dequantize_row(conv.type, conv.row(c), d.conv.data() + c * hp.ssm_conv_kernel, hp.ssm_conv_kernel);
  }
  d.dt_bias = b.vector(blk(il, "ssm_dt.bias"), hp.ssm_n_v_heads);
  d.a = b.vector(blk(il, "ssm_a"), hp.ssm_n_v_heads);
  d.norm = b.vector(blk(il, "ssm_norm.weight"), hp.ssm_head_v_dim);
  d.out = b.matrix(blk(il, "ssm_out.weight"), v_dim, hp.n_embd);
}

void bind_moe(const HParams& hp, TensorBinder& b, int64_t il, MoeWeights& moe) {
  moe.router = b.matrix(blk(il, "ffn_gate_inp.weight"), hp.n_embd, hp.n_expert);
  moe.gate = b.experts(blk(il, "ffn_gate_exps.weight"), hp.n_embd, hp.n_ff_exp, hp.n_expert);
  moe.up = b.experts(blk(il, "ffn_up_exps.weight"), hp.n_embd, hp.n_ff_exp, hp.n_expert);
  moe.down = b.experts(blk(il, "ffn_down_exps.weight"), hp.n_ff_exp, hp.n_embd, hp.n_expert);
  moe.shared_router = b.vector(blk(il, "ffn_gate_inp_shexp.weight"), hp.n_embd);
  moe.shared_gate = b.matrix(blk(il, "ffn_gate_shexp.weight"), hp.n_embd, hp.n_ff_shexp);
  moe.shared_up = b.matrix(blk(il, "ffn_up_shexp.weight"), hp.n_embd, hp.n_ff_shexp);
  moe.shared_down = b.matrix(blk(il, "ffn_down_shexp.weight"), hp.n_ff_shexp, hp.n_embd);
}

void bind_block(const HParams& hp, TensorBinder& b, int64_t il, bool recurrent, LayerWeights& L) {
  L.recurrent = recurrent;
  L.attn_norm = b.vector(blk(il, "attn_norm.weight"), hp.n_embd);
  // llama.cpp names HF's post_attention_layernorm post_attention_norm for this family.
  L.ffn_norm = b.vector(blk(il, "post_attention_norm.weight"), hp.n_embd);
  if (recurrent) {
    bind_delta(hp, b, il, L.delta);
  } else {
    bind_attention(hp, b, il, L.attn);
  }
  bind_moe(hp, b, il, L.moe);
}

}  // namespace

void bind_qwen3next(Model& m, TensorBinder& b) {
  const HParams& hp = m.hp;
  m.layers.resize(hp.n_layer);
  for (int64_t il = 0; il < hp.n_layer; ++il) bind_block(hp, b, il, hp.is_recurrent(il), m.layers[il]);

  // MTP blocks follow the trunk: a full-attention block plus the nextn projections.
  m.nextn.resize(hp.n_nextn);
  for (int64_t j = 0; j < hp.n_nextn; ++j) {
    const int64_t il = hp.n_layer + j;
    NextnWeights& n = m.nextn[j];
    bind_block(hp, b, il, /*recurrent=*/false, n.block);
    n.eh_proj = b.matrix(blk(il, "nextn.eh_proj.weight"), 2 * hp.n_embd, hp.n_embd);
    n.enorm = b.vector(blk(il, "nextn.enorm.weight"), hp.n_embd);
    n.hnorm = b.vector(blk(il, "nextn.hnorm.weight"), hp.n_embd);
    if (b.has(blk(il, "nextn.embed_tokens.weight"))) {
      n.embed_tokens = b.matrix(blk(il, "nextn.embed_tokens.weight"), hp.n_embd, hp.n_vocab);
    }
    if (b.has(blk(il, "nextn.shared_head_head.weight"))) {
      n.shared_head_head = b.matrix(blk(il, "nextn.shared_head_head.weight"), hp.n_embd, hp.n_vocab);
    }
    if (b.has(blk(il, "nextn.shared_head_norm.weight"))) {
      n.shared_head_norm = b.vector(blk(il, "nextn.shared_head_norm.weight"), hp.n_embd);
    }
  }
}

}  // namespace moraine::model
