// What each backend implements of the layer parts (common/model/arch/parts.h): a model whose
// recipe uses anything else is refused when the backend is made (model::check_supported).
#include "gpu_worker/backend.h"

namespace moraine::gpu_worker {

const model::BackendSupport& cpu_backend_support() {
  // The CPU backend runs the reference executor's blocks and its router and experts.
  static const model::BackendSupport s("gpu_worker CPU backend", {
      model::Feature::Attention, model::Feature::AttnQkNorm, model::Feature::AttnOutputGate, model::Feature::PartialRope,
      model::Feature::GatedDeltaNet, model::Feature::RouterSoftmaxTopK, model::Feature::RouterNoRenormalize,
      model::Feature::SwiGlu, model::Feature::SharedExpertGated,
      // gpt-oss's: the mixer is the reference's; router and experts by reference::route_layer /
      // routed_expert here and the cpu workers' expert kernels (biases, clamped SwiGLU).
      model::Feature::AttnQkvBias, model::Feature::AttnOutputBias, model::Feature::AttnSinks, model::Feature::SlidingWindow,
      model::Feature::YarnRope, model::Feature::RouterTopKSoftmax, model::Feature::RouterLogitBias,
      model::Feature::SwiGluClamped, model::Feature::ExpertBiases,
      // glm4moe's: the router by route_layer, the ungated shared expert by moe_combine, dense
      // leading layers whole on this backend (placement gives their zero-byte experts the device).
      model::Feature::RouterSigmoidGroupTopK, model::Feature::RoutedScaling, model::Feature::SharedExpertUngated,
      model::Feature::DenseFfn,
      // qwen35moe's DeltaNet layout and deepseek2's MLA: the reference's mixer_step.
      model::Feature::DeltaNetTiledHeads, model::Feature::DeltaNetSplitBa, model::Feature::Mla});
  return s;
}

const model::BackendSupport& cuda_backend_support() {
  // gpu_worker/cuda_backend*.cu and kernels/cuda: gated attention, Gated DeltaNet, softmax router;
  // gpt-oss's attention (q/k/v/o biases, sinks, sliding window, YaRN), top-k-then-softmax router
  // with its logit bias, and biased clamped-SwiGLU experts; glm4moe's sigmoid group router
  // (route_sigmoid_group_top_k, the routed scale in its weights), the ungated shared expert
  // (moe_combine without a gate logit) and dense leading layers (matmuls on the device); qwen35moe's
  // DeltaNet layout (DeltaNetShape's v_heads_tiled and split_ba: the kernels pick the key head and
  // read beta / alpha in value-head order, ssm_beta and ssm_alpha stacked at upload).
  static const model::BackendSupport s("CUDA backend", {
      model::Feature::Attention, model::Feature::AttnQkNorm, model::Feature::AttnOutputGate, model::Feature::PartialRope,
      model::Feature::AttnQkvBias, model::Feature::AttnOutputBias, model::Feature::AttnSinks,
      model::Feature::SlidingWindow, model::Feature::YarnRope,
      model::Feature::GatedDeltaNet, model::Feature::RouterSoftmaxTopK, model::Feature::RouterNoRenormalize,
      model::Feature::RouterTopKSoftmax, model::Feature::RouterLogitBias,
      model::Feature::SwiGlu, model::Feature::SwiGluClamped, model::Feature::ExpertBiases,
      model::Feature::SharedExpertGated, model::Feature::RouterSigmoidGroupTopK, model::Feature::RoutedScaling,
      model::Feature::SharedExpertUngated, model::Feature::DenseFfn,
      model::Feature::DeltaNetTiledHeads, model::Feature::DeltaNetSplitBa});
  return s;
}

}  // namespace moraine::gpu_worker
