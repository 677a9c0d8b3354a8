// moraine-float-order-gap: how far the reference executor moves from itself when only the float
// order of its dots changes (ExecutorOptions::dot_order, common/reference/matmul.h), on one GGUF:
//  (a) an R-row prefill of the prompt repeated (the CUDA golden test's LongPrefill: 80 rows),
//  (b) a greedy decode of N tokens (the group test's 12: the prompt's last row, then one row per
//      token), the other orders fed the natural order's tokens.
// For each seed it prints max |a - b| / max |a| over the logits. With --detail it replays the
// worst seed layer by layer beside the natural order (the executor's layer-step entry points and
// the MoE pieces, checked bit-equal to forward()) and counts, at each re-quantization it can
// see (the token mixer's input, the MoE input, the LM head's input), the activation codes that
// differ, and every top-k choice that differs with its router-logit margin: where a one-ulp
// difference became a discrete one.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "common/formats/block_layouts.h"
#include "common/formats/quant.h"
#include "common/model/model.h"
#include "common/reference/executor.h"
#include "common/reference/matmul.h"
#include "common/reference/moe_parts.h"
#include "common/reference/ops.h"
#include "common/sampling/sampler.h"

namespace {

using namespace moraine;
using reference::DotOrderSeed;
using reference::ReferenceExecutor;

struct Gap {
  double max_ref = 0, max_diff = 0;
  int64_t worst = 0;
  double rel() const { return max_ref > 0 ? max_diff / max_ref : 0; }
};

Gap gap(const std::vector<float>& got, const std::vector<float>& want) {
  Gap g;
  for (size_t i = 0; i < want.size(); ++i) {
    g.max_ref = std::max(g.max_ref, std::fabs(double(want[i])));
    const double d = std::fabs(double(got[i]) - want[i]);
    if (d > g.max_diff) g.max_diff = d, g.worst = static_cast<int64_t>(i);
  }
  return g;
}

// Activation codes of rows a and b (n_cols each) once quantized for a `weight` matmul that
// differ; -1 when that weight's activations stay float.
int64_t codes_differing(TensorType weight, const float* a, const float* b, int64_t n_cols) {
  const reference::PackedActivations pa = reference::pack_activations(weight, a, 1, n_cols);
  const reference::PackedActivations pb = reference::pack_activations(weight, b, 1, n_cols);
  int64_t diff = 0;
  if (pa.type == TensorType::Q8_0) {
    const auto* qa = static_cast<const BlockQ8_0*>(pa.row(0));
    const auto* qb = static_cast<const BlockQ8_0*>(pb.row(0));
    for (int64_t i = 0; i < n_cols; ++i) diff += qa[i / 32].qs[i % 32] != qb[i / 32].qs[i % 32];
  } else if (pa.type == TensorType::Q8_K) {
    const auto* qa = static_cast<const BlockQ8_K*>(pa.row(0));
    const auto* qb = static_cast<const BlockQ8_K*>(pb.row(0));
    for (int64_t i = 0; i < n_cols; ++i) diff += qa[i / 256].qs[i % 256] != qb[i / 256].qs[i % 256];
  } else {
    return -1;
  }
  return diff;
}

double max_rel_diff(const float* a, const float* b, int64_t n) {
  double mx = 0, d = 0;
  for (int64_t i = 0; i < n; ++i) {
    mx = std::max(mx, std::fabs(double(a[i])));
    d = std::max(d, std::fabs(double(a[i]) - b[i]));
  }
  return mx > 0 ? d / mx : 0;
}

// One order's executor stepped layer by layer: forward()'s arithmetic (executor.cpp,
// moe_block.cpp) through the public pieces, so the two orders can be compared between them.
struct Stepper {
  const model::Model& m;
  ReferenceExecutor ex;
  std::vector<float> x, h, attn_in, out_in, logits;
  std::vector<int32_t> chosen;
  std::vector<float> weight;
  reference::RouterScratch router;
  Stepper(const model::Model& model, const reference::ExecutorOptions& o) : m(model), ex(model, o) {}

  void begin(const std::vector<int32_t>& tokens) {
    const int64_t n = static_cast<int64_t>(tokens.size()), d = m.hp.n_embd;
    x.assign(n * d, 0);
    h.assign(n * d, 0);
    ex.embed(tokens, x.data());
  }
  void mixer(int64_t il, int64_t n) {
    const int64_t d = m.hp.n_embd;
    attn_in.resize(n * d);
    for (int64_t t = 0; t < n; ++t)
      reference::rms_norm(x.data() + t * d, m.layers[il].attn_norm.data(), d, float(m.hp.rms_eps),
                          attn_in.data() + t * d);
    ex.mixer_step(il, x.data(), n, h.data());
  }
  void route(int64_t il, int64_t n) {
    const int64_t k = m.hp.n_expert_used;
    router.reserve(m.hp, n);
    chosen.assign(n * k, -1);
    weight.assign(n * k, 0);
    reference::route_top_k(m.hp, m.layers[il].moe, h.data(), n, chosen.data(), weight.data(), router, ex.pool(),
                           ex.dot_order());
  }
  void experts(int64_t il, int64_t n) {
    const model::HParams& hp = m.hp;
    const model::MoeWeights& W = m.layers[il].moe;
    const int64_t d = hp.n_embd, k = hp.n_expert_used;
    std::vector<float> slot_out(n * k * d), shared;
    reference::ExpertScratch scratch;
    scratch.reserve(1, std::max(hp.n_ff_exp, W.shared_up ? W.shared_gate.n_rows : 0));
    for (int64_t i = 0; i < n * k; ++i) {   // one row at a time: rows of a matmul are independent
      const int64_t e = chosen[i];
      reference::swiglu_expert(W.gate.expert(e), W.up.expert(e), W.down.expert(e), h.data() + (i / k) * d, 1,
                               slot_out.data() + i * d, scratch, ex.pool(), ex.dot_order());
    }
    if (W.shared_up) {
      shared.resize(n * d);
      reference::ExpertScratch ss;
      ss.reserve(n, W.shared_gate.n_rows);
      reference::swiglu_expert(W.shared_gate, W.shared_up, W.shared_down, h.data(), n, shared.data(), ss, ex.pool(),
                               ex.dot_order());
    }
    std::vector<const float*> rows(n * k);
    for (int64_t i = 0; i < n * k; ++i) rows[i] = slot_out.data() + i * d;
    reference::moe_combine(hp, W, h.data(), n, weight.data(), rows.data(), W.shared_up ? shared.data() : nullptr,
                           x.data());
  }
  void finish(int64_t n, bool all_logits) {
    const int64_t d = m.hp.n_embd, first = all_logits ? 0 : n - 1, rows = n - first;
    ex.advance(n);
    out_in.resize(rows * d);
    for (int64_t t = 0; t < rows; ++t)
      reference::rms_norm(x.data() + (first + t) * d, m.output_norm.data(), d, float(m.hp.rms_eps),
                          out_in.data() + t * d);
    std::vector<float> scratch(rows * d);
    logits.resize(rows * m.hp.n_vocab);
    ex.output_logits(x.data() + first * d, rows, scratch.data(), logits.data());
  }
};

// Codes differing over all rows and at row `focus`, and the activations' float distance.
struct CodeCount {
  int64_t all = 0, at_focus = 0;
  double rel = 0;
};
CodeCount count_codes(TensorType weight, const std::vector<float>& a, const std::vector<float>& b, int64_t n,
                      int64_t d, int64_t focus) {
  CodeCount c;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t k = codes_differing(weight, a.data() + t * d, b.data() + t * d, d);
    if (k < 0) return {-1, -1, max_rel_diff(a.data(), b.data(), n * d)};
    c.all += k;
    if (t == focus) c.at_focus = k;
  }
  c.rel = max_rel_diff(a.data(), b.data(), n * d);
  return c;
}

void print_codes(const char* what, TensorType w, const CodeCount& c) {
  if (c.all < 0) {
    std::printf("    %-10s (%s, float activations) max rel diff %.2g\n", what, std::string(type_name(w)).c_str(), c.rel);
  } else {
    std::printf("    %-10s (%s) codes differing: %lld over all rows, %lld at the focus row; max rel diff %.2g\n", what,
                std::string(type_name(w)).c_str(), static_cast<long long>(c.all), static_cast<long long>(c.at_focus),
                c.rel);
  }
}

// One step of both orders in lockstep with a report per layer; `focus` is the row (of this
// step's tokens) the per-row counts are for. Returns both orders' logits.
std::pair<std::vector<float>, std::vector<float>> lockstep(Stepper& a, Stepper& b, const std::vector<int32_t>& tokens,
                                                           bool all_logits, int64_t focus, bool print) {
  const model::Model& m = a.m;
  const model::HParams& hp = m.hp;
  const int64_t n = static_cast<int64_t>(tokens.size()), d = hp.n_embd, k = hp.n_expert_used;
  a.begin(tokens);
  b.begin(tokens);
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    a.mixer(il, n);
    b.mixer(il, n);
    const model::LayerWeights& L = m.layers[il];
    const TensorType mix_w = L.recurrent ? (L.delta.qkv ? L.delta.qkv.type : L.delta.qkvz.type) : L.attn.q.type;
    if (print) std::printf("  layer %lld (%s)\n", static_cast<long long>(il), L.recurrent ? "delta net" : "attention");
    if (print) print_codes("mixer in", mix_w, count_codes(mix_w, a.attn_in, b.attn_in, n, d, focus));
    if (print) print_codes("moe in", L.moe.gate.all.type, count_codes(L.moe.gate.all.type, a.h, b.h, n, d, focus));
    a.route(il, n);
    b.route(il, n);
    for (int64_t t = 0; t < n && print; ++t) {
      bool same = true;
      for (int64_t s = 0; s < k; ++s) same = same && a.chosen[t * k + s] == b.chosen[t * k + s];
      if (same) continue;
      // The router's k-th and (k+1)-th logits in the natural order: how near the tie was.
      std::vector<float> la(a.router.logits.begin() + t * hp.n_expert, a.router.logits.begin() + (t + 1) * hp.n_expert);
      std::vector<float> lb(b.router.logits.begin() + t * hp.n_expert, b.router.logits.begin() + (t + 1) * hp.n_expert);
      std::vector<float> sa = la;
      std::sort(sa.begin(), sa.end(), std::greater<float>());
      std::printf("    ROUTING DIFFERS at row %lld:", static_cast<long long>(t));
      for (int64_t s = 0; s < k; ++s) std::printf(" %d/%d", a.chosen[t * k + s], b.chosen[t * k + s]);
      std::printf("  router-logit margin k-th vs next %.3g; router logits' max diff %.3g\n",
                  double(sa[k - 1]) - sa[k], max_rel_diff(la.data(), lb.data(), hp.n_expert) * std::fabs(sa[0]));
    }
    a.experts(il, n);
    b.experts(il, n);
    if (print) {
      const double r = max_rel_diff(a.x.data() + focus * d, b.x.data() + focus * d, d);
      std::printf("    residual after the layer: max rel diff %.2g at the focus row, %.2g over all rows\n", r,
                  max_rel_diff(a.x.data(), b.x.data(), n * d));
    }
  }
  a.finish(n, all_logits);
  b.finish(n, all_logits);
  if (print) {
    const int64_t rows = all_logits ? n : 1;
    print_codes("lm head in", m.output.type,
                count_codes(m.output.type, a.out_in, b.out_in, rows, d, all_logits ? focus : 0));
  }
  return {a.logits, b.logits};
}

std::vector<int32_t> read_prompt(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot read the prompt " + path);
  return nlohmann::json::parse(f).at("ids").get<std::vector<int32_t>>();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Reference executor against itself under other float orders of its dots"};
  std::string path, prompt_path;
  int rows = 80, decode = 12, seeds = 8;
  bool detail = false;
  app.add_option("model", path, "GGUF")->required();
  app.add_option("--prompt", prompt_path, "tokens.json of the golden model ({\"ids\": [...]})")->required();
  app.add_option("--rows", rows, "prefill rows (the prompt repeated)");
  app.add_option("--decode", decode, "greedy tokens of the decode run (0: none)");
  app.add_option("--seeds", seeds, "other orders to try (seeds 1..N)");
  app.add_flag("--detail", detail, "replay the worst seed layer by layer with code and routing counts");
  std::string kv = "f32";
  app.add_option("--kv-type", kv, "the reference's KV cache (f16: a seed also rounds near-edge K/V either way)")
      ->check(CLI::IsMember({"f32", "f16"}));
  CLI11_PARSE(app, argc, argv);
  try {
    const model::Model m = model::Model::load(path);
    const int64_t V = m.hp.n_vocab;
    const std::vector<int32_t> prompt = read_prompt(prompt_path);
    std::vector<int32_t> tokens;
    while (static_cast<int>(tokens.size()) < rows) tokens.insert(tokens.end(), prompt.begin(), prompt.end());
    tokens.resize(rows);

    // Every executor here: one thread, no parallel split, the order `seed`, the --kv-type cache.
    const auto opts = [&](DotOrderSeed seed) {
      reference::ExecutorOptions o{1, 1 << 30, seed};
      o.kv_type = kv == "f16" ? model::KvType::F16 : model::KvType::F32;
      return o;
    };
    // (a) prefill
    const std::vector<float> want = ReferenceExecutor(m, opts(0)).forward(tokens, true);
    std::vector<double> pre;
    DotOrderSeed worst_seed = 1;
    Gap worst;
    for (int s = 1; s <= seeds; ++s) {
      const Gap g = gap(ReferenceExecutor(m, opts(DotOrderSeed(s))).forward(tokens, true), want);
      pre.push_back(g.rel());
      if (g.rel() >= worst.rel()) worst = g, worst_seed = s;
    }
    std::printf("prefill %d rows: gap over %d orders: median %.3g, max %.3g (seed %llu, row %lld), all:", rows, seeds,
                median(pre), worst.rel(), static_cast<unsigned long long>(worst_seed),
                static_cast<long long>(worst.worst / V));
    for (double g : pre) std::printf(" %.3g", g);
    std::printf("\n");
    if (detail) {
      Stepper a(m, opts(0)), b(m, opts(worst_seed));
      const auto [la, lb] = lockstep(a, b, tokens, true, worst.worst / V, true);
      if (std::memcmp(la.data(), want.data(), want.size() * sizeof(float)) != 0)
        throw std::logic_error("the layer-by-layer replay is not forward()'s arithmetic");
      std::printf("  replayed gap %.3g\n", gap(lb, want).rel());
    }

    // (b) decode: the natural order's greedy tokens, fed to every order
    if (decode > 0) {
      auto run = [&](DotOrderSeed seed, const std::vector<int32_t>* feed, std::vector<int32_t>* ids) {
        ReferenceExecutor ex(m, opts(seed));
        std::vector<float> all, l = ex.forward(prompt, false);
        for (int i = 0; i < decode; ++i) {
          all.insert(all.end(), l.begin(), l.end());
          const int32_t next = feed ? (*feed)[i] : sampling::argmax(std::span<const float>(l.data(), V));
          if (ids) ids->push_back(next);
          if (i + 1 < decode) l = ex.forward(std::vector<int32_t>{next}, false);
        }
        return all;
      };
      std::vector<int32_t> ids;
      const std::vector<float> dwant = run(0, nullptr, &ids);
      std::vector<double> dec;
      Gap dworst;
      DotOrderSeed dseed = 1;
      for (int s = 1; s <= seeds; ++s) {
        const Gap g = gap(run(DotOrderSeed(s), &ids, nullptr), dwant);
        dec.push_back(g.rel());
        if (g.rel() >= dworst.rel()) dworst = g, dseed = s;
      }
      std::printf("decode %d tokens: gap over %d orders: median %.3g, max %.3g (seed %llu, step %lld), all:", decode,
                  seeds, median(dec), dworst.rel(), static_cast<unsigned long long>(dseed),
                  static_cast<long long>(dworst.worst / V));
      for (double g : dec) std::printf(" %.3g", g);
      std::printf("\n");
      if (detail) {
        Stepper a(m, opts(0)), b(m, opts(dseed));
        const int64_t step = dworst.worst / V;
        lockstep(a, b, prompt, false, static_cast<int64_t>(prompt.size()) - 1, step == 0);
        for (int64_t i = 1; i <= step; ++i) {
          if (i == step) std::printf("  decode step %lld:\n", static_cast<long long>(i));
          lockstep(a, b, {ids[i - 1]}, false, 0, i == step);
        }
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moraine-float-order-gap: %s\n", e.what());
    return 1;
  }
  return 0;
}
