// A loaded model: hyper-parameters plus every weight bound (with shape checks) to the mapped
// GGUF bytes. Small vectors (norm weights, biases, decay constants) are held dequantized as
// float; matrices stay in the file's type and are read in place.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/gguf/gguf.h"
#include "common/model/hparams.h"
#include "common/model/tensor_binder.h"

namespace moraine::model {

// Full (softmax) attention. qwen3next's q projection carries the output gate: per head,
// head_dim query values then head_dim gate values (q.n_rows == 2 * n_head * head_dim).
struct AttentionWeights {
  Matrix q, k, v, o;
  std::vector<float> q_norm, k_norm;   // per-head RMSNorm over head_dim
  bool q_has_gate = false;
};

// Gated DeltaNet (qwen3next linear attention). The projections are stored either as
// llama.cpp's current pair (qkv: [q all heads | k all heads | v all heads], gate: z) or as the
// legacy fused ssm_in, grouped per key head as [q | k | v_group | z_group].
struct DeltaNetWeights {
  Matrix qkv, z;          // current layout
  Matrix qkvz;            // legacy layout (ssm_in); used when qkv is absent
  Matrix ba;              // grouped per key head: [beta x r | alpha x r], r = v_heads / k_heads
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
};

struct LayerWeights {
  bool recurrent = false;
  std::vector<float> attn_norm;  // before the token mixer
  std::vector<float> ffn_norm;   // before the MoE (qwen3next: post_attention_norm)
  AttentionWeights attn;
  DeltaNetWeights delta;
  MoeWeights moe;
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

// Family recipes: which tensors each layer has and their shapes (qwen3moe.cpp, qwen3next.cpp).
void bind_qwen3moe(Model& m, TensorBinder& b);
void bind_qwen3next(Model& m, TensorBinder& b);

}  // namespace moraine::model
