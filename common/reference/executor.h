// The CPU reference executor: one process, float32 accumulation, weights read in place from the
// mapped GGUF. It is the yardstick faster paths are measured against, so it favours clarity:
// every token of a batch goes through exactly the same arithmetic as it would alone (rows of a
// matmul are independent dots; attention and the recurrences run token by token), which makes
// decode after prefill bit-identical to a fresh prefill of the same tokens.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "common/model/kv_type.h"
#include "common/model/model.h"
#include "common/reference/matmul.h"
#include "common/reference/thread_pool.h"

namespace moraine::reference {

// How an MLA layer (deepseek2) computes its attention; mla_block.cpp. Auto: the form llama.cpp
// uses for the file's layout (absorbed with attn_k_b / attn_v_b, expanded with attn_kv_b).
enum class MlaForm { Auto, Absorbed, Expanded };

struct ExecutorOptions {
  int n_threads = 0;  // <= 0: all hardware threads
  int64_t min_parallel_work = ThreadPool::kDefaultMinParallelWork;  // see ThreadPool
  // Every matmul's dot order (matmul.h): 0, the default, is the kernels' own; another seed gives
  // another valid float order, to measure how far that alone moves the logits. With an F16 KV
  // cache a seed also rounds the K/V values within 2^-20 of a half rounding edge either way
  // (attention_block.cpp): another float order could have put them on the other side.
  DotOrderSeed dot_order = 0;
  // The KV cache's element type (common/model/kv_type.h): with F16 every K and V element is
  // rounded to IEEE half when stored, as the CUDA backend's F16 cache holds it.
  model::KvType kv_type = model::KvType::F32;
  // Tests: non-zero, every stored K and V element is multiplied by 1 + 2^-11 or 1 - 2^-11 (a sign
  // drawn from (seed, layer, position, element)): at each element at least as large a change as
  // the F16 rounding makes (at most 2^-11 relative for normal halves), to measure how far such a
  // change of the cache moves the logits (tests/reference/kv_f16_test.cpp).
  uint64_t kv_perturb_seed = 0;
  MlaForm mla_form = MlaForm::Auto;   // the two forms differ in float order only (tests compare them)
};

class ReferenceExecutor {
 public:
  explicit ReferenceExecutor(const model::Model& model, ExecutorOptions opt = {});

  // Runs `tokens` at positions n_past() .. n_past() + size - 1 and appends them to the caches.
  // Returns logits row-major [rows][n_vocab]: one row per token when all_logits, else only the
  // last token's. Throws std::invalid_argument for a token id outside the vocabulary.
  // hidden (nullable): the output-normed rows the lm head read ([rows][n_embd]), what the MTP head takes.
  std::vector<float> forward(std::span<const int32_t> tokens, bool all_logits, std::vector<float>* hidden = nullptr);

  // The multi-token-prediction head (qwen3next's MTP: the model's first nextn block; mtp.cpp), as
  // tools/train/model.py runs it. Slot i of its own KV cache sits at RoPE position i and takes the
  // trunk's output-normed hidden row of position i and token i+1: fc([enorm(embed(t_i+1)) |
  // hnorm(h_i)]), one full-attention MoE block, shared_head_norm, the lm head: logits of token i+2.
  // mtp_forward runs slots mtp_n_past() .. + n (n = next_tokens.size(); `hidden` [n][n_embd]) and
  // appends them to that cache; logits [logit_rows][n_vocab] of the last logit_rows slots, and
  // hidden_out (nullable) their shared_head_norm rows: what a chained draft feeds back as its hidden
  // (as vLLM's MTP chain does). std::logic_error without a nextn block; std::invalid_argument for a
  // token outside the vocabulary or logit_rows outside 0..n.
  bool has_mtp() const { return !m_.nextn.empty(); }
  int64_t mtp_n_past() const { return mtp_n_past_; }
  void mtp_forward(const float* hidden, std::span<const int32_t> next_tokens, int64_t logit_rows, float* logits,
                   float* hidden_out);
  // Keeps slots 0 .. n - 1 of the MTP cache (drafts rolled back); std::logic_error past what is cached.
  void mtp_rewind(int64_t n);

  // Layer-step entry points for a process that runs the routed experts elsewhere (gpu_worker's
  // CPU backend): the same arithmetic forward() does, cut where the MoE block leaves the process.
  // embed: x[t] = token_embd row of tokens[t].
  void embed(std::span<const int32_t> tokens, float* x) const;
  // Layer il's token mixer over n rows of residual x at positions n_past() .. (adds its output
  // to x, appends to the caches), then the normalised MoE input into h.
  void mixer_step(int64_t il, float* x, int64_t n, float* h);
  // Marks the n rows of the step as cached (after the last layer).
  void advance(int64_t n) {
    n_past_ += n;
    window_first_ = 0;
  }
  // A long step run layer by layer over windows of its rows (gpu_worker's long steps): the next
  // mixer_step calls' rows start at position n_past() + first, not n_past(). Each layer must see
  // its windows in order, so its caches grow as they would over consecutive steps.
  void set_window(int64_t first) { window_first_ = first; }
  // The final norm alone: h [rows][n_embd], the rows output_logits feeds the lm head (the MTP head's input).
  void output_norm(const float* x, int64_t rows, float* h) const;
  // Final norm and lm head over `rows` rows of x: logits [rows][n_vocab]; h is rows * n_embd scratch.
  void output_logits(const float* x, int64_t rows, float* h, float* logits);
  ThreadPool& pool() { return pool_; }
  DotOrderSeed dot_order() const { return order_; }
  model::KvType kv_type() const { return kv_type_; }

  void reset();  // forget every cached token
  // Speculation's rejected tokens: keep only positions 0 .. n_past - 1 of the caches. A DeltaNet
  // layer's state cannot be taken back token by token: a model with one rewinds only to the
  // position of its last snapshot() (the recurrent states saved there come back; the attention
  // caches are cut). Throws std::logic_error when n_past is more than is cached, or, with
  // recurrent layers, is not the snapshot's position.
  void snapshot();
  void rewind(int64_t n_past);
  // The conversation cache (gpu_worker's state store): every layer's caches and recurrent states
  // as bytes (model/sequence_state.h), and back; load_state makes that sequence the cached one
  // (no snapshot taken since). std::invalid_argument for bytes of another shape.
  size_t state_bytes() const;   // what save_state writes now
  void save_state(std::span<uint8_t> out) const;   // exactly state_bytes()
  void load_state(std::span<const uint8_t> in);
  bool has_recurrent() const;
  int64_t n_past() const { return n_past_; }

  // Several sequences on one executor (the gpu_worker's sequence slots): everything a sequence
  // caches (every layer's K/V and recurrent state, n_past, its snapshot, the MTP cache), held
  // apart while another sequence is the executor's own. swap_sequence exchanges the executor's
  // sequence with `other` (vector swaps, nothing copied), so the weights and thread pool serve
  // every slot. A default-constructed Sequence is empty: swap it in, then reset().
  struct LayerState {
    // [n_past][n_head_kv * head_dim], post-norm, post-RoPE; half values when kv_type is F16.
    // An MLA layer: k_cache [n_past][kv_lora_rank + rope_dim] = [normed latent | rotated key], no v_cache.
    std::vector<float> k_cache, v_cache;
    std::vector<float> conv_state;        // [conv_kernel - 1][conv_dim], oldest first
    std::vector<float> ssm_state;         // [n_v_heads][head_k_dim][head_v_dim]
  };
  struct Sequence {
    std::vector<LayerState> state, snapshot;
    int64_t n_past = 0, window_first = 0, snapshot_pos = -1, mtp_n_past = 0;
    LayerState mtp_state;
  };
  void swap_sequence(Sequence& other);
  const model::Model& model() const { return m_; }
  int64_t n_vocab() const { return m_.hp.n_vocab; }
  int n_threads() const { return pool_.size(); }

 private:

  // Each adds its block's output for n tokens of normalised input h to the residual x.
  void attention_block(int64_t il, const float* h, int64_t n, float* x);  // attention_block.cpp
  void delta_net_block(int64_t il, const float* h, int64_t n, float* x);  // delta_net_block.cpp
  void mla_block(int64_t il, const float* h, int64_t n, float* x);        // mla_block.cpp
  // Floats per cached position of layer il's k_cache and v_cache (0 for a recurrent layer).
  int64_t k_width(int64_t il) const;
  int64_t v_width(int64_t il) const;
  void moe_block(int64_t il, const float* h, int64_t n, float* x);        // moe_block.cpp
  void dense_ffn_block(int64_t il, const float* h, int64_t n, float* x);  // moe_block.cpp
  // The layer's FFN as its recipe says: a dense SwiGLU FFN or the MoE block.
  void ffn_block(int64_t il, const float* h, int64_t n, float* x);        // moe_block.cpp

  // Block il: a trunk layer (il < n_layer) or, il == n_layer, the MTP block with its own cache and
  // positions (mtp_state_, mtp_n_past_; no windows).
  const model::LayerWeights& block(int64_t il) const {
    return il < m_.hp.n_layer ? m_.layers[static_cast<size_t>(il)] : m_.nextn.at(static_cast<size_t>(il - m_.hp.n_layer)).block;
  }
  LayerState& block_state(int64_t il) { return il < m_.hp.n_layer ? state_[static_cast<size_t>(il)] : mtp_state_; }
  int64_t block_pos0(int64_t il) const { return il < m_.hp.n_layer ? n_past_ + window_first_ : mtp_n_past_; }

  const model::Model& m_;
  ThreadPool pool_;
  DotOrderSeed order_;
  model::KvType kv_type_;
  uint64_t kv_perturb_seed_;
  MlaForm mla_form_;
  std::vector<LayerState> state_;
  int64_t n_past_ = 0;
  int64_t window_first_ = 0;   // set_window: the first row's position is n_past_ + window_first_
  LayerState mtp_state_;      // the MTP block's KV cache: slots 0 .. mtp_n_past_ - 1
  int64_t mtp_n_past_ = 0;
  std::vector<LayerState> snapshot_;   // recurrent states at snapshot_pos_ (-1: none since reset)
  int64_t snapshot_pos_ = -1;
};

}  // namespace moraine::reference
