// A loaded model: hyper-parameters plus every weight bound (with shape checks) to the mapped
// GGUF bytes. Small vectors (norm weights, biases, decay constants) are held dequantized as
// float; matrices stay in the file's type and are read in place.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/gguf/gguf.h"
#include "common/model/arch/arch.h"
#include "common/model/hparams.h"
#include "common/model/tensor_binder.h"

namespace moraine::model {

// Full (softmax) attention. With an output gate (qwen3next) the q projection carries it: per
// head, head_dim query values then head_dim gate values (q.n_rows == 2 * n_head * head_dim).
struct AttentionWeights {
  Matrix q, k, v, o;
  std::vector<float> q_norm, k_norm;   // per-head RMSNorm over head_dim (empty: none)
  bool q_has_gate = false;             // = the recipe's output_gate
  std::vector<float> q_bias, k_bias, v_bias, o_bias;   // empty when the recipe has none
  std::vector<float> sinks;            // [n_head] learned softmax sink logits (gpt-oss)
};

// Multi-head latent attention (deepseek2; parts.h's MlaPart). q directly, or through its LoRA
// (q_a, q_a_norm, q_b); kv_a_mqa gives [latent | rotary key]; the latent is decompressed per
// head by k_b / v_b (one matrix per head: k_b's maps the nope dims to the latent, v_b's the
// latent to the value) or by the older fused kv_b (rows per head: nope dims, then value dims).
struct MlaWeights {
  Matrix q, q_a, q_b, kv_a_mqa, kv_b, o;
  ExpertTensor k_b, v_b;
  std::vector<float> q_a_norm, kv_a_norm;
};

// Gated DeltaNet (qwen3next linear attention). The projections are stored either as
// llama.cpp's current pair (qkv: [q all heads | k all heads | v all heads], gate: z) or as the
// legacy fused ssm_in, grouped per key head as [q | k | v_group | z_group].
struct DeltaNetWeights {
  Matrix qkv, z;          // current layout
  Matrix qkvz;            // legacy layout (ssm_in); used when qkv is absent
  Matrix ba;              // grouped per key head: [beta x r | alpha x r], r = v_heads / k_heads
  Matrix beta, alpha;     // split_ba (qwen35moe): one row per value head each, instead of ba
  std::vector<float> conv;  // [conv_dim][kernel]: channel c's taps, oldest input first
  std::vector<float> dt_bias;  // [n_v_heads]
  std::vector<float> a;        // [n_v_heads] = -exp(A_log), as converters store it
  std::vector<float> norm;     // [head_v_dim] gated RMSNorm weight
  Matrix out;
};

struct MoeWeights {
  Matrix router;                       // [n_embd] -> [n_expert]
  ExpertTensor gate, up, down;         // SwiGLU experts
  // Shared expert (qwen3next); absent for qwen3moe.
  Matrix shared_gate, shared_up, shared_down;
  std::vector<float> shared_router;    // [n_embd]: sigmoid(dot(x, w)) scales the shared expert
  std::vector<float> router_bias;      // [n_expert] added to the logits (gpt-oss)
  std::vector<float> score_bias;       // [n_expert] exp_probs_b: for the choice only
  // Per-expert biases, [n_expert][n_ff] for gate and up, [n_expert][n_embd] for down.
  std::vector<float> gate_bias, up_bias, down_bias;
};

// A dense SwiGLU FFN layer (the leading layers of deepseek2 / glm4moe).
struct DenseFfnWeights {
  Matrix gate, up, down;
};

struct LayerWeights {
  LayerRecipe recipe;            // the parts this layer is built from (hp.recipes[il])
  bool recurrent = false;        // = recipe.mixer.kind == GatedDeltaNet
  std::vector<float> attn_norm;  // before the token mixer
  std::vector<float> ffn_norm;   // before the MoE (qwen3next: post_attention_norm)
  AttentionWeights attn;
  MlaWeights mla;
  DeltaNetWeights delta;
  MoeWeights moe;
  DenseFfnWeights dense;
};

// Multi-token-prediction head of qwen3next (loaded and checked; not run by the reference yet).
struct NextnWeights {
  LayerWeights block;
  Matrix eh_proj;                        // [2 * n_embd] -> [n_embd]
  std::vector<float> enorm, hnorm;
  Matrix embed_tokens, shared_head_head;  // optional
  std::vector<float> shared_head_norm;    // optional (empty when absent)
};

struct Model {
  gguf::GgufFile file;
  HParams hp;
  Matrix tok_embd;                 // [n_embd] x n_vocab rows
  std::vector<float> output_norm;
  Matrix output;                   // lm head; token_embd when the file has no output.weight
  std::vector<LayerWeights> layers;
  std::vector<NextnWeights> nextn;

  // Opens and binds; throws ModelError (or gguf::GgufError) naming what disagrees.
  static Model load(const std::string& path);
  static Model bind(gguf::GgufFile file);
};

// Binds every layer's tensors by its recipe and the description's tensor table, with the shapes
// the hyper-parameters imply (bind_layers.cpp).
void bind_layers(Model& m, TensorBinder& b);

// Refuses (ModelError naming the layer, the option and the backend) a model whose recipes use a
// feature `support` lacks: a model is never run with a part a backend would compute wrongly.
void check_supported(const Model& m, const BackendSupport& support);

}  // namespace moraine::model
