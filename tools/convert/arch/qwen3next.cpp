// Qwen3NextForCausalLM -> qwen3next: DeltaNet and gated-attention layers (layer_types or
// full_attention_interval), RMSNorm weights stored as 1 + w, A = -exp(A_log), in_proj_qkvz split
// and regrouped, conv1d squeezed, and the multi-token-prediction block (mtp.*) as nextn blocks.
#include "tools/convert/qwen_config.h"

namespace moraine::convert {

using model::TensorRole;
using nlohmann::json;

namespace {

void read_config(const HfConfig& cfg, const Checkpoint& ckpt, HfModel& m) {
  require_default_rope(cfg);
  read_qwen_hybrid(cfg, ckpt, m);
}

// in_proj_qkvz rows are grouped per key head g: [q_g (dk), k_g (dk), v_g (r*dv), z_g (r*dv)].
// GGUF wants all q heads, then all k, then all v (the conv1d channel order) in attn_qkv, and
// the z rows in attn_gate.
void linear_attention(Planner& p, const model::TensorSlot& t, const std::string& hf) {
  const model::HParams& hp = p.model().hp;
  const int64_t H = hp.n_embd, nk = hp.ssm_n_k_heads, nv = hp.ssm_n_v_heads, dk = hp.ssm_head_k_dim;
  const int64_t dv = hp.ssm_head_v_dim, r = nv / nk, group = 2 * dk + 2 * r * dv;
  const StTensor& qkvz = p.take(p.hf_name(TensorRole::DnQkvzLegacy, hf), {nk * group, H});
  std::vector<RowSpan> q, k, v, z;
  for (int64_t g = 0; g < nk; ++g) {
    const int64_t base = g * group;
    q.push_back({&qkvz, base, dk});
    k.push_back({&qkvz, base + dk, dk});
    v.push_back({&qkvz, base + 2 * dk, r * dv});
    z.push_back({&qkvz, base + 2 * dk + r * dv, r * dv});
  }
  std::vector<RowSpan> qkv = q;
  qkv.insert(qkv.end(), k.begin(), k.end());
  qkv.insert(qkv.end(), v.begin(), v.end());
  p.add(t.name, {H, hp.ssm_conv_dim()}, std::move(qkv), ElemOp::None);
  p.add(p.desc().gguf_name(TensorRole::DnGate, t.layer), {H, nv * dv}, std::move(z), ElemOp::None);
}

bool map_tensor(Planner& p, const model::TensorSlot& t, const std::string& hf) {
  switch (t.role) {
    case TensorRole::DnQkv: linear_attention(p, t, hf); return true;
    case TensorRole::DnGate: return true;   // written with DnQkv
    case TensorRole::DnConv:   // conv1d [C, 1, K] -> one row of K taps per channel
      p.whole(t.name, t.shape, p.hf_name(t.role, hf), {t.shape[1], 1, t.shape[0]});
      return true;
    default: return qwen_mtp_once(p, t);
  }
}

}  // namespace

const ArchConverter& converter_qwen3next() {
  static const ArchConverter c{"qwen3next", {"qwen3_next"}, read_config, map_tensor, qwen_hybrid_elem_op};
  return c;
}

}  // namespace moraine::convert
