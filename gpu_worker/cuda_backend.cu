// The CUDA backend (see cuda_backend.h). Decode and prefill both run the matvec kernels over the
// step's rows (one batched launch per weight matrix, the weight read once per row): there is no
// cuBLAS GEMM path for prefill yet.
#include "gpu_worker/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/delta_net.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/embed_rows.h"
#include "kernels/cuda/head_rms_norm.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/matvec_float.h"
#include "kernels/cuda/moe_combine.h"
#include "kernels/cuda/moe_fused.h"
#include "kernels/cuda/quantize_activations_llama.h"
#include "kernels/cuda/residual_add.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/cuda/rope.h"
#include "kernels/cuda/router.h"
#include "kernels/cuda/swiglu.h"

namespace moraine::gpu_worker {

namespace {

using cuda::DeviceBuffer;

// A weight matrix (or every expert's matrix of one kind) in device memory, in its file format.
struct DevMatrix {
  TensorType type = TensorType::F32;
  int64_t rows = 0;         // rows of one matrix (one expert's, for expert tensors)
  int64_t cols = 0;
  size_t matrix_bytes = 0;  // bytes of one matrix: the stride between experts
  DeviceBuffer<uint8_t> bytes;
  explicit operator bool() const { return rows > 0; }
};

bool has_kernel(TensorType t) { return cuda::matvec_supported(t) || cuda::matvec_float_supported(t); }

DevMatrix upload_matrix(const model::Matrix& m, int64_t n_expert, int64_t rows_per_matrix) {
  DevMatrix d;
  if (!m) return d;
  const std::string name = m.info != nullptr ? m.info->name : std::string("(unnamed)");
  if (!has_kernel(m.type))
    throw std::runtime_error("CUDA backend: tensor " + name + " is " + std::string(type_name(m.type)) +
                             ", which has no CUDA matvec kernel (kernels/cuda/matvec.h and matvec_float.h list "
                             "the formats); requantize it with moraine-quantize");
  d.type = m.type;
  d.rows = rows_per_matrix;
  d.cols = m.n_cols;
  d.matrix_bytes = m.row_bytes * static_cast<size_t>(rows_per_matrix);
  const size_t total = d.matrix_bytes * static_cast<size_t>(n_expert);
  d.bytes = DeviceBuffer<uint8_t>(total);
  d.bytes.upload(m.data, total);
  return d;
}

DevMatrix upload_matrix(const model::Matrix& m) { return upload_matrix(m, 1, m.n_rows); }

// Rows `order` of m (in that order) as a matrix of their own: the legacy fused ssm_in of
// qwen3next is split into its qkv and z rows at upload, so one code path serves both layouts.
DevMatrix upload_rows(const model::Matrix& m, const std::vector<int64_t>& order) {
  std::vector<uint8_t> bytes(m.row_bytes * order.size());
  for (size_t i = 0; i < order.size(); ++i) std::copy_n(m.row(order[i]), m.row_bytes, bytes.data() + i * m.row_bytes);
  model::Matrix part = m;
  part.n_rows = static_cast<int64_t>(order.size());
  part.data = bytes.data();
  return upload_matrix(part);
}
DevMatrix upload_experts(const model::ExpertTensor& e) {
  return upload_matrix(e.all, e.n_expert, e.rows_per_expert);
}

DeviceBuffer<float> upload_vector(const std::vector<float>& v) {
  DeviceBuffer<float> d(v.size());
  if (!v.empty()) d.upload(v.data(), v.size());
  return d;
}

struct DevLayer {
  bool recurrent = false;
  DeviceBuffer<float> attn_norm, ffn_norm, q_norm, k_norm, shared_router;
  DevMatrix q, k, v, o, router, gate, up, down, shared_gate, shared_up, shared_down;
  bool q_has_gate = false;
  DeviceBuffer<float> k_cache, v_cache;  // [max_context][n_head_kv * head_dim]
  // Gated DeltaNet (qwen3next): projections, small weights, and the recurrent state.
  DevMatrix qkv, z, ba, ssm_out;
  DeviceBuffer<float> conv_w, ssm_a, dt_bias, ssm_norm, conv_state, ssm_state;
};

// The legacy ssm_in rows (per key head g: q(dk) | k(dk) | v(r*dv) | z(r*dv)) that make the
// current layout's qkv ([q all heads | k all heads | v all heads]) and z.
void legacy_qkvz_orders(const model::HParams& hp, std::vector<int64_t>& qkv, std::vector<int64_t>& z) {
  const int64_t dk = hp.ssm_head_k_dim, dv = hp.ssm_head_v_dim, nk = hp.ssm_n_k_heads;
  const int64_t r = hp.ssm_n_v_heads / nk, gsz = 2 * dk + 2 * r * dv;
  qkv.clear();
  z.clear();
  for (int64_t g = 0; g < nk; ++g)
    for (int64_t i = 0; i < dk; ++i) qkv.push_back(g * gsz + i);
  for (int64_t g = 0; g < nk; ++g)
    for (int64_t i = 0; i < dk; ++i) qkv.push_back(g * gsz + dk + i);
  for (int64_t g = 0; g < nk; ++g)
    for (int64_t i = 0; i < r * dv; ++i) qkv.push_back(g * gsz + 2 * dk + i);
  for (int64_t g = 0; g < nk; ++g)
    for (int64_t i = 0; i < r * dv; ++i) z.push_back(g * gsz + 2 * dk + r * dv + i);
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(const model::Model& m, int device, int max_tokens, int64_t max_context)
      : m_(m), device_(device), max_tokens_(max_tokens), max_context_(max_context) {
    const model::HParams& hp = m.hp;
    std::string why;
    if (!cuda::device_available(&why)) throw std::runtime_error("--backend cuda: no CUDA device: " + why);
    CUDA_CHECK(cudaSetDevice(device));
    if (max_tokens <= 0 || max_tokens > 65535 || max_context < max_tokens)
      throw std::runtime_error("CUDA backend: max_tokens " + std::to_string(max_tokens) + " must be in 1..65535 and "
                               "at most the context (" + std::to_string(max_context) + ")");
    bool any_recurrent = false;
    for (int64_t il = 0; il < hp.n_layer; ++il) any_recurrent = any_recurrent || m.layers[il].recurrent;
    if (any_recurrent) {
      try {
        cuda::check_delta_net_shape(delta_shape());
      } catch (const std::invalid_argument& e) {
        throw std::runtime_error(std::string("CUDA backend: the Gated DeltaNet kernels cannot run this model: ") +
                                 e.what());
      }
    }
    if (hp.head_dim > cuda::kAttentionMaxHeadDim)
      throw std::runtime_error("CUDA backend: head_dim " + std::to_string(hp.head_dim) + " above the attention "
                               "kernel's " + std::to_string(cuda::kAttentionMaxHeadDim));
    const int64_t d = hp.n_embd, k = hp.n_expert_used, hd = hp.head_dim;
    const int64_t kv_dim = hp.n_head_kv * hd;
    int64_t q_rows = hp.n_head * hd;
    int64_t max_cols = std::max({d, hp.n_head * hd, hp.n_ff_exp, hp.n_ff_shexp, hp.ssm_value_dim()});

    layers_.resize(static_cast<size_t>(hp.n_layer));
    for (int64_t il = 0; il < hp.n_layer; ++il) {
      const model::LayerWeights& L = m.layers[il];
      DevLayer& D = layers_[il];
      D.attn_norm = upload_vector(L.attn_norm);
      D.ffn_norm = upload_vector(L.ffn_norm);
      D.router = upload_matrix(L.moe.router);
      D.gate = upload_experts(L.moe.gate);
      D.up = upload_experts(L.moe.up);
      D.down = upload_experts(L.moe.down);
      if (L.moe.shared_up) {
        D.shared_gate = upload_matrix(L.moe.shared_gate);
        D.shared_up = upload_matrix(L.moe.shared_up);
        D.shared_down = upload_matrix(L.moe.shared_down);
        D.shared_router = upload_vector(L.moe.shared_router);
      }
      if (L.recurrent) {
        upload_delta_net(L.delta, D);
        continue;
      }
      D.q_norm = upload_vector(L.attn.q_norm);
      D.k_norm = upload_vector(L.attn.k_norm);
      D.q = upload_matrix(L.attn.q);
      D.k = upload_matrix(L.attn.k);
      D.v = upload_matrix(L.attn.v);
      D.o = upload_matrix(L.attn.o);
      D.q_has_gate = L.attn.q_has_gate;
      q_rows = std::max(q_rows, L.attn.q.n_rows);
      D.k_cache = DeviceBuffer<float>(static_cast<size_t>(max_context * kv_dim));
      D.v_cache = DeviceBuffer<float>(static_cast<size_t>(max_context * kv_dim));
    }
    output_norm_ = upload_vector(m.output_norm);
    output_ = upload_matrix(m.output);
    if (cuda::embed_rows_supported(m.tok_embd.type)) {
      tok_embd_ = DeviceBuffer<uint8_t>(m.tok_embd.row_bytes * static_cast<size_t>(m.tok_embd.n_rows));
      tok_embd_.upload(m.tok_embd.data, tok_embd_.size());
    }

    const size_t T = static_cast<size_t>(max_tokens);
    const size_t slots = T * static_cast<size_t>(k);
    x_ = DeviceBuffer<float>(T * d);
    h_ = DeviceBuffer<float>(T * d);
    y_ = DeviceBuffer<float>(T * d);
    qg_ = DeviceBuffer<float>(T * q_rows);
    q_ = DeviceBuffer<float>(T * hp.n_head * hd);
    attn_ = DeviceBuffer<float>(T * hp.n_head * hd);
    const cuda::AttentionShape shape = attention_shape();
    // Attention records for 16 rows at a time (longer prefills go through in passes): enough to
    // fill the GPU with (row, head, chunk) CTAs, about 34 MB at 32K context for 32 heads of 128.
    attn_scratch_ = DeviceBuffer<float>(static_cast<size_t>(
        cuda::attention_scratch_floats(shape, std::min<int64_t>(max_tokens, 16), max_context)));
    // Activation bytes for the widest row of any matrix, for every expert row of a step; a
    // quantized row never takes more bytes than the floats it came from.
    act_ = DeviceBuffer<uint8_t>(slots * static_cast<size_t>(max_cols) * sizeof(float));
    router_logits_ = DeviceBuffer<float>(T * hp.n_expert);
    chosen_ = DeviceBuffer<int32_t>(slots);
    weight_ = DeviceBuffer<float>(slots);
    token_ids_ = DeviceBuffer<int32_t>(T);
    expert_in_ = DeviceBuffer<float>(slots * d);
    expert_ids_ = DeviceBuffer<int32_t>(slots);
    expert_g_ = DeviceBuffer<float>(slots * hp.n_ff_exp);
    expert_u_ = DeviceBuffer<float>(slots * hp.n_ff_exp);
    expert_out_ = DeviceBuffer<float>(slots * d);
    slot_rows_ = DeviceBuffer<float>(slots * d);
    if (hp.n_ff_shexp > 0) {
      shared_g_ = DeviceBuffer<float>(T * hp.n_ff_shexp);
      shared_u_ = DeviceBuffer<float>(T * hp.n_ff_shexp);
      shared_out_ = DeviceBuffer<float>(T * d);
      shared_logit_ = DeviceBuffer<float>(T);
    }
    logits_ = DeviceBuffer<float>(T * hp.n_vocab);
    if (any_recurrent) {
      const cuda::DeltaNetShape ds = delta_shape();
      mixed_ = DeviceBuffer<float>(T * ds.conv_dim());
      z_ = DeviceBuffer<float>(T * ds.value_dim());
      ba_ = DeviceBuffer<float>(T * 2 * ds.n_v_heads);
      core_ = DeviceBuffer<float>(T * ds.value_dim());
      delta_ws_ = DeviceBuffer<float>(static_cast<size_t>(cuda::delta_net_workspace_floats(ds, max_tokens)));
    }
    zero_states();
    host_in_.resize(slots * d);
    host_out_.resize(slots * d);
    host_ids_.resize(slots);
    host_rows_.resize(slots);
    setup_moe_fused();
    CUDA_CHECK(cudaDeviceSynchronize());
  }

  void reset() override {
    use_device();
    zero_states();
    n_past_ = 0;
  }
  int64_t n_past() const override { return n_past_; }

  void embed(const int32_t* tokens, int64_t n, float* x) override {
    check_rows(n, "embed");
    use_device();
    const model::HParams& hp = m_.hp;
    const int64_t d = hp.n_embd;
    for (int64_t t = 0; t < n; ++t) {
      if (tokens[t] < 0 || tokens[t] >= hp.n_vocab)
        throw std::invalid_argument("token id " + std::to_string(tokens[t]) + " at position " +
                                    std::to_string(n_past_ + t) + " is outside the vocabulary [0, " +
                                    std::to_string(hp.n_vocab) + ")");
    }
    if (tok_embd_.size() == 0) {  // a format without a device kernel: the scalar dequantizer
      for (int64_t t = 0; t < n; ++t) dequantize_row(m_.tok_embd.type, m_.tok_embd.row(tokens[t]), x + t * d, d);
      return;
    }
    token_ids_.upload(tokens, static_cast<size_t>(n));
    cuda::embed_rows(m_.tok_embd.type, tok_embd_.get(), m_.tok_embd.row_bytes, d, token_ids_.get(), n, x_.get());
    x_.download(x, static_cast<size_t>(n * d));
  }

  void mixer(int64_t il, float* x, int64_t n, float* h) override {
    check_rows(n, "mixer");
    use_device();
    check_layer(il);
    if (n_past_ + n > max_context_)
      throw std::runtime_error("CUDA backend: positions " + std::to_string(n_past_) + ".." +
                               std::to_string(n_past_ + n - 1) + " do not fit the KV cache of " +
                               std::to_string(max_context_) + " positions");
    const model::HParams& hp = m_.hp;
    const int64_t d = hp.n_embd;
    const float eps = static_cast<float>(hp.rms_eps);
    DevLayer& L = layers_[il];
    x_.upload(x, static_cast<size_t>(n * d));
    cuda::rms_norm(x_.get(), L.attn_norm.get(), h_.get(), d, n, eps);
    if (L.recurrent) {
      delta_net_block(L, n);
    } else {
      attention_block(L, n);
    }
    cuda::rms_norm(x_.get(), L.ffn_norm.get(), h_.get(), d, n, eps);
    x_.download(x, static_cast<size_t>(n * d));
    h_.download(h, static_cast<size_t>(n * d));
  }

  void route(int64_t il, const float* h, int64_t n, int32_t* chosen, float* weight) override {
    check_rows(n, "route");
    use_device();
    check_layer(il);
    const model::HParams& hp = m_.hp;
    const int64_t k = hp.n_expert_used;
    h_.upload(h, static_cast<size_t>(n * hp.n_embd));
    matmul(layers_[il].router, h_.get(), n, router_logits_.get());
    cuda::route_softmax_top_k(router_logits_.get(), n, hp.n_expert, k, hp.norm_topk_prob, chosen_.get(),
                              weight_.get());
    chosen_.download(chosen, static_cast<size_t>(n * k));
    weight_.download(weight, static_cast<size_t>(n * k));
  }

  void routed_experts(int64_t il, const float* h, int64_t n, const group::ExpertPlan& plan,
                      const std::vector<int32_t>& experts, float* expert_out) override {
    check_rows(n, "routed_experts");
    use_device();
    check_layer(il);
    if (fused_ok_[il]) return routed_experts_fused(il, h, n, plan, experts, expert_out);
    const model::HParams& hp = m_.hp;
    const int64_t d = hp.n_embd, k = hp.n_expert_used, ff = hp.n_ff_exp;
    // Pack the rows of this device's experts: row j of expert e is h's token slot_of / k.
    int64_t rows = 0;
    for (int32_t e : experts) {
      if (e < 0 || e >= hp.n_expert)
        throw std::invalid_argument("routed_experts: expert id " + std::to_string(e) + " outside [0, " +
                                    std::to_string(hp.n_expert) + ")");
      for (int32_t r = plan.start[e]; r < plan.start[e + 1]; ++r) {
        const int64_t t = plan.slot_of[r] / k;
        if (rows >= n * k || t >= n)
          throw std::invalid_argument("routed_experts: the plan names more rows than the step's " +
                                      std::to_string(n * k) + " slots");
        std::copy_n(h + t * d, d, host_in_.data() + rows * d);
        host_ids_[rows] = e;
        host_rows_[rows] = r;
        ++rows;
      }
    }
    if (rows == 0) return;
    const DevLayer& L = layers_[il];
    expert_in_.upload(host_in_.data(), static_cast<size_t>(rows * d));
    expert_ids_.upload(host_ids_.data(), static_cast<size_t>(rows));
    expert_matmul(L.gate, expert_in_.get(), rows, expert_g_.get());
    expert_matmul(L.up, expert_in_.get(), rows, expert_u_.get());
    cuda::swiglu(expert_g_.get(), expert_u_.get(), rows * ff);
    expert_matmul(L.down, expert_g_.get(), rows, expert_out_.get());
    expert_out_.download(host_out_.data(), static_cast<size_t>(rows * d));
    for (int64_t i = 0; i < rows; ++i)
      std::copy_n(host_out_.data() + i * d, d, expert_out + int64_t{host_rows_[i]} * d);
  }

  void combine(int64_t il, const float* h, int64_t n, const float* weight, const float* const* slot_rows,
               float* x) override {
    check_rows(n, "combine");
    use_device();
    check_layer(il);
    const model::HParams& hp = m_.hp;
    const int64_t d = hp.n_embd, k = hp.n_expert_used;
    for (int64_t i = 0; i < n * k; ++i) std::copy_n(slot_rows[i], d, host_in_.data() + i * d);
    slot_rows_.upload(host_in_.data(), static_cast<size_t>(n * k * d));
    weight_.upload(weight, static_cast<size_t>(n * k));
    x_.upload(x, static_cast<size_t>(n * d));
    const DevLayer& L = layers_[il];
    const float* shared = nullptr;
    const float* gate_logit = nullptr;
    if (L.shared_up) {
      h_.upload(h, static_cast<size_t>(n * d));
      matmul(L.shared_gate, h_.get(), n, shared_g_.get());
      matmul(L.shared_up, h_.get(), n, shared_u_.get());
      cuda::swiglu(shared_g_.get(), shared_u_.get(), n * hp.n_ff_shexp);
      matmul(L.shared_down, shared_g_.get(), n, shared_out_.get());
      cuda::MatvecBatch b;  // the shared router: one F32 row dotted with each token's h
      b.count = static_cast<int>(n);
      b.act_stride_bytes = d * static_cast<int64_t>(sizeof(float));
      b.out_stride = 1;
      cuda::matvec_float_batched(TensorType::F32, L.shared_router.get(), 1, d, h_.get(), shared_logit_.get(), b);
      shared = shared_out_.get();
      gate_logit = shared_logit_.get();
    }
    cuda::moe_combine(x_.get(), slot_rows_.get(), weight_.get(), shared, gate_logit, n, k, d);
    x_.download(x, static_cast<size_t>(n * d));
  }

  void advance(int64_t n) override { n_past_ += n; }

  void logits(const float* x, int64_t rows, float* out) override {
    check_rows(rows, "logits");
    use_device();
    const model::HParams& hp = m_.hp;
    const int64_t d = hp.n_embd;
    x_.upload(x, static_cast<size_t>(rows * d));
    cuda::rms_norm(x_.get(), output_norm_.get(), h_.get(), d, rows, static_cast<float>(hp.rms_eps));
    matmul(output_, h_.get(), rows, logits_.get());
    logits_.download(out, static_cast<size_t>(rows * hp.n_vocab));
  }

 private:
  cuda::MoeLayerWeights fused_weights(const DevLayer& L) const {
    cuda::MoeLayerWeights w;
    w.gate_type = L.gate.type;
    w.up_type = L.up.type;
    w.down_type = L.down.type;
    w.n_embd = m_.hp.n_embd;
    w.n_ff = m_.hp.n_ff_exp;
    w.n_expert = m_.hp.n_expert;
    w.slots = fused_slots_.get();
    return w;
  }

  // Which layers take the fused MoE kernel (kernels/cuda/moe_fused.h): quantized experts whose
  // activations are Q8_K. moe_fused quantizes
  // Q8_0 activations with ggml's reference rule, while the reference executor (and so this
  // backend's matvec path) uses llama.cpp's x86 rule, and one activation rounded the other way
  // moves a tiny model's logits visibly; Q8_K is the same under both rules.
  void setup_moe_fused() {
    const model::HParams& hp = m_.hp;
    fused_ok_.assign(static_cast<size_t>(hp.n_layer), false);
    if (hp.n_expert_used > cuda::kMoeMaxTopK) return;
    size_t ws = 0;
    fused_slots_ = DeviceBuffer<cuda::MoeExpertSlot>(static_cast<size_t>(hp.n_expert));
    for (int64_t il = 0; il < hp.n_layer; ++il) {
      const DevLayer& L = layers_[il];
      const bool q8k = cuda::matvec_supported(L.gate.type) && cuda::matvec_supported(L.up.type) &&
                       cuda::matvec_supported(L.down.type) && dot_activation_type(L.gate.type) == TensorType::Q8_K &&
                       dot_activation_type(L.up.type) == TensorType::Q8_K &&
                       dot_activation_type(L.down.type) == TensorType::Q8_K;
      if (!q8k) continue;
      const cuda::MoeLayerWeights w = fused_weights(L);
      try {
        cuda::moe_fused_check(w);
      } catch (const std::invalid_argument&) {
        continue;  // a shape the fused kernel does not take: the batched matvec path serves it
      }
      ws = std::max(ws, cuda::moe_fused_workspace_bytes(w, cuda::kMoeMaxTokens, static_cast<int>(hp.n_expert_used)));
      fused_ok_[il] = true;
    }
    if (ws == 0) return;
    fused_ws_ = DeviceBuffer<uint8_t>(ws);
    cuda::moe_fused_workspace_init(fused_ws_.get(), ws);
    fused_chosen_.resize(static_cast<size_t>(max_tokens_ * hp.n_expert_used));
    fused_table_.resize(static_cast<size_t>(hp.n_expert));
    row_of_ = DeviceBuffer<int32_t>(static_cast<size_t>(max_tokens_ * hp.n_expert_used));
  }

  // routed_experts through moe_fused: the slot table names only this call's experts, so the
  // kernel computes exactly their slots and writes them to their plan rows. Longer steps go
  // through in groups of kMoeMaxTokens tokens: a token's expert rows then come from the same
  // kernel whatever the step's length, which keeps decode after prefill equal to a fresh prefill.
  void routed_experts_fused(int64_t il, const float* h, int64_t n, const group::ExpertPlan& plan,
                            const std::vector<int32_t>& experts, float* expert_out) {
    const model::HParams& hp = m_.hp;
    const int64_t d = hp.n_embd, k = hp.n_expert_used;
    const DevLayer& L = layers_[il];
    std::fill(fused_table_.begin(), fused_table_.end(), cuda::MoeExpertSlot{});
    int64_t rows = 0;
    for (int32_t e : experts) {
      if (e < 0 || e >= hp.n_expert)
        throw std::invalid_argument("routed_experts: expert id " + std::to_string(e) + " outside [0, " +
                                    std::to_string(hp.n_expert) + ")");
      fused_table_[e] = {L.gate.bytes.get() + e * L.gate.matrix_bytes, L.up.bytes.get() + e * L.up.matrix_bytes,
                         L.down.bytes.get() + e * L.down.matrix_bytes};
      rows += plan.count(e);
    }
    if (rows == 0) return;
    for (int64_t e = 0; e < hp.n_expert; ++e)
      for (int32_t r = plan.start[e]; r < plan.start[e + 1]; ++r) {
        if (plan.slot_of[r] < 0 || plan.slot_of[r] >= n * k)
          throw std::invalid_argument("routed_experts: the plan names slot " + std::to_string(plan.slot_of[r]) +
                                      " outside the step's " + std::to_string(n * k));
        fused_chosen_[plan.slot_of[r]] = static_cast<int32_t>(e);
      }
    fused_slots_.upload(fused_table_.data(), fused_table_.size());
    chosen_.upload(fused_chosen_.data(), static_cast<size_t>(n * k));
    row_of_.upload(plan.row_of.data(), static_cast<size_t>(n * k));
    h_.upload(h, static_cast<size_t>(n * d));
    for (int64_t t0 = 0; t0 < n; t0 += cuda::kMoeMaxTokens) {
      cuda::MoeRouting routing;
      routing.n_tokens = static_cast<int>(std::min<int64_t>(cuda::kMoeMaxTokens, n - t0));
      routing.k = static_cast<int>(k);
      routing.chosen = chosen_.get() + t0 * k;
      routing.weight = weight_.get() + t0 * k;  // unused: only the unweighted rows are asked for
      cuda::MoeOutputs out;
      out.slot_rows = expert_out_.get();
      out.slot_row_of = row_of_.get() + t0 * k;
      cuda::moe_fused(fused_weights(L), h_.get() + t0 * d, routing, out, fused_ws_.get(), fused_ws_.size());
    }
    expert_out_.download(host_out_.data(), static_cast<size_t>(n * k * d));
    for (int32_t e : experts)
      std::copy_n(host_out_.data() + int64_t{plan.start[e]} * d, int64_t{plan.count(e)} * d,
                  expert_out + int64_t{plan.start[e]} * d);
  }

  cuda::DeltaNetShape delta_shape() const {
    const model::HParams& hp = m_.hp;
    cuda::DeltaNetShape s;
    s.n_k_heads = hp.ssm_n_k_heads;
    s.n_v_heads = hp.ssm_n_v_heads;
    s.head_k_dim = hp.ssm_head_k_dim;
    s.head_v_dim = hp.ssm_head_v_dim;
    s.conv_kernel = hp.ssm_conv_kernel;
    return s;
  }

  void upload_delta_net(const model::DeltaNetWeights& W, DevLayer& D) {
    const cuda::DeltaNetShape s = delta_shape();
    D.recurrent = true;
    if (W.qkv) {
      D.qkv = upload_matrix(W.qkv);
      D.z = upload_matrix(W.z);
    } else {
      std::vector<int64_t> qkv_rows, z_rows;
      legacy_qkvz_orders(m_.hp, qkv_rows, z_rows);
      D.qkv = upload_rows(W.qkvz, qkv_rows);
      D.z = upload_rows(W.qkvz, z_rows);
    }
    D.ba = upload_matrix(W.ba);
    D.ssm_out = upload_matrix(W.out);
    D.conv_w = upload_vector(W.conv);
    D.ssm_a = upload_vector(W.a);
    D.dt_bias = upload_vector(W.dt_bias);
    D.ssm_norm = upload_vector(W.norm);
    D.conv_state = DeviceBuffer<float>(static_cast<size_t>(std::max<int64_t>(s.conv_state_floats(), 1)));
    D.ssm_state = DeviceBuffer<float>(static_cast<size_t>(s.ssm_state_floats()));
  }

  // A new sequence: the recurrent layers start from zero state (the KV cache needs no clearing:
  // attention reads only positions below n_past + n, all written by then).
  void zero_states() {
    for (DevLayer& L : layers_) {
      if (!L.recurrent) continue;
      L.conv_state.fill_bytes(0);
      L.ssm_state.fill_bytes(0);
    }
  }

  // Gated DeltaNet over the normalised rows in h_, its output added to x_: the projections as
  // matvecs, the conv / gates / recurrence / gated norm by delta_net_mix, then the out projection.
  void delta_net_block(DevLayer& L, int64_t n) {
    const model::HParams& hp = m_.hp;
    const cuda::DeltaNetShape s = delta_shape();
    matmul(L.qkv, h_.get(), n, mixed_.get());
    matmul(L.z, h_.get(), n, z_.get());
    matmul(L.ba, h_.get(), n, ba_.get());
    cuda::DeltaNetWeightsDevice w;
    w.conv_w = L.conv_w.get();
    w.a = L.ssm_a.get();
    w.dt_bias = L.dt_bias.get();
    w.norm_w = L.ssm_norm.get();
    cuda::DeltaNetStateDevice st;
    st.conv_state = s.conv_kernel > 1 ? L.conv_state.get() : nullptr;
    st.ssm_state = L.ssm_state.get();
    cuda::delta_net_mix(s, w, st, mixed_.get(), z_.get(), ba_.get(), n, static_cast<float>(hp.rms_eps),
                        delta_ws_.get(), core_.get());
    matmul(L.ssm_out, core_.get(), n, y_.get());
    cuda::residual_add(x_.get(), y_.get(), n * hp.n_embd);
  }

  cuda::AttentionShape attention_shape() const {
    const model::HParams& hp = m_.hp;
    cuda::AttentionShape s;
    s.n_head = hp.n_head;
    s.n_head_kv = hp.n_head_kv;
    s.head_dim = hp.head_dim;
    s.kv_stride = hp.n_head_kv * hp.head_dim;
    s.scale = 1.0f / std::sqrt(static_cast<float>(hp.head_dim));
    return s;
  }

  // The current device is per host thread: a backend built on one thread and stepped on another
  // must select its device again (a no-op when it already is the current one).
  void use_device() const { CUDA_CHECK(cudaSetDevice(device_)); }

  void check_rows(int64_t n, const char* what) const {
    if (n <= 0 || n > max_tokens_)
      throw std::invalid_argument(std::string("CUDA backend ") + what + ": " + std::to_string(n) +
                                  " rows, expected 1.." + std::to_string(max_tokens_));
  }
  void check_layer(int64_t il) const {
    if (il < 0 || il >= m_.hp.n_layer)
      throw std::invalid_argument("CUDA backend: layer " + std::to_string(il) + " outside [0, " +
                                  std::to_string(m_.hp.n_layer) + ")");
  }

  // y[t] = W x[t] for n rows of x (device), one batched launch; quantized weights dot the rows
  // quantized with llama.cpp's x86 rule, as the reference executor's matmul does.
  void matmul(const DevMatrix& W, const float* x, int64_t n, float* y) {
    cuda::MatvecBatch b;
    b.count = static_cast<int>(n);
    b.out_stride = W.rows;
    run_matvec(W, x, n, y, b);
  }
  // Row r of x through expert expert_ids_[r]'s matrix.
  void expert_matmul(const DevMatrix& W, const float* x, int64_t rows, float* y) {
    cuda::MatvecBatch b;
    b.count = static_cast<int>(rows);
    b.weight_stride_bytes = static_cast<int64_t>(W.matrix_bytes);
    b.out_stride = W.rows;
    b.expert_ids = expert_ids_.get();
    run_matvec(W, x, rows, y, b);
  }
  void run_matvec(const DevMatrix& W, const float* x, int64_t n, float* y, cuda::MatvecBatch& b) {
    if (cuda::matvec_float_supported(W.type)) {
      b.act_stride_bytes = W.cols * static_cast<int64_t>(sizeof(float));
      cuda::matvec_float_batched(W.type, W.bytes.get(), W.rows, W.cols, x, y, b);
      return;
    }
    const TensorType at = dot_activation_type(W.type);
    const size_t rb = row_bytes(at, W.cols);
    if (rb * static_cast<size_t>(n) > act_.size())
      throw std::logic_error("CUDA backend: activation scratch too small for " + std::to_string(n) + " rows");
    cuda::quantize_activations_llama(at, x, act_.get(), W.cols, n);
    b.act_stride_bytes = static_cast<int64_t>(rb);
    cuda::matvec_quantized_batched(W.type, W.bytes.get(), W.rows, W.cols, act_.get(), y, b);
  }

  // Full attention over the normalised rows in h_, its output added to x_. K and V of the new
  // rows go straight into the cache at n_past (the projection writes them there), then k is
  // normalised and rotated in place, so row t sees positions 0 .. n_past + t as in decode.
  void attention_block(DevLayer& L, int64_t n) {
    const model::HParams& hp = m_.hp;
    const int64_t hd = hp.head_dim, kv_dim = hp.n_head_kv * hd;
    const int64_t q_rows = L.q.rows, q_stride = L.q_has_gate ? 2 * hd : hd;
    const float eps = static_cast<float>(hp.rms_eps);
    float* k_new = L.k_cache.get() + n_past_ * kv_dim;
    float* v_new = L.v_cache.get() + n_past_ * kv_dim;
    matmul(L.q, h_.get(), n, qg_.get());
    matmul(L.k, h_.get(), n, k_new);
    matmul(L.v, h_.get(), n, v_new);
    cuda::head_rms_norm(qg_.get(), q_rows, q_stride, L.q_norm.get(), q_.get(), n, hp.n_head, hd, eps);
    cuda::rope_neox(q_.get(), n, hp.n_head, hp.n_head * hd, hd, hp.n_rot, n_past_, hp.rope_freq_base);
    cuda::head_rms_norm(k_new, kv_dim, hd, L.k_norm.get(), k_new, n, hp.n_head_kv, hd, eps);
    cuda::rope_neox(k_new, n, hp.n_head_kv, kv_dim, hd, hp.n_rot, n_past_, hp.rope_freq_base);
    const float* gate = L.q_has_gate ? qg_.get() + hd : nullptr;
    cuda::attention(attention_shape(), q_.get(), L.k_cache.get(), L.v_cache.get(), n, n_past_, gate, q_rows,
                    q_stride, attn_.get(), attn_scratch_.get(), static_cast<int64_t>(attn_scratch_.size()));
    matmul(L.o, attn_.get(), n, y_.get());
    cuda::residual_add(x_.get(), y_.get(), n * hp.n_embd);
  }

  const model::Model& m_;
  const int device_;
  const int64_t max_tokens_, max_context_;
  int64_t n_past_ = 0;
  std::vector<DevLayer> layers_;
  DeviceBuffer<float> output_norm_;
  DevMatrix output_;
  DeviceBuffer<uint8_t> tok_embd_;  // empty when embed falls back to the host dequantizer
  DeviceBuffer<float> x_, h_, y_, qg_, q_, attn_, attn_scratch_, router_logits_, weight_;
  DeviceBuffer<uint8_t> act_;
  DeviceBuffer<int32_t> chosen_, token_ids_, expert_ids_;
  DeviceBuffer<float> expert_in_, expert_g_, expert_u_, expert_out_, slot_rows_;
  DeviceBuffer<float> shared_g_, shared_u_, shared_out_, shared_logit_, logits_;
  DeviceBuffer<float> mixed_, z_, ba_, core_, delta_ws_;  // Gated DeltaNet scratch
  // Fused MoE (moe_fused.h): per layer whether it applies, the slot table, workspace, routing.
  std::vector<bool> fused_ok_;
  DeviceBuffer<cuda::MoeExpertSlot> fused_slots_;
  DeviceBuffer<uint8_t> fused_ws_;
  DeviceBuffer<int32_t> row_of_;
  std::vector<cuda::MoeExpertSlot> fused_table_;
  std::vector<int32_t> fused_chosen_;
  std::vector<float> host_in_, host_out_;
  std::vector<int32_t> host_ids_, host_rows_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const model::Model& m, int device, int max_tokens, int64_t max_context) {
  return std::make_unique<CudaBackend>(m, device, max_tokens, max_context);
}

}  // namespace moraine::gpu_worker
