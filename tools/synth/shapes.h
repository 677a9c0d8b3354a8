// The model shapes moraine-synth writes: real MoE configurations (Qwen3, Qwen3-Next, Qwen3.5,
// gpt-oss, GLM-4.5-Air) and tiny variants, and the GGUF tensor list and architecture keys each
// implies, named and laid out as llama.cpp loads those architectures.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/gguf/gguf_value.h"
#include "common/model/hparams.h"

namespace moraine::synth {

struct ShapeSpec {
  std::string name;  // e.g. "qwen3moe-30b-a3b"
  std::string arch;  // general.architecture: "qwen3moe", "qwen3next", "qwen35moe", "gpt-oss", "glm4moe"
  int64_t n_layer = 0, hidden = 0, vocab = 0, context_length = 0;
  int64_t n_head = 0, n_head_kv = 0, head_dim = 0, n_rot = 0;
  int64_t dense_ff = 0;  // the config's intermediate_size (written as feed_forward_length; no dense layer uses it)
  int64_t n_expert = 0, n_expert_used = 0, ff_exp = 0, ff_shexp = 0;
  double rope_theta = 1e6, rms_eps = 1e-6;
  // qwen3next: Gated DeltaNet ("linear attention") layers, all but every full_attn_interval-th.
  int64_t full_attn_interval = 0, conv_kernel = 0, ssm_head_dim = 0, ssm_k_heads = 0, ssm_v_heads = 0;
  // gpt-oss: every swa_period-th layer full attention, the others slide over sliding_window; YaRN.
  int64_t sliding_window = 0, swa_period = 0, yarn_orig_ctx = 0;
  double yarn_factor = 1.0;
  // glm4moe: the first n_dense_lead layers run a dense FFN of dense_ff; n_shared shared experts
  // of ff_exp; the sigmoid router's weights times routed_scale, renormalised when norm_topk; q/k
  // norm when qk_norm. deepseek2's shapes use the same FFN fields, plus multi-head latent
  // attention (head_dim is then kv_lora_rank + n_rot, the cached row; n_head_kv 1) and its router:
  // softmax, or sigmoid over n_group groups of which topk_group are used.
  int64_t n_dense_lead = 0, n_shared = 0;
  bool norm_topk = false, qk_norm = false;
  double routed_scale = 1.0;
  int64_t q_lora_rank = 0, kv_lora_rank = 0, qk_nope = 0, v_head = 0, n_group = 1, topk_group = 1;
  bool sigmoid_router = false;
  double mscale_all_dim = 0.0;

  // The DeltaNet hybrids (qwen3next, qwen35moe): gated q projection, recurrent layers.
  bool next() const { return arch == "qwen3next" || arch == "qwen35moe"; }
  bool mla() const { return arch == "deepseek2"; }
  bool recurrent(int64_t layer) const { return next() && (layer + 1) % full_attn_interval != 0; }
};

// Every named shape, in the order --help lists them.
const std::vector<ShapeSpec>& named_shapes();
// Throws std::invalid_argument listing the known names when `name` is not one.
ShapeSpec find_shape(const std::string& name);

// What a tensor is for: decides how its random values are drawn (see weight_init.h).
enum class Role {
  Embedding,     // token_embd
  Output,        // output (LM head)
  Norm,          // RMSNorm gains over the hidden state (and the router input)
  HeadNorm,      // per-head / per-value-head norms (q/k norm, ssm_norm)
  InProj,        // reads the normalised hidden state: q/k/v, qkv, gate, ba, expert gate/up, ...
  OutProj,       // writes into the residual stream: attn_output, ssm_out, expert/shared down
  Router,        // ffn_gate_inp
  SharedGate,    // ffn_gate_inp_shexp: one row over the hidden state
  Bias,          // attention and expert biases, the router's bias (gpt-oss)
  Sink,          // attn_sinks: one softmax sink logit per head (gpt-oss)
  Conv,          // ssm_conv1d taps
  DtBias,        // ssm_dt.bias
  Decay,         // ssm_a = -exp(A_log)
};

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;  // ggml order: shape[0] is the row length
  Role role;
  int64_t layer = -1;  // -1 for the tensors outside the blocks
};

// The hyper-parameters (and recipes, from the architecture's description) a shape implies.
model::HParams to_hparams(const ShapeSpec& s);

// The tensors the description lists for the shape (common/model/layer_tensors.h).
std::vector<TensorSpec> tensor_list(const ShapeSpec& s);

// The architecture keys ("qwen3moe.block_count", ...) in the order llama.cpp's converter writes them.
std::vector<std::pair<std::string, gguf::Value>> arch_metadata(const ShapeSpec& s);

}  // namespace moraine::synth
