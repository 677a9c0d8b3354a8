#include "tools/bench/reference_engine.h"

#include <algorithm>
#include <utility>

namespace moraine::bench {
namespace {

double matrix_bytes(const model::Matrix& m) {
  return m ? static_cast<double>(m.n_rows) * static_cast<double>(m.row_bytes) : 0.0;
}
double floats_bytes(const std::vector<float>& v) { return static_cast<double>(v.size() * sizeof(float)); }
double one_expert_bytes(const model::ExpertTensor& t) {
  return t ? static_cast<double>(t.rows_per_expert) * static_cast<double>(t.all.row_bytes) : 0.0;
}

}  // namespace

ModelReadBytes decode_read_bytes(const model::Model& m) {
  ModelReadBytes r;
  // One embedding row per token; the lm head is read whole (even when it is token_embd).
  r.dense += static_cast<double>(m.tok_embd.row_bytes) + matrix_bytes(m.output) + floats_bytes(m.output_norm);
  const double k = static_cast<double>(m.hp.n_expert_used);
  for (const model::LayerWeights& l : m.layers) {
    r.dense += floats_bytes(l.attn_norm) + floats_bytes(l.ffn_norm);
    const model::AttentionWeights& a = l.attn;
    r.dense += matrix_bytes(a.q) + matrix_bytes(a.k) + matrix_bytes(a.v) + matrix_bytes(a.o) +
               floats_bytes(a.q_norm) + floats_bytes(a.k_norm) + floats_bytes(a.q_bias) + floats_bytes(a.k_bias) +
               floats_bytes(a.v_bias) + floats_bytes(a.o_bias) + floats_bytes(a.sinks);
    const model::DeltaNetWeights& d = l.delta;
    r.dense += matrix_bytes(d.qkv) + matrix_bytes(d.z) + matrix_bytes(d.qkvz) + matrix_bytes(d.ba) +
               matrix_bytes(d.beta) + matrix_bytes(d.alpha) + matrix_bytes(d.out) + floats_bytes(d.conv) + floats_bytes(d.dt_bias) + floats_bytes(d.a) +
               floats_bytes(d.norm);
    const model::MoeWeights& e = l.moe;
    r.dense += matrix_bytes(e.router) + matrix_bytes(e.shared_gate) + matrix_bytes(e.shared_up) +
               matrix_bytes(e.shared_down) + floats_bytes(e.shared_router) + floats_bytes(e.router_bias) +
               floats_bytes(e.score_bias);
    r.dense += matrix_bytes(l.dense.gate) + matrix_bytes(l.dense.up) + matrix_bytes(l.dense.down);
    // Per-expert biases (gpt-oss) are read with their expert: one expert's share of each.
    const double ne = static_cast<double>(std::max<int64_t>(m.hp.n_expert, 1));
    const double one = one_expert_bytes(e.gate) + one_expert_bytes(e.up) + one_expert_bytes(e.down) +
                       (floats_bytes(e.gate_bias) + floats_bytes(e.up_bias) + floats_bytes(e.down_bias)) / ne;
    r.expert_bytes = one;
    r.experts += k * one;
  }
  return r;
}

ReferenceEngine::ReferenceEngine(std::unique_ptr<model::Model> m, int n_threads)
    : model_(std::move(m)), exec_(*model_, reference::ExecutorOptions{n_threads}), bytes_(decode_read_bytes(*model_)) {}

std::span<const float> ReferenceEngine::prefill(std::span<const int32_t> tokens) {
  logits_ = exec_.forward(tokens, /*all_logits=*/false);
  return logits_;
}

std::span<const float> ReferenceEngine::decode_one(int32_t token) {
  const int32_t one[1] = {token};
  logits_ = exec_.forward(one, false);
  return logits_;
}

EngineStats ReferenceEngine::stats() const {
  EngineStats s;
  s.bytes_per_token[static_cast<int>(Tier::Ram)] = bytes_.total();
  s.hit_rate[static_cast<int>(Tier::Ram)] = 1.0;
  s.placed_bytes_per_token[1] = bytes_.total();   // every weight in RAM
  s.budgets_applied = false;
  return s;
}

}  // namespace moraine::bench
