// Qwen3_5MoeForCausalLM -> qwen35moe: qwen3next's hybrid (see qwen3next.cpp and
// read_qwen_hybrid) with the DeltaNet projections already split (in_proj_qkv, in_proj_z,
// in_proj_b, in_proj_a) and interleaved M-RoPE (rope_parameters.mrope_section, written as
// rope.dimension_sections padded to 4; llama.cpp's default [11, 11, 10, 0] when absent).
// HF groups the value heads by key head (head g*r + i reads key head g, r = n_v / n_k); the GGUF
// holds them tiled (head i*n_k + g), as llama.cpp's converter reorders them for ggml's broadcast:
// the v rows of in_proj_qkv and of conv1d, the rows of in_proj_z/b/a, the entries of A_log and
// dt_bias and the columns of out_proj.
#include "tools/convert/qwen_config.h"

namespace moraine::convert {

using model::TensorRole;
using nlohmann::json;

namespace {

void read_config(const HfConfig& cfg, const Checkpoint& ckpt, HfModel& m) {
  require_default_rope(cfg);
  read_qwen_hybrid(cfg, ckpt, m);
  const HfConfig rope = cfg.rope();
  // Qwen3.5 always interleaves its M-RoPE sections (llama.cpp's qwen35moe does only that).
  if (!rope.flag("mrope_interleaved", true)) rope.fail("mrope_interleaved", "= false is not supported: qwen35moe interleaves its M-RoPE sections");
  std::vector<int64_t> sec = {11, 11, 10, 0};
  if (const json* s = rope.find("mrope_section")) {
    if (!s->is_array() || s->size() > 4) rope.fail("mrope_section", "must be a list of at most 4 integers");
    sec.assign(4, 0);
    for (size_t i = 0; i < s->size(); ++i) {
      if (!(*s)[i].is_number_integer() || (*s)[i].get<int64_t>() < 0) rope.fail("mrope_section", "entries must be non-negative integers");
      sec[i] = (*s)[i].get<int64_t>();
    }
  }
  std::vector<gguf::Value> v;
  for (int64_t x : sec) v.push_back(gguf::Value::i32(static_cast<int32_t>(x)));
  m.put("rope.dimension_sections", gguf::Value::array(gguf::ValueType::INT32, std::move(v)));
}

// The source value head of tiled head j: j = i * n_k + g holds HF's head g * r + i.
int64_t grouped_head(const model::HParams& hp, int64_t j) {
  const int64_t nk = hp.ssm_n_k_heads, r = hp.ssm_n_v_heads / nk;
  return (j % nk) * r + j / nk;
}

// Rows [base, base + n_v * rows_per_head) of src, value heads tiled.
void tiled_rows(const model::HParams& hp, const StTensor& src, int64_t base, int64_t rows_per_head, std::vector<RowSpan>& out) {
  for (int64_t j = 0; j < hp.ssm_n_v_heads; ++j) out.push_back({&src, base + grouped_head(hp, j) * rows_per_head, rows_per_head});
}

// A row of n_v heads of `width` elements each, value heads tiled.
std::vector<int64_t> tiled_cols(const model::HParams& hp, int64_t width) {
  std::vector<int64_t> perm;
  for (int64_t j = 0; j < hp.ssm_n_v_heads; ++j)
    for (int64_t d = 0; d < width; ++d) perm.push_back(grouped_head(hp, j) * width + d);
  return perm;
}

bool map_tensor(Planner& p, const model::TensorSlot& t, const std::string& hf) {
  const model::HParams& hp = p.model().hp;
  const int64_t H = hp.n_embd, nv = hp.ssm_n_v_heads, dv = hp.ssm_head_v_dim, K = hp.ssm_conv_kernel;
  const int64_t qk = 2 * hp.ssm_n_k_heads * hp.ssm_head_k_dim, C = hp.ssm_conv_dim();
  const std::string la = hf + "linear_attn.";
  std::vector<RowSpan> rows;
  switch (t.role) {
    case TensorRole::DnQkv:
    case TensorRole::DnConv: {
      const bool conv = t.role == TensorRole::DnConv;
      const StTensor& s = conv ? p.take(la + "conv1d.weight", {C, 1, K}) : p.take(la + "in_proj_qkv.weight", {C, H});
      rows.push_back({&s, 0, qk});   // q and k channels keep their order
      tiled_rows(hp, s, qk, dv, rows);
      p.add(t.name, t.shape, std::move(rows), ElemOp::None);
      return true;
    }
    case TensorRole::DnGate: case TensorRole::DnBeta: case TensorRole::DnAlpha: {
      const bool z = t.role == TensorRole::DnGate;
      const char* name = z ? "in_proj_z.weight" : t.role == TensorRole::DnBeta ? "in_proj_b.weight" : "in_proj_a.weight";
      const StTensor& s = p.take(la + name, {nv * (z ? dv : 1), H});
      tiled_rows(hp, s, 0, z ? dv : 1, rows);
      p.add(t.name, t.shape, std::move(rows), ElemOp::None);
      return true;
    }
    case TensorRole::DnDtBias: case TensorRole::DnA: {
      const bool a = t.role == TensorRole::DnA;
      const StTensor& s = p.take(la + (a ? "A_log" : "dt_bias"), {nv});
      p.add(t.name, t.shape, {{&s, 0, 1}}, a ? ElemOp::NegExp : ElemOp::None, tiled_cols(hp, 1));
      return true;
    }
    case TensorRole::DnOut: {
      const StTensor& s = p.take(la + "out_proj.weight", {H, nv * dv});
      p.add(t.name, t.shape, {{&s, 0, H}}, ElemOp::None, tiled_cols(hp, dv));
      return true;
    }
    default: return qwen_mtp_once(p, t);
  }
}

}  // namespace

const ArchConverter& converter_qwen35moe() {
  static const ArchConverter c{"qwen35moe", {"qwen3_5_moe", "qwen3_5_moe_text"}, read_config, map_tensor, qwen_hybrid_elem_op};
  return c;
}

}  // namespace moraine::convert
