// The typed parts a layer is built from. An architecture description (arch/<arch>.cpp) states
// one LayerRecipe per layer; the binder, the backends, placement and scratch sizing, the
// converter and moraine-synth read the recipe instead of asking which family a model is.
// Options may be declared before a backend implements them: each backend lists the features it
// implements (BackendSupport) and refuses at load a model whose recipe uses another one.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moraine::model {

enum class RopeScaling { None, Yarn };

struct RopePart {
  int64_t n_rot = 0;              // rotary dims (NEOX pairing); < head_dim: partial rotary
  double freq_base = 10000.0;
  RopeScaling scaling = RopeScaling::None;
  double yarn_factor = 1.0;       // rope.scaling.factor
  int64_t yarn_orig_ctx = 0;      // rope.scaling.original_context_length
  double yarn_beta_fast = 32.0, yarn_beta_slow = 1.0;
  // The correction dims floored / ceiled to whole dims (llama.cpp, and every GGUF without
  // moraine's rope.scaling.yarn_truncate key); false keeps them fractional as HF's
  // truncate=false does (gpt-oss's own config: 0.26% of max |logit| apart on gpt_oss_odd).
  bool yarn_truncate = true;
  // ggml_rope_ext's attn_factor: cos and sin are scaled by it (times 1 + 0.1 ln factor under YaRN).
  double attn_factor = 1.0;
};

// YaRN's ramp over n_rot rotary dims: pair i keeps its unscaled frequency by
// 1 - clamp((i - low) / max(0.001, high - low), 0, 1), low / high the correction dims of
// beta_fast / beta_slow (rounded when yarn_truncate), and cos / sin are scaled by mscale =
// attn_factor (1 + 0.1 ln(factor)). The one computation the reference and the CUDA rope share.
struct YarnRamp {
  double low = 0, high = 0, mscale = 1;
};
YarnRamp yarn_ramp(const RopePart& rope, int64_t n_rot);

struct AttentionPart {
  bool qk_norm = false;       // per-head RMSNorm on q and k before RoPE
  bool output_gate = false;   // q projection carries [query | gate] per head; out *= sigmoid(gate)
  bool qkv_bias = false;      // biases on q, k, v
  bool o_bias = false;        // bias on the output projection
  bool sinks = false;         // one learned logit per head joins each softmax (gpt-oss)
  int64_t sliding_window = 0; // 0: full attention; else each query sees the last window positions
  RopePart rope;
};

// Multi-head latent attention (deepseek2), as llama.cpp's deepseek2 graph computes it. Per head
// q = [nope | rope]; one shared kv_a projection gives the latent (kv_lora_rank, RMS-normed) and
// the rotary key (rope_dim, shared by every head): the cache holds those two per position. The
// per-head keys' nope part and the values come from the latent (k_b / v_b, or the older fused
// kv_b). RoPE on the rope dims is NORM pairing (x[2i], x[2i+1]); its YaRN options are the
// MixerPart's attn.rope (n_rot = rope_dim).
struct MlaPart {
  int64_t q_lora_rank = 0;     // 0: q projected directly (attn_q); else attn_q_a, its norm, attn_q_b
  int64_t kv_lora_rank = 0;    // the compressed latent cached per position
  int64_t rope_dim = 0;        // the decoupled rotary key dims
  int64_t nope_dim = 0;        // per-head key dims without RoPE (qk_nope_head_dim)
  int64_t v_dim = 0;           // per-head value dims (v_head_dim)
  bool split_kv_b = true;      // attn_k_b + attn_v_b (current converter); false: attn_kv_b (older files)
  double kq_scale = 0.0;       // the attention scale (DeepSeek's YaRN mscale squared / sqrt(nope + rope))
};

// Gated DeltaNet: where value heads find their key head, and how beta and alpha are projected.
struct DeltaNetPart {
  bool v_heads_tiled = false;  // value head j reads key head j % n_k (qwen35moe); else j / (n_v / n_k) (qwen3next)
  bool split_ba = false;       // ssm_beta and ssm_alpha, value-head order (qwen35moe); else ssm_ba grouped per key head
};

enum class MixerKind { Attention, GatedDeltaNet, Mla };

struct MixerPart {
  MixerKind kind = MixerKind::Attention;
  AttentionPart attn;   // kind == Attention (and the RoPE of Mla)
  MlaPart mla;          // kind == Mla
  DeltaNetPart delta;   // kind == GatedDeltaNet
};

enum class RouterKind {
  SoftmaxTopK,         // softmax over all experts, then the k largest (qwen3moe, qwen3next)
  TopKSoftmax,         // the k largest logits, then softmax over those k (gpt-oss)
  SigmoidGroupTopK,    // sigmoid scores + score-correction bias, group-limited top-k (deepseek v3, glm4moe)
};

struct RouterPart {
  RouterKind kind = RouterKind::SoftmaxTopK;
  bool renormalize = true;     // chosen weights rescaled to sum to one (norm_topk_prob)
  bool logit_bias = false;     // a bias on the router's logits (gpt-oss: ffn_gate_inp.bias)
  bool score_bias = false;     // exp_probs_b: added for the choice only (SigmoidGroupTopK)
  int64_t n_group = 1, topk_group = 1;
  double routed_scale = 1.0;   // expert_weights_scale: the routed output's factor
};

enum class Activation {
  SwiGlu,          // silu(gate) * up
  SwiGluClamped,   // gpt-oss: gate, up clamped at limit; gate * sigmoid(alpha gate) * (up + 1)
};

struct ExpertsPart {
  Activation act = Activation::SwiGlu;
  double swiglu_alpha = 1.702, swiglu_limit = 7.0;   // SwiGluClamped only
  bool biases = false;     // per-expert biases on gate, up and down
  int64_t n_ff = 0;        // hidden width
};

struct SharedExpertPart {
  bool present = false;
  bool gated = false;      // scaled by sigmoid(dot(x, ffn_gate_inp_shexp)) (qwen3next)
  int64_t n_ff = 0;
};

enum class FfnKind { Moe, Dense };

struct FfnPart {
  FfnKind kind = FfnKind::Moe;
  RouterPart router;
  ExpertsPart experts;
  SharedExpertPart shared;
  int64_t dense_ff = 0;    // kind == Dense: the SwiGLU FFN's hidden width
};

// Both norms of a layer are RMSNorm over n_embd; which GGUF tensor the pre-FFN one is named by
// is the architecture's tensor table's business (ffn_norm or post_attention_norm).
struct LayerRecipe {
  MixerPart mixer;
  FfnPart ffn;
};

// Every option a recipe can ask of a backend, one name each for the refusal message.
enum class Feature {
  Attention,
  AttnQkNorm,
  AttnOutputGate,
  AttnQkvBias,
  AttnOutputBias,
  AttnSinks,
  SlidingWindow,
  PartialRope,
  YarnRope,
  GatedDeltaNet,
  DeltaNetTiledHeads,
  DeltaNetSplitBa,
  Mla,
  RouterSoftmaxTopK,
  RouterTopKSoftmax,
  RouterSigmoidGroupTopK,
  RouterNoRenormalize,
  RouterLogitBias,
  RoutedScaling,
  SwiGlu,
  SwiGluClamped,
  ExpertBiases,
  SharedExpertGated,
  SharedExpertUngated,
  DenseFfn,
  kCount
};

const char* feature_name(Feature f);

// The features one layer's recipe uses (head_dim decides whether its RoPE is partial).
std::vector<Feature> layer_features(const LayerRecipe& r, int64_t head_dim);

// What a backend implements: a bit per Feature.
class BackendSupport {
 public:
  BackendSupport(std::string backend_name, std::initializer_list<Feature> features);
  bool has(Feature f) const { return (bits_ >> static_cast<int>(f)) & 1u; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  uint64_t bits_ = 0;
};

// What the CPU reference implements (common/reference); the gpu_worker's CPU backend shares it.
const BackendSupport& reference_support();

}  // namespace moraine::model
