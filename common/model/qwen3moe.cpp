// qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B) tensors. Every layer:
//   h = x + o( attention( rope(rmsnorm_q(q(n1(x)))), rope(rmsnorm_k(k(n1(x)))), v(n1(x)) ) )
//   y = h + sum_{e in topk(softmax(router(n2(h))))} w_e * down_e( silu(gate_e(.)) * up_e(.) )
// GQA, per-head RMSNorm on q and k before NEOX RoPE over the whole head, softmax router,
// top-k weights renormalised to one (norm_topk_prob), SwiGLU experts.
#include "common/model/model.h"

namespace moraine::model {

namespace {

void bind_moe(const HParams& hp, TensorBinder& b, int64_t il, MoeWeights& moe) {
  moe.router = b.matrix(blk(il, "ffn_gate_inp.weight"), hp.n_embd, hp.n_expert);
  moe.gate = b.experts(blk(il, "ffn_gate_exps.weight"), hp.n_embd, hp.n_ff_exp, hp.n_expert);
  moe.up = b.experts(blk(il, "ffn_up_exps.weight"), hp.n_embd, hp.n_ff_exp, hp.n_expert);
  moe.down = b.experts(blk(il, "ffn_down_exps.weight"), hp.n_ff_exp, hp.n_embd, hp.n_expert);
}

}  // namespace

void bind_qwen3moe(Model& m, TensorBinder& b) {
  const HParams& hp = m.hp;
  const int64_t q_dim = hp.n_head * hp.head_dim;
  const int64_t kv_dim = hp.n_head_kv * hp.head_dim;
  m.layers.resize(hp.n_layer);
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    LayerWeights& L = m.layers[il];
    L.recurrent = false;
    L.attn_norm = b.vector(blk(il, "attn_norm.weight"), hp.n_embd);
    L.attn.q = b.matrix(blk(il, "attn_q.weight"), hp.n_embd, q_dim);
    L.attn.k = b.matrix(blk(il, "attn_k.weight"), hp.n_embd, kv_dim);
    L.attn.v = b.matrix(blk(il, "attn_v.weight"), hp.n_embd, kv_dim);
    L.attn.o = b.matrix(blk(il, "attn_output.weight"), q_dim, hp.n_embd);
    L.attn.q_norm = b.vector(blk(il, "attn_q_norm.weight"), hp.head_dim);
    L.attn.k_norm = b.vector(blk(il, "attn_k_norm.weight"), hp.head_dim);
    L.attn.q_has_gate = false;
    L.ffn_norm = b.vector(blk(il, "ffn_norm.weight"), hp.n_embd);
    bind_moe(hp, b, il, L.moe);
  }
}

}  // namespace moraine::model
