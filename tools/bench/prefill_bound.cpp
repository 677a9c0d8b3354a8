#include "tools/bench/prefill_bound.h"

#include <algorithm>
#include <cmath>

#include "common/model/model.h"

namespace moraine::bench {
namespace {

// A matrix multiplies each of its elements once per row of X: one multiply-add, 2 FLOPs.
double flops(const model::Matrix& w) { return w ? 2.0 * static_cast<double>(w.n_rows) * static_cast<double>(w.n_cols) : 0.0; }
double all_flops(const model::ExpertTensor& t) { return flops(t.all); }
double one_expert_flops(const model::ExpertTensor& t) {
  return t ? 2.0 * static_cast<double>(t.rows_per_expert) * static_cast<double>(t.all.n_cols) : 0.0;
}

double layer_weight_flops(const model::LayerWeights& l, double k) {
  const model::AttentionWeights& a = l.attn;
  const model::MlaWeights& mla = l.mla;
  const model::DeltaNetWeights& d = l.delta;
  const model::MoeWeights& e = l.moe;
  double f = flops(a.q) + flops(a.k) + flops(a.v) + flops(a.o);
  // MLA's per-head k_b / v_b counted once per token, as the absorbed form multiplies them.
  f += flops(mla.q) + flops(mla.q_a) + flops(mla.q_b) + flops(mla.kv_a_mqa) + flops(mla.kv_b) + flops(mla.o) +
       all_flops(mla.k_b) + all_flops(mla.v_b);
  f += flops(d.qkv) + flops(d.z) + flops(d.qkvz) + flops(d.ba) + flops(d.beta) + flops(d.alpha) + flops(d.out) +
       2.0 * static_cast<double>(d.conv.size());
  f += flops(e.router) + flops(e.shared_gate) + flops(e.shared_up) + flops(e.shared_down) +
       2.0 * static_cast<double>(e.shared_router.size());
  f += k * (one_expert_flops(e.gate) + one_expert_flops(e.up) + one_expert_flops(e.down));
  f += flops(l.dense.gate) + flops(l.dense.up) + flops(l.dense.down);
  return f;
}

}  // namespace

double mean_causal_context(int64_t n, int64_t window) {
  if (n <= 0) return 0.0;
  const double N = static_cast<double>(n);
  if (window <= 0 || window >= n) return (N + 1.0) / 2.0;
  const double W = static_cast<double>(window);
  return (W * (W + 1.0) / 2.0 + (N - W) * W) / N;
}

double expected_use(double p_row, double rows) {
  if (p_row <= 0.0 || rows <= 0.0) return 0.0;
  if (p_row >= 1.0) return 1.0;
  return -std::expm1(rows * std::log1p(-p_row));   // 1 - (1 - p)^rows without cancellation
}

double PrefillModel::attention_flops_per_token(int64_t n_prompt) const {
  double f = 0;
  for (const Attention& a : attention) f += a.flops_per_position * mean_causal_context(n_prompt, a.window);
  return f;
}

double PrefillModel::flops_per_token(int64_t n_prompt) const {
  if (n_prompt <= 0) return 0.0;
  return weight_flops + deltanet_flops + attention_flops_per_token(n_prompt) + head_flops / static_cast<double>(n_prompt);
}

PrefillModel prefill_model(const model::Model& m) {
  const model::HParams& hp = m.hp;
  PrefillModel p;
  const double k = static_cast<double>(hp.n_expert_used);
  p.head_flops = flops(m.output);
  p.n_embd = hp.n_embd;
  p.n_expert = hp.n_expert;
  p.n_expert_used = hp.n_expert_used;
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    const model::LayerWeights& l = m.layers[static_cast<size_t>(il)];
    p.weight_flops += layer_weight_flops(l, k);
    const model::MixerPart& mix = l.recipe.mixer;
    const double heads = static_cast<double>(hp.n_head);
    if (mix.kind == model::MixerKind::Attention) {
      const double dk = static_cast<double>(hp.head_dim);
      const double dv = static_cast<double>(hp.head_dim_v > 0 ? hp.head_dim_v : hp.head_dim);
      p.attention.push_back({2.0 * heads * (dk + dv), mix.attn.sliding_window});
    } else if (mix.kind == model::MixerKind::Mla) {
      p.attention.push_back({2.0 * heads * static_cast<double>(hp.mla_head_k + hp.mla_head_v), 0});
    } else {
      p.deltanet_flops += 7.0 * static_cast<double>(hp.ssm_n_v_heads) * static_cast<double>(hp.ssm_head_k_dim) *
                          static_cast<double>(hp.ssm_head_v_dim);
    }
    if (p.n_ff == 0 && l.moe.gate) {
      p.n_ff = l.moe.gate.rows_per_expert;
      p.gate_type = l.moe.gate.all.type;
      p.down_type = l.moe.down.all.type;
    }
  }
  return p;
}

double staged_bytes_per_token(const ExpertStaging& s, int64_t rows, uint8_t tier) {
  if (rows <= 0 || s.n_expert <= 0) return 0.0;
  const int64_t E = s.n_expert;
  const double k = static_cast<double>(s.n_expert_used);
  const double uniform = std::min(1.0, k / static_cast<double>(E));
  double bytes = 0;
  for (size_t il = 0; il < s.expert_bytes.size(); ++il) {
    const size_t base = il * static_cast<size_t>(E);
    double total = 0;   // the layer's routings in the census
    if (!s.popularity.empty())
      for (int64_t e = 0; e < E; ++e) total += s.popularity[base + static_cast<size_t>(e)];
    double used = 0;    // expected distinct experts of `tier` the rows use
    for (int64_t e = 0; e < E; ++e) {
      if (s.tier[base + static_cast<size_t>(e)] != tier) continue;
      // A row picks k distinct experts: expert e with probability k x its share of the routings.
      const double p = total > 0 ? std::min(1.0, k * s.popularity[base + static_cast<size_t>(e)] / total) : uniform;
      used += expected_use(p, static_cast<double>(rows));
    }
    bytes += used * s.expert_bytes[il];
  }
  return bytes / static_cast<double>(rows);
}

PrefillBound prefill_bound(int64_t n_prompt, const PrefillModel& pm, const std::optional<ExpertStaging>& staging,
                           const std::string& staging_none, std::optional<double> pcie_bytes_s,
                           std::optional<double> disk_bytes_s, const GemmRates& gemm) {
  PrefillBound b;
  b.n_prompt = n_prompt;
  b.flops_per_token = pm.flops_per_token(n_prompt);
  if (!staging) {
    b.why_none = staging_none;
    return b;
  }
  const ExpertStaging& s = *staging;
  if (!s.device_computes) {
    b.why_none = staging_none;
    return b;
  }
  if (s.long_step_rows <= 0) {
    b.why_none = "the engine runs no long prefill steps (long_step_rows 0)";
    return b;
  }
  b.step_rows = std::min<int64_t>(n_prompt, s.long_step_rows);
  b.long_step = n_prompt > s.window_rows;
  b.pcie_bytes_per_token = staged_bytes_per_token(s, b.step_rows, 1);
  b.disk_bytes_per_token = staged_bytes_per_token(s, std::min<int64_t>(n_prompt, std::max<int64_t>(s.window_rows, 1)), 2);
  if (gemm.engine_flops_s && *gemm.engine_flops_s > 0) b.gpu_s = b.flops_per_token / *gemm.engine_flops_s;
  if (pcie_bytes_s && *pcie_bytes_s > 0) b.pcie_s = b.pcie_bytes_per_token / *pcie_bytes_s;
  if (disk_bytes_s && *disk_bytes_s > 0) b.disk_s = b.disk_bytes_per_token / *disk_bytes_s;
  if (!b.gpu_s) {
    b.why_none = "no prefill GEMM rate (" + gemm.engine_note + ")";
    return b;
  }
  if (b.pcie_bytes_per_token > 0 && !b.pcie_s) {
    b.why_none = "RAM-tier experts cross PCIe but the host->device rate was not measured";
    return b;
  }
  if (b.disk_bytes_per_token > 0 && !b.disk_s) {
    b.why_none = "FILE-tier experts are read but the disk rate was not measured";
    return b;
  }
  double worst = *b.gpu_s;
  b.limiting = "gpu";
  if (b.pcie_s && *b.pcie_s > worst) worst = *b.pcie_s, b.limiting = "pcie";
  if (b.disk_s && *b.disk_s > worst) worst = *b.disk_s, b.limiting = "disk";
  if (worst <= 0) {
    b.why_none = "the model costs no time per token";
    b.limiting.clear();
    return b;
  }
  b.tok_s = 1.0 / worst;
  return b;
}

}  // namespace moraine::bench
