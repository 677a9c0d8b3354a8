#include <algorithm>
#include <cmath>
#include <string>

#include "common/model/arch/parts.h"

namespace moraine::model {

const char* feature_name(Feature f) {
  static const char* const names[] = {
      "attention",
      "attention q/k norm",
      "attention output gate",
      "attention q/k/v biases",
      "attention output bias",
      "attention sinks",
      "sliding-window attention",
      "partial RoPE",
      "YaRN RoPE scaling",
      "Gated DeltaNet",
      "Gated DeltaNet with value heads tiled over key heads",
      "Gated DeltaNet with separate beta and alpha projections",
      "multi-head latent attention (MLA)",
      "router softmax-then-top-k",
      "router top-k-then-softmax",
      "router sigmoid with score bias and group-limited top-k",
      "router without renormalised top-k weights",
      "router logit bias",
      "routed expert scaling",
      "SwiGLU experts",
      "clamped SwiGLU experts (gpt-oss)",
      "expert biases",
      "gated shared expert",
      "ungated shared expert",
      "dense FFN layer",
  };
  static_assert(sizeof(names) / sizeof(names[0]) == static_cast<size_t>(Feature::kCount));
  return names[static_cast<int>(f)];
}

std::vector<Feature> layer_features(const LayerRecipe& r, int64_t head_dim) {
  std::vector<Feature> f;
  const auto rope = [&](const RopePart& p) {
    if (p.n_rot < head_dim) f.push_back(Feature::PartialRope);
    if (p.scaling == RopeScaling::Yarn) f.push_back(Feature::YarnRope);
  };
  switch (r.mixer.kind) {
    case MixerKind::Attention: {
      const AttentionPart& a = r.mixer.attn;
      f.push_back(Feature::Attention);
      if (a.qk_norm) f.push_back(Feature::AttnQkNorm);
      if (a.output_gate) f.push_back(Feature::AttnOutputGate);
      if (a.qkv_bias) f.push_back(Feature::AttnQkvBias);
      if (a.o_bias) f.push_back(Feature::AttnOutputBias);
      if (a.sinks) f.push_back(Feature::AttnSinks);
      if (a.sliding_window > 0) f.push_back(Feature::SlidingWindow);
      rope(a.rope);
      break;
    }
    case MixerKind::GatedDeltaNet:
      f.push_back(Feature::GatedDeltaNet);
      if (r.mixer.delta.v_heads_tiled) f.push_back(Feature::DeltaNetTiledHeads);
      if (r.mixer.delta.split_ba) f.push_back(Feature::DeltaNetSplitBa);
      break;
    case MixerKind::Mla:
      f.push_back(Feature::Mla);
      if (r.mixer.attn.rope.scaling == RopeScaling::Yarn) f.push_back(Feature::YarnRope);
      break;
  }
  const FfnPart& ffn = r.ffn;
  if (ffn.kind == FfnKind::Dense) {
    f.push_back(Feature::DenseFfn);
    return f;
  }
  switch (ffn.router.kind) {
    case RouterKind::SoftmaxTopK: f.push_back(Feature::RouterSoftmaxTopK); break;
    case RouterKind::TopKSoftmax: f.push_back(Feature::RouterTopKSoftmax); break;
    case RouterKind::SigmoidGroupTopK: f.push_back(Feature::RouterSigmoidGroupTopK); break;
  }
  // Top-k-then-softmax sums to one by construction: renormalising is no separate option there.
  if (!ffn.router.renormalize && ffn.router.kind != RouterKind::TopKSoftmax) f.push_back(Feature::RouterNoRenormalize);
  if (ffn.router.logit_bias) f.push_back(Feature::RouterLogitBias);
  if (ffn.router.routed_scale != 1.0) f.push_back(Feature::RoutedScaling);
  f.push_back(ffn.experts.act == Activation::SwiGlu ? Feature::SwiGlu : Feature::SwiGluClamped);
  if (ffn.experts.biases) f.push_back(Feature::ExpertBiases);
  if (ffn.shared.present) f.push_back(ffn.shared.gated ? Feature::SharedExpertGated : Feature::SharedExpertUngated);
  return f;
}

BackendSupport::BackendSupport(std::string backend_name, std::initializer_list<Feature> features)
    : name_(std::move(backend_name)) {
  for (Feature f : features) bits_ |= uint64_t{1} << static_cast<int>(f);
}

YarnRamp yarn_ramp(const RopePart& rope, int64_t n_rot) {
  const double pi = 3.14159265358979323846;
  const auto corr_dim = [&](double rotations) {
    return static_cast<double>(n_rot) * std::log(static_cast<double>(rope.yarn_orig_ctx) / (rotations * 2 * pi)) /
           (2 * std::log(rope.freq_base));
  };
  YarnRamp r;
  const double low = corr_dim(rope.yarn_beta_fast), high = corr_dim(rope.yarn_beta_slow);
  r.low = std::max(0.0, rope.yarn_truncate ? std::floor(low) : low);
  r.high = std::min(static_cast<double>(n_rot - 1), rope.yarn_truncate ? std::ceil(high) : high);
  r.mscale = rope.attn_factor * (1.0 + 0.1 * std::log(rope.yarn_factor));
  return r;
}

const BackendSupport& reference_support() {
  // The CPU reference's attention (attention_block.cpp), DeltaNet, router and experts (moe_parts.cpp).
  static const BackendSupport s("CPU reference",
                                {Feature::Attention, Feature::AttnQkNorm, Feature::AttnOutputGate, Feature::PartialRope,
                                 Feature::GatedDeltaNet, Feature::RouterSoftmaxTopK, Feature::RouterNoRenormalize,
                                 Feature::SwiGlu, Feature::SharedExpertGated,
                                 // gpt-oss's parts
                                 Feature::AttnQkvBias, Feature::AttnOutputBias, Feature::AttnSinks, Feature::SlidingWindow,
                                 Feature::YarnRope, Feature::RouterTopKSoftmax, Feature::RouterLogitBias,
                                 Feature::SwiGluClamped, Feature::ExpertBiases,
                                 // deepseek v3 / glm4moe's FFN parts
                                 Feature::RouterSigmoidGroupTopK, Feature::RoutedScaling, Feature::SharedExpertUngated,
                                 Feature::DenseFfn,
                                 // qwen35moe's DeltaNet layout
                                 Feature::DeltaNetTiledHeads, Feature::DeltaNetSplitBa,
                                 // deepseek2's attention (mla_block.cpp)
                                 Feature::Mla});
  return s;
}

}  // namespace moraine::model
