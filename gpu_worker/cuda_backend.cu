// The CUDA backend (see cuda_backend.h).
#include "gpu_worker/cuda_backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <iostream>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_decode.h"
#include "kernels/cuda/attention_prefill.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/delta_net.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/embed_rows.h"
#include "kernels/cuda/gemm_prefill.h"
#include "kernels/cuda/host_handoff.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/matvec_float.h"
#include "kernels/cuda/moe_combine.h"
#include "kernels/cuda/moe_fused.h"
#include "kernels/cuda/qk_norm_rope_store.h"
#include "kernels/cuda/quantize_activations_llama.h"
#include "kernels/cuda/residual_add.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/cuda/router.h"
#include "kernels/cuda/row_gather.h"
#include "kernels/cuda/swiglu.h"

namespace moraine::gpu_worker {

namespace {

using cuda::DeviceBuffer;
using cuda::PinnedBuffer;

// Steps of at most this many rows take the graph-safe decode kernels (attention_at) and may be
// replayed from a captured graph; it is also moe_fused's token limit.
constexpr int64_t kDecodeRows = cuda::kAttentionAtMaxRows;

// A weight matrix (or a set of experts' matrices of one kind) in device memory, in its file
// format: matrix i at bytes + i * matrix_bytes.
struct DevMatrix {
  TensorType type = TensorType::F32;
  int64_t rows = 0;         // rows of one matrix
  int64_t cols = 0;
  size_t matrix_bytes = 0;  // the stride between matrices (experts)
  DeviceBuffer<uint8_t> bytes;
  explicit operator bool() const { return rows > 0; }
  const uint8_t* matrix(int64_t i) const { return bytes.get() + static_cast<size_t>(i) * matrix_bytes; }
};

bool has_kernel(TensorType t) { return cuda::matvec_supported(t) || cuda::matvec_float_supported(t); }

void check_kernel(const model::Matrix& m) {
  if (has_kernel(m.type)) return;
  const std::string name = m.info != nullptr ? m.info->name : std::string("(unnamed)");
  throw std::runtime_error("CUDA backend: tensor " + name + " is " + std::string(type_name(m.type)) +
                           ", which has no CUDA matvec kernel (kernels/cuda/matvec.h and matvec_float.h list "
                           "the formats); requantize it with moraine-quantize");
}

DevMatrix upload_matrix(const model::Matrix& m) {
  DevMatrix d;
  if (!m) return d;
  check_kernel(m);
  d.type = m.type;
  d.rows = m.n_rows;
  d.cols = m.n_cols;
  d.matrix_bytes = m.row_bytes * static_cast<size_t>(m.n_rows);
  d.bytes = DeviceBuffer<uint8_t>(d.matrix_bytes);
  d.bytes.upload(m.data, d.matrix_bytes);
  return d;
}

// The experts `ids` of one expert tensor packed in a slab. The stride between experts is a whole
// number of format blocks (the batched matvec steps through the slab in blocks) and of 16 bytes
// (moe_fused and the matvec read aligned 16-byte words from each expert's start).
DevMatrix upload_expert_slab(const model::ExpertTensor& t, const std::vector<int32_t>& ids) {
  DevMatrix d;
  if (!t.all || ids.empty()) return d;
  check_kernel(t.all);
  d.type = t.all.type;
  d.rows = t.rows_per_expert;
  d.cols = t.all.n_cols;
  const size_t one = t.all.row_bytes * static_cast<size_t>(t.rows_per_expert);
  const size_t block = type_traits(d.type).block_bytes;
  const size_t unit = block / std::gcd(block, size_t{16}) * 16;   // lcm(block bytes, 16)
  d.matrix_bytes = (one + unit - 1) / unit * unit;
  d.bytes = DeviceBuffer<uint8_t>(d.matrix_bytes * ids.size());
  for (size_t i = 0; i < ids.size(); ++i)
    CUDA_CHECK(cudaMemcpy(d.bytes.get() + i * d.matrix_bytes, t.all.data + static_cast<size_t>(ids[i]) * one, one,
                          cudaMemcpyHostToDevice));
  return d;
}

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

// q, k and v stacked into one matrix (rows q | k | v) when they share a format and a width: one
// activation quantization and one matvec launch instead of three, each output row the same bits
// (a row's dot does not depend on its neighbours). Empty when they differ (per-tensor formats).
DevMatrix upload_stacked(const std::vector<const model::Matrix*>& parts) {
  DevMatrix d;
  for (const model::Matrix* m : parts)
    if (!*m || m->type != parts[0]->type || m->n_cols != parts[0]->n_cols) return d;
  check_kernel(*parts[0]);
  d.type = parts[0]->type;
  d.cols = parts[0]->n_cols;
  for (const model::Matrix* m : parts) d.rows += m->n_rows;
  d.matrix_bytes = parts[0]->row_bytes * static_cast<size_t>(d.rows);
  d.bytes = DeviceBuffer<uint8_t>(d.matrix_bytes);
  size_t at = 0;
  for (const model::Matrix* m : parts) {
    const size_t bytes = m->row_bytes * static_cast<size_t>(m->n_rows);
    CUDA_CHECK(cudaMemcpy(d.bytes.get() + at, m->data, bytes, cudaMemcpyHostToDevice));
    at += bytes;
  }
  return d;
}

DeviceBuffer<float> upload_vector(const std::vector<float>& v) {
  DeviceBuffer<float> d(v.size());
  if (!v.empty()) d.upload(v.data(), v.size());
  return d;
}

struct DevLayer {
  bool recurrent = false;
  DeviceBuffer<float> attn_norm, ffn_norm, q_norm, k_norm, shared_router;
  DevMatrix q, k, v, o, router, shared_gate, shared_up, shared_down;
  DevMatrix attn_qkv;     // q | k | v stacked (upload_stacked); then q, k, v stay empty
  int64_t q_rows = 0;     // rows of the q projection (with the gate beside each head, if any)
  // The VRAM tier: resident experts' gate / up / down slabs and expert id -> slab index (-1).
  DevMatrix gate, up, down;
  std::vector<int32_t> slab_of;
  int64_t resident = 0;
  bool fused = false;   // the routed experts go through moe_fused
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

// A captured step (step_whole) for one token count, and the host memory its copies touch.
struct StepGraph {
  cudaGraphExec_t exec = nullptr;
  StepGraph() = default;
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;
  ~StepGraph() { reset(); }
  void reset() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    exec = nullptr;
  }
};

// A mixed layer's first half (layer_begin) for one token count, captured: the mixer, the router
// and the routing's copies to the host (into the addresses it was captured with), then the
// device's experts and the shared expert, which run while the host plans and the cpu workers
// work. Two launches instead of ~25 per layer: the host, not the GPU, bounded these layers
// (3-5 us per kernel launch).
// A whole step with in-graph hand-offs (handoff_begin) for one (rows, logit rows), the host
// addresses it was captured with, and which layers it runs whole (the rest hand off).
struct HandoffGraph {
  StepGraph step;
  Backend::HandoffIo io;
  std::vector<char> whole;
};

struct LayerBeginGraphs {
  StepGraph route, experts;
  const void *chosen = nullptr, *weight = nullptr, *h_out = nullptr;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(const model::Model& m, const BackendOptions& o)
      : m_(m), device_(o.device), max_tokens_(o.max_tokens), tiled_prefill_rows_(o.tiled_prefill_rows),
        gemm_prefill_rows_(o.gemm_prefill_rows),
        max_context_(o.max_context > 0 ? o.max_context : std::max<int64_t>(kDefaultContext, o.max_tokens)) {
    const model::HParams& hp = m.hp;
    std::string why;
    if (!cuda::device_available(&why)) throw std::runtime_error("--backend cuda: no CUDA device: " + why);
    CUDA_CHECK(cudaSetDevice(device_));
    if (max_tokens_ <= 0 || max_tokens_ > 65535 || max_context_ < max_tokens_ || max_context_ > INT32_MAX)
      throw std::runtime_error("CUDA backend: max_tokens " + std::to_string(max_tokens_) + " must be in 1..65535 and "
                               "at most the context (" + std::to_string(max_context_) + ")");
    if (!o.all_experts && static_cast<int64_t>(o.device_experts.size()) != hp.n_layer)
      throw std::invalid_argument("CUDA backend: device_experts names " + std::to_string(o.device_experts.size()) +
                                  " layers, the model has " + std::to_string(hp.n_layer));
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
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&routed_, cudaEventDisableTiming));
    const int64_t d = hp.n_embd, k = hp.n_expert_used, hd = hp.head_dim;
    const int64_t kv_dim = hp.n_head_kv * hd;
    int64_t q_rows = hp.n_head * hd;
    const int64_t max_cols = std::max({d, hp.n_head * hd, hp.n_ff_exp, hp.n_ff_shexp, hp.ssm_value_dim()});

    std::vector<int32_t> all(static_cast<size_t>(hp.n_expert));
    for (int64_t e = 0; e < hp.n_expert; ++e) all[e] = static_cast<int32_t>(e);
    std::vector<cuda::MoeExpertSlot> table(static_cast<size_t>(hp.n_layer * slot_stride()));
    layers_.resize(static_cast<size_t>(hp.n_layer));
    for (int64_t il = 0; il < hp.n_layer; ++il) {
      const model::LayerWeights& L = m.layers[il];
      DevLayer& D = layers_[il];
      D.attn_norm = upload_vector(L.attn_norm);
      D.ffn_norm = upload_vector(L.ffn_norm);
      D.router = upload_matrix(L.moe.router);
      const std::vector<int32_t>& ids = o.all_experts ? all : o.device_experts[il];
      D.slab_of.assign(static_cast<size_t>(hp.n_expert), -1);
      for (size_t i = 0; i < ids.size(); ++i) {
        if (ids[i] < 0 || ids[i] >= hp.n_expert || (i > 0 && ids[i] <= ids[i - 1]))
          throw std::invalid_argument("CUDA backend: layer " + std::to_string(il) + "'s device experts must be "
                                      "ascending ids in [0, " + std::to_string(hp.n_expert) + ")");
        D.slab_of[ids[i]] = static_cast<int32_t>(i);
      }
      D.resident = static_cast<int64_t>(ids.size());
      D.gate = upload_expert_slab(L.moe.gate, ids);
      D.up = upload_expert_slab(L.moe.up, ids);
      D.down = upload_expert_slab(L.moe.down, ids);
      for (size_t i = 0; i < ids.size(); ++i)
        table[il * slot_stride() + ids[i]] = {D.gate.matrix(i), D.up.matrix(i), D.down.matrix(i)};
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
      D.attn_qkv = upload_stacked({&L.attn.q, &L.attn.k, &L.attn.v});
      if (!D.attn_qkv) {
        D.q = upload_matrix(L.attn.q);
        D.k = upload_matrix(L.attn.k);
        D.v = upload_matrix(L.attn.v);
      }
      D.q_rows = L.attn.q.n_rows;
      D.o = upload_matrix(L.attn.o);
      D.q_has_gate = L.attn.q_has_gate;
      q_rows = std::max(q_rows, L.attn.q.n_rows + 2 * kv_dim);   // the stacked q | k | v output
      D.k_cache = DeviceBuffer<float>(static_cast<size_t>(max_context_ * kv_dim));
      D.v_cache = DeviceBuffer<float>(static_cast<size_t>(max_context_ * kv_dim));
    }
    slot_table_ = DeviceBuffer<cuda::MoeExpertSlot>(table.size());
    slot_table_.upload(table.data(), table.size());
    output_norm_ = upload_vector(m.output_norm);
    output_ = upload_matrix(m.output);
    if (cuda::embed_rows_supported(m.tok_embd.type)) {
      tok_embd_ = DeviceBuffer<uint8_t>(m.tok_embd.row_bytes * static_cast<size_t>(m.tok_embd.n_rows));
      tok_embd_.upload(m.tok_embd.data, tok_embd_.size());
    }

    const size_t T = static_cast<size_t>(max_tokens_);
    const size_t slots = T * static_cast<size_t>(k);
    x_ = DeviceBuffer<float>(T * d);
    h_ = DeviceBuffer<float>(T * d);
    y_ = DeviceBuffer<float>(T * d);
    qg_ = DeviceBuffer<float>(T * q_rows);
    q_ = DeviceBuffer<float>(T * hp.n_head * hd);
    k_new_ = DeviceBuffer<float>(T * kv_dim);
    v_new_ = DeviceBuffer<float>(T * kv_dim);
    attn_ = DeviceBuffer<float>(T * hp.n_head * hd);
    const cuda::AttentionShape shape = attention_shape();
    // Split-KV records for 16 rows at a time (longer steps between 16 and the tiled prefill go
    // through in passes): enough to fill the GPU, about 34 MB at 32K context for 32 heads of 128.
    const int64_t rows16 = std::min<int64_t>(max_tokens_, kDecodeRows);
    attn_scratch_ = DeviceBuffer<float>(static_cast<size_t>(
        std::max({cuda::attention_scratch_floats(shape, rows16, max_context_),
                  cuda::attention_at_scratch_floats(shape, rows16, max_context_),
                  cuda::attention_decode_scratch_floats(shape, rows16, max_context_)})));
    // Activation bytes for the widest row of any matrix, for every expert row of a step; a
    // quantized row never takes more bytes than the floats it came from.
    act_ = DeviceBuffer<uint8_t>(slots * static_cast<size_t>(max_cols) * sizeof(float));
    router_logits_ = DeviceBuffer<float>(T * hp.n_expert);
    chosen_ = DeviceBuffer<int32_t>(static_cast<size_t>(hp.n_layer) * slots);
    weight_ = DeviceBuffer<float>(slots);
    token_ids_ = DeviceBuffer<int32_t>(T);
    pos_dev_ = DeviceBuffer<int32_t>(1);
    dev_slots_ = DeviceBuffer<float>(slots * d);
    cpu_rows_ = DeviceBuffer<float>(slots * d);
    alt_row_ = DeviceBuffer<int32_t>(slots);
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
      delta_ws_ = DeviceBuffer<float>(static_cast<size_t>(cuda::delta_net_workspace_floats(ds, max_tokens_)));
    }
    tok_pinned_ = PinnedBuffer<int32_t>(T);
    pos_pinned_ = PinnedBuffer<int32_t>(1);
    alt_pinned_ = PinnedBuffer<int32_t>(slots);
    idx_pinned_ = PinnedBuffer<int32_t>(3 * slots);
    chosen_pinned_ = PinnedBuffer<int32_t>(static_cast<size_t>(hp.n_layer) * slots);
    handoff_flags_ = PinnedBuffer<uint64_t>(static_cast<size_t>(2 * hp.n_layer));
    std::fill_n(handoff_flags_.get(), 2 * hp.n_layer, uint64_t{0});
    CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&handoff_flags_dev_), handoff_flags_.get(), 0));
    handoff_seq_pinned_ = PinnedBuffer<uint64_t>(1);
    handoff_seq_dev_ = DeviceBuffer<uint64_t>(1);
    handoff_error_ = DeviceBuffer<int32_t>(1);
    CUDA_CHECK(cudaMemsetAsync(handoff_error_.get(), 0, sizeof(int32_t), stream_));
    setup_experts();
    setup_swaps(o.all_experts);
    zero_states();
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  ~CudaBackend() override {
    cudaSetDevice(device_);
    graphs_.clear();
    begin_graphs_.clear();
    handoff_graphs_.clear();
    if (copy_stream_ != nullptr) cudaStreamSynchronize(copy_stream_);
    for (PendingSwap& p : swaps_)
      if (p.landed != nullptr) cudaEventDestroy(p.landed);
    swaps_.clear();
    if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
    for (void* p : pinned_) cudaHostUnregister(p);
    if (routed_ != nullptr) cudaEventDestroy(routed_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  void pin_host_memory(void* p, size_t bytes) override {
    use_device();
    const cudaError_t err = cudaHostRegister(p, bytes, cudaHostRegisterDefault);
    if (err == cudaSuccess) {
      pinned_.push_back(p);
      pinned_ranges_.emplace_back(static_cast<const char*>(p), bytes);
      return;
    }
    cudaGetLastError();  // not sticky; copies from pageable memory still work, only slower
    std::cerr << "CUDA backend: cannot pin " << bytes << " bytes of host memory (" << cudaGetErrorString(err)
              << "); host copies will be staged\n";
  }

  void reset() override {
    use_device();
    zero_states();
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    n_past_ = 0;
  }
  int64_t n_past() const override { return n_past_; }
  int64_t n_layer() const override { return m_.hp.n_layer; }
  bool layer_on_device(int64_t il) const override {
    check_layer(il);
    return layers_[il].resident == m_.hp.n_expert;
  }

  void embed(const int32_t* tokens, int64_t n) override {
    use_device();
    begin_step(tokens, n);
    enqueue_embed(n);
  }

  void layer_whole(int64_t il, int64_t n, int32_t* chosen_out) override {
    use_device();
    check_step(il, n);
    if (!layer_on_device(il))
      throw std::logic_error("CUDA backend: layer_whole(" + std::to_string(il) + ") but only " +
                             std::to_string(layers_[il].resident) + " of its experts are on the device");
    if (!layers_[il].fused || gemm_experts(layers_[il], n)) {  // the per-expert path needs the host's plan
      layer_begin(il, n, host_chosen_.data(), host_weight_.data(), nullptr);
      if (chosen_out != nullptr) std::copy_n(host_chosen_.data(), n * m_.hp.n_expert_used, chosen_out);
      host_plan_.build(host_chosen_.data(), n * m_.hp.n_expert_used, m_.hp.n_expert);
      layer_end(il, n, host_plan_, nullptr);
      return;
    }
    enqueue_layer_whole(il, n, true);
    if (chosen_out != nullptr)
      pending_chosen_.push_back({chosen_pinned_.get() + il * n * m_.hp.n_expert_used, chosen_out, n * m_.hp.n_expert_used});
  }

  void layer_begin(int64_t il, int64_t n, int32_t* chosen, float* weight, float* h_out) override {
    use_device();
    check_step(il, n);
    const auto route = [&] {
      const int64_t d = m_.hp.n_embd, nk = n * m_.hp.n_expert_used;
      enqueue_mixer(il, n);
      enqueue_route(il, n);
      copy_to_host(chosen, chosen_of(il, n), nk * sizeof(int32_t));
      copy_to_host(weight, weight_.get(), nk * sizeof(float));
      if (h_out != nullptr) copy_to_host(h_out, h_.get(), n * d * sizeof(float));
    };
    // The resident experts and the shared expert run while the host plans and the cpu workers work.
    const auto experts = [&] {
      if (layers_[il].fused && !gemm_experts(layers_[il], n)) enqueue_fused_experts(il, n);
      enqueue_shared(il, n);
    };
    const int64_t nk = n * m_.hp.n_expert_used;
    // Captured copies need page-locked host memory (a pageable one would fail the capture).
    const bool host_pinned = pinned(chosen, nk * sizeof(int32_t)) && pinned(weight, nk * sizeof(float)) &&
                             (h_out == nullptr || pinned(h_out, n * m_.hp.n_embd * sizeof(float)));
    if (layer_graphs_ok_ && host_pinned && n <= kDecodeRows) {
      LayerBeginGraphs& g = begin_graphs_[{il, n}];
      if (g.route.exec == nullptr || g.chosen != chosen || g.weight != weight || g.h_out != h_out) {
        g.route.reset();
        g.experts.reset();
        g.chosen = chosen;
        g.weight = weight;
        g.h_out = h_out;
        layer_graphs_ok_ = capture_into(g.route, route) && capture_into(g.experts, experts);
      }
      if (layer_graphs_ok_) {
        CUDA_CHECK(cudaGraphLaunch(g.route.exec, stream_));
        CUDA_CHECK(cudaEventRecord(routed_, stream_));
        CUDA_CHECK(cudaGraphLaunch(g.experts.exec, stream_));
        CUDA_CHECK(cudaEventSynchronize(routed_));
        return;
      }
      begin_graphs_.clear();
    }
    route();
    CUDA_CHECK(cudaEventRecord(routed_, stream_));
    experts();
    CUDA_CHECK(cudaEventSynchronize(routed_));
  }

  void layer_end(int64_t il, int64_t n, const group::ExpertPlan& plan, const float* host_rows) override {
    use_device();
    check_step(il, n);
    const DevLayer& L = layers_[il];
    const int64_t d = m_.hp.n_embd, k = m_.hp.n_expert_used, nk = n * k;
    if (static_cast<int64_t>(plan.start.size()) != m_.hp.n_expert + 1 || plan.start.back() != nk)
      throw std::invalid_argument("layer_end: the plan covers " +
                                  std::to_string(plan.start.empty() ? 0 : plan.start.back()) + " slots, the step has " +
                                  std::to_string(nk));
    if (!L.fused || gemm_experts(L, n)) enqueue_matvec_experts(il, n, plan);
    const auto [lo, hi] = fill_alt_rows(il, plan);
    if (hi < 0) {
      enqueue_combine(il, n, false);
      return;
    }
    if (host_rows == nullptr)
      throw std::logic_error("CUDA backend: layer " + std::to_string(il) + " has slots off the device and no host rows");
    CUDA_CHECK(cudaMemcpyAsync(cpu_rows_.get() + int64_t{lo} * d, host_rows + int64_t{lo} * d,
                               static_cast<size_t>(hi - lo) * d * sizeof(float), cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaMemcpyAsync(alt_row_.get(), alt_pinned_.get(), static_cast<size_t>(nk) * sizeof(int32_t), cudaMemcpyHostToDevice,
                               stream_));
    enqueue_combine(il, n, true);
  }

  void advance(int64_t n) override { n_past_ += n; }

  void logits(int64_t rows, float* out) override {
    use_device();
    if (rows <= 0 || rows > step_n_)
      throw std::invalid_argument("CUDA backend logits: " + std::to_string(rows) + " rows of a step of " +
                                  std::to_string(step_n_));
    enqueue_logits(rows);
    finish_step(rows, out);
  }

  bool begin_swap(int64_t il, int32_t out, int32_t in) override {
    use_device();
    check_layer(il);
    DevLayer& L = layers_[il];
    const int64_t E = m_.hp.n_expert;
    if (out < 0 || out >= E || in < 0 || in >= E || L.slab_of[out] < 0 || L.slab_of[in] >= 0) return false;
    PendingSwap* free_swap = nullptr;
    for (PendingSwap& p : swaps_)
      if (!p.busy) free_swap = &p;
    if (free_swap == nullptr) return false;
    // Between steps stream_ is idle: once `out`'s table entry is null no kernel reads its slab,
    // and the copy stream can overwrite it while the next steps run.
    const int32_t slab = L.slab_of[out];
    L.slab_of[out] = -1;
    --L.resident;
    set_table_entry(il, out, {});
    const model::MoeWeights& W = m_.layers[il].moe;
    uint8_t* staging = free_swap->staging.get();
    size_t at = 0;
    for (const auto& [t, d] : {std::pair{&W.gate, &L.gate}, std::pair{&W.up, &L.up}, std::pair{&W.down, &L.down}}) {
      const size_t one = t->all.row_bytes * static_cast<size_t>(t->rows_per_expert);
      std::memcpy(staging + at, t->all.data + static_cast<size_t>(in) * one, one);
      CUDA_CHECK(cudaMemcpyAsync(d->bytes.get() + static_cast<size_t>(slab) * d->matrix_bytes, staging + at, one,
                                 cudaMemcpyHostToDevice, copy_stream_));
      at += one;
    }
    CUDA_CHECK(cudaEventRecord(free_swap->landed, copy_stream_));
    free_swap->busy = true;
    free_swap->il = il;
    free_swap->in = in;
    free_swap->slab = slab;
    return true;
  }

  std::vector<std::pair<int64_t, int32_t>> landed_swaps() override {
    use_device();
    std::vector<std::pair<int64_t, int32_t>> done;
    for (PendingSwap& p : swaps_) {
      if (!p.busy) continue;
      const cudaError_t q = cudaEventQuery(p.landed);
      if (q == cudaErrorNotReady) continue;
      CUDA_CHECK(q);
      DevLayer& L = layers_[p.il];
      L.slab_of[p.in] = p.slab;
      ++L.resident;
      set_table_entry(p.il, p.in, {L.gate.matrix(p.slab), L.up.matrix(p.slab), L.down.matrix(p.slab)});
      p.busy = false;
      done.emplace_back(p.il, p.in);
    }
    return done;
  }

  void step_whole(const int32_t* tokens, int64_t n, int64_t logit_rows, float* logits_out, int32_t* chosen_out,
                  int64_t chosen_stride) override {
    use_device();
    if (!graphs_ok_ || n > kDecodeRows || !all_on_device()) {
      Backend::step_whole(tokens, n, logit_rows, logits_out, chosen_out, chosen_stride);
      return;
    }
    if (logit_rows <= 0 || logit_rows > n)
      throw std::invalid_argument("CUDA backend: logits of " + std::to_string(logit_rows) + " rows of a step of " +
                                  std::to_string(n));
    begin_step(tokens, n);
    StepGraph& g = graphs_[{n, logit_rows}];
    if (g.exec == nullptr && !capture(g, n, logit_rows)) {
      Backend::step_whole(tokens, n, logit_rows, logits_out, chosen_out, chosen_stride);
      return;
    }
    CUDA_CHECK(cudaGraphLaunch(g.exec, stream_));
    n_past_ += n;
    if (chosen_out != nullptr)
      for (int64_t il = 0; il < m_.hp.n_layer; ++il)
        pending_chosen_.push_back({chosen_pinned_.get() + il * n * m_.hp.n_expert_used, chosen_out + il * chosen_stride,
                                   n * m_.hp.n_expert_used});
    finish_step(logit_rows, logits_out);
  }

  // ---- the in-graph hand-off (backend.h) ----

  bool handoff_supported(int64_t n) const override {
    return handoff_ok_ && embed_on_device() && n <= kDecodeRows && !all_on_device();
  }

  bool handoff_begin(const int32_t* tokens, int64_t n, int64_t logit_rows, const HandoffIo& io) override {
    use_device();
    if (!handoff_supported(n))
      throw std::logic_error("CUDA backend: handoff_begin for a step of " + std::to_string(n) + " rows it cannot hand off");
    if (logit_rows <= 0 || logit_rows > n)
      throw std::invalid_argument("CUDA backend: logits of " + std::to_string(logit_rows) + " rows of a step of " +
                                  std::to_string(n));
    const model::HParams& hp = m_.hp;
    const int64_t nk = n * hp.n_expert_used;
    const std::pair<const void*, size_t> ranges[] = {{io.chosen, nk * sizeof(int32_t)}, {io.weight, nk * sizeof(float)},
                                                     {io.h, n * hp.n_embd * sizeof(float)},
                                                     {io.host_rows, nk * hp.n_embd * sizeof(float)}};
    for (const auto& [p, bytes] : ranges)
      if (!pinned(p, bytes))
        throw std::invalid_argument("CUDA backend: handoff_begin's host buffers must lie in memory given to pin_host_memory");
    begin_step(tokens, n);
    std::vector<char>& whole = handoff_whole_;   // reused: no allocation per step
    whole.resize(static_cast<size_t>(hp.n_layer));
    for (int64_t il = 0; il < hp.n_layer; ++il) whole[il] = layer_on_device(il) ? 1 : 0;
    HandoffGraph& g = handoff_graphs_[{n, logit_rows}];
    if (g.step.exec == nullptr || g.whole != whole || g.io.chosen != io.chosen || g.io.weight != io.weight ||
        g.io.h != io.h || g.io.host_rows != io.host_rows) {
      g.step.reset();
      g.io = io;
      g.whole = whole;
      if (!capture_into(g.step, [&] { enqueue_handoff_step(n, logit_rows, io, whole); })) {
        handoff_ok_ = false;   // from now on steps hand off layer by layer
        handoff_graphs_.clear();
        return false;
      }
    }
    handoff_seq_pinned_[0] = ++handoff_seq_;
    handoff_rows_ = logit_rows;
    CUDA_CHECK(cudaGraphLaunch(g.step.exec, stream_));
    return true;
  }

  void handoff_wait_routed(int64_t il) override {
    check_layer(il);
    const uint64_t* flag = handoff_flags_.get() + il;
    const auto start = std::chrono::steady_clock::now();
    for (uint64_t spins = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) < handoff_seq_; ++spins) {
      _mm_pause();
      if (spins % 4096 != 0) continue;
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q != cudaErrorNotReady && q != cudaSuccess) CUDA_CHECK(q);
      if (q == cudaSuccess && __atomic_load_n(flag, __ATOMIC_ACQUIRE) < handoff_seq_)
        throw std::logic_error("CUDA backend: the step finished without handing off layer " + std::to_string(il));
      if (std::chrono::steady_clock::now() - start > kHandoffTimeout)
        throw std::runtime_error("CUDA backend: layer " + std::to_string(il) + "'s routing did not arrive within " +
                                 std::to_string(kHandoffTimeout.count()) + " s");
    }
  }

  void handoff_release(int64_t il, const group::ExpertPlan& plan) override {
    check_layer(il);
    const int64_t nk = step_n_ * m_.hp.n_expert_used;
    if (static_cast<int64_t>(plan.start.size()) != m_.hp.n_expert + 1 || plan.start.back() != nk)
      throw std::invalid_argument("handoff_release: the plan covers " +
                                  std::to_string(plan.start.empty() ? 0 : plan.start.back()) + " slots, the step has " +
                                  std::to_string(nk));
    fill_alt_rows(il, plan);   // read by the graph's copy once the flag is up
    __atomic_store_n(handoff_flags_.get() + m_.hp.n_layer + il, handoff_seq_, __ATOMIC_RELEASE);
  }

  void handoff_finish(float* logits_out, int32_t* chosen_out, int64_t chosen_stride) override {
    use_device();
    n_past_ += step_n_;
    if (chosen_out != nullptr)
      for (int64_t il = 0; il < m_.hp.n_layer; ++il)
        pending_chosen_.push_back({chosen_pinned_.get() + il * step_n_ * m_.hp.n_expert_used,
                                   chosen_out + il * chosen_stride, step_n_ * m_.hp.n_expert_used});
    finish_step(handoff_rows_, logits_out);
    check_handoff_error();
  }

  void handoff_abort() override {
    use_device();
    for (int64_t il = 0; il < m_.hp.n_layer; ++il)
      __atomic_store_n(handoff_flags_.get() + m_.hp.n_layer + il, handoff_seq_, __ATOMIC_RELEASE);
    cudaStreamSynchronize(stream_);
    cudaGetLastError();
    pending_chosen_.clear();
  }

 private:
  static constexpr std::chrono::seconds kHandoffTimeout{60};

  bool embed_on_device() const { return tok_embd_.size() != 0; }

  bool pinned(const void* p, size_t bytes) const {
    const char* c = static_cast<const char*>(p);
    for (const auto& [base, size] : pinned_ranges_)
      if (c >= base && c + bytes <= base + size) return true;
    return false;
  }

  void check_handoff_error() {
    int32_t err = 0;
    CUDA_CHECK(cudaMemcpy(&err, handoff_error_.get(), sizeof err, cudaMemcpyDeviceToHost));
    if (err == 0) return;
    CUDA_CHECK(cudaMemset(handoff_error_.get(), 0, sizeof err));
    throw std::runtime_error("CUDA backend: the device waited " + std::to_string(kHandoffTimeout.count() * 2) +
                             " s for the host's expert rows and gave up; this step's results are void");
  }

  // Slots whose expert is off the device read row alt[slot] of the cpu workers' rows (plan
  // order); -1 for the device's own. The rows' span [lo, hi), empty (hi < 0) when none.
  std::pair<int32_t, int32_t> fill_alt_rows(int64_t il, const group::ExpertPlan& plan) {
    const DevLayer& L = layers_[il];
    const int64_t nk = step_n_ * m_.hp.n_expert_used;
    int32_t* alt = alt_pinned_.get();
    std::fill(alt, alt + nk, -1);
    int32_t lo = INT32_MAX, hi = -1;
    for (int64_t e = 0; e < m_.hp.n_expert; ++e) {
      if (plan.count(e) == 0 || L.slab_of[e] >= 0) continue;
      for (int32_t r = plan.start[e]; r < plan.start[e + 1]; ++r) {
        const int32_t slot = plan.slot_of[r];
        if (slot < 0 || slot >= nk)
          throw std::invalid_argument("layer " + std::to_string(il) + ": the plan names slot " + std::to_string(slot) +
                                      " outside the step's " + std::to_string(nk));
        alt[slot] = r;
      }
      lo = std::min(lo, plan.start[e]);
      hi = std::max(hi, plan.start[e + 1]);
    }
    return {lo, hi};
  }

  // The captured hand-off step: layers run whole on the device or hand off through the flags.
  void enqueue_handoff_step(int64_t n, int64_t rows, const HandoffIo& io, const std::vector<char>& whole) {
    const model::HParams& hp = m_.hp;
    const int64_t d = hp.n_embd, nk = n * hp.n_expert_used;
    const uint64_t* seq = handoff_seq_dev_.get();
    uint64_t* routed = handoff_flags_dev_;
    uint64_t* ready = routed + hp.n_layer;
    CUDA_CHECK(cudaMemcpyAsync(handoff_seq_dev_.get(), handoff_seq_pinned_.get(), sizeof(uint64_t),
                               cudaMemcpyHostToDevice, stream_));
    enqueue_embed(n);
    for (int64_t il = 0; il < hp.n_layer; ++il) {
      if (whole[il]) {
        enqueue_layer_whole(il, n, false);
        continue;
      }
      enqueue_mixer(il, n);
      enqueue_route(il, n);
      copy_to_host(io.chosen, chosen_of(il, n), nk * sizeof(int32_t));
      copy_to_host(io.weight, weight_.get(), nk * sizeof(float));
      copy_to_host(io.h, h_.get(), n * d * sizeof(float));
      cuda::signal_host(routed + il, seq, stream_);
      if (layers_[il].fused) enqueue_fused_experts(il, n);
      enqueue_shared(il, n);
      cuda::wait_host(ready + il, seq, static_cast<uint64_t>(kHandoffTimeout.count()) * 2'000'000'000ull,
                      handoff_error_.get(), stream_);
      // Every slot's row and the whole map: the sizes of a captured copy are fixed (n * k rows of
      // n_embd floats: 64 KB per token over PCIe, ~1-2 us).
      CUDA_CHECK(cudaMemcpyAsync(cpu_rows_.get(), io.host_rows, static_cast<size_t>(nk * d) * sizeof(float),
                                 cudaMemcpyHostToDevice, stream_));
      CUDA_CHECK(cudaMemcpyAsync(alt_row_.get(), alt_pinned_.get(), static_cast<size_t>(nk) * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, stream_));
      enqueue_combine(il, n, true);
    }
    copy_to_host(chosen_pinned_.get(), chosen_.get(), static_cast<size_t>(hp.n_layer * nk) * sizeof(int32_t));
    enqueue_logits(rows);
  }

  struct PendingChosen {
    const int32_t* from;   // pinned
    int32_t* to;
    int64_t count;
  };

  // Entries per layer in the (layer, expert) slot table: an even count keeps every layer's slice
  // 16-byte aligned (entries are 24 bytes), as moe_fused requires; with an odd expert count
  // (the 3-expert golden models) every other layer used to fall back to the matvec path.
  int64_t slot_stride() const { return (m_.hp.n_expert + 1) / 2 * 2; }

  // Layer il's routing of a step of n rows: the layers' routings lie back to back, so a captured
  // step copies all of them to the host in one transfer at its end.
  int32_t* chosen_of(int64_t il, int64_t n) const { return chosen_.get() + il * n * m_.hp.n_expert_used; }

  // Expert copies of the adaptive VRAM tier (begin_swap): a copy stream, and per pending swap a
  // pinned staging buffer the size of the largest expert (sized once, only when some experts
  // are off the device).
  static constexpr int kMaxPendingSwaps = 8;
  struct PendingSwap {
    bool busy = false;
    int64_t il = 0;
    int32_t in = -1, slab = -1;
    cudaEvent_t landed = nullptr;
    PinnedBuffer<uint8_t> staging;
  };
  void setup_swaps(bool all_experts) {
    if (all_experts) return;
    size_t largest = 0;
    for (const model::LayerWeights& L : m_.layers) {
      size_t one = 0;
      for (const model::ExpertTensor* t : {&L.moe.gate, &L.moe.up, &L.moe.down})
        if (t->all) one += t->all.row_bytes * static_cast<size_t>(t->rows_per_expert);
      largest = std::max(largest, one);
    }
    if (largest == 0) return;
    CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
    swaps_.resize(kMaxPendingSwaps);
    for (PendingSwap& p : swaps_) {
      CUDA_CHECK(cudaEventCreateWithFlags(&p.landed, cudaEventDisableTiming));
      p.staging = PinnedBuffer<uint8_t>(largest);
    }
  }
  void set_table_entry(int64_t il, int32_t e, const cuda::MoeExpertSlot& v) {
    CUDA_CHECK(cudaMemcpy(slot_table_.get() + il * slot_stride() + e, &v, sizeof v, cudaMemcpyHostToDevice));
  }

  // Which layers' experts go through moe_fused, the expert-path scratch, and whether steps can
  // be captured as graphs (every layer fused, embedding on the device).
  void setup_experts() {
    const model::HParams& hp = m_.hp;
    const int64_t d = hp.n_embd, k = hp.n_expert_used;
    const size_t slots = static_cast<size_t>(max_tokens_ * k);
    size_t ws = 0;
    bool any_matvec = false;
    graphs_ok_ = tok_embd_.size() != 0;
    for (int64_t il = 0; il < hp.n_layer; ++il) {
      DevLayer& L = layers_[il];
      L.fused = false;
      if (L.resident > 0 && hp.n_expert_used <= cuda::kMoeMaxTopK && fused_formats(L)) {
        try {
          cuda::moe_fused_check(fused_weights(il));
          L.fused = true;
          ws = std::max(ws, cuda::moe_fused_workspace_bytes(fused_weights(il), cuda::kMoeMaxTokens, static_cast<int>(k)));
        } catch (const std::invalid_argument&) {
          // a shape the fused kernel does not take: the batched matvec path serves it
        }
      }
      any_matvec = any_matvec || (L.resident > 0 && !L.fused);
      graphs_ok_ = graphs_ok_ && L.fused && L.resident == hp.n_expert;
      // The hand-off step computes the device's experts of a layer with moe_fused only.
      handoff_ok_ = handoff_ok_ && (L.resident == 0 || L.fused);
    }
    if (ws > 0) {
      fused_ws_ = DeviceBuffer<uint8_t>(ws);
      cuda::moe_fused_workspace_init(fused_ws_.get(), ws, stream_);
    }
    // Long steps multiply quantized weights through cuBLAS (and run the resident experts per
    // expert, from the host's plan, instead of moe_fused's 16-token groups).
    if (gemm_prefill_rows_ > 0 && max_tokens_ >= gemm_prefill_rows_) {
      cuda::PrefillGemmLimits lim;
      lim.max_tokens = static_cast<int64_t>(slots);
      lim.max_cols = std::max({d, hp.n_head * hp.head_dim, hp.n_ff_exp, hp.n_ff_shexp, hp.ssm_value_dim()});
      lim.max_experts = static_cast<int>(hp.n_expert);
      gemm_ = std::make_unique<cuda::PrefillGemm>(stream_, lim);
      any_matvec = true;   // the per-expert path's gather / scatter buffers
    }
    if (any_matvec) {
      expert_in_ = DeviceBuffer<float>(slots * d);
      expert_g_ = DeviceBuffer<float>(slots * hp.n_ff_exp);
      expert_u_ = DeviceBuffer<float>(slots * hp.n_ff_exp);
      expert_out_ = DeviceBuffer<float>(slots * d);
      expert_idx_ = DeviceBuffer<int32_t>(3 * slots);
    }
    host_chosen_.resize(slots);
    host_weight_.resize(slots);
    host_plan_.reserve(hp.n_expert, static_cast<int64_t>(slots));
  }

  // moe_fused takes every quantized expert format the matvec takes; it quantizes x and h with
  // the reference executor's rules (Q8_0 with llama.cpp's x86 rule, as pack_activations), so Q8_0
  // experts are fused too (tests/cuda/moe_fused_test checks both against the reference).
  static bool fused_formats(const DevLayer& L) {
    for (const DevMatrix* w : {&L.gate, &L.up, &L.down})
      if (!cuda::matvec_supported(w->type)) return false;
    return true;
  }

  cuda::MoeLayerWeights fused_weights(int64_t il) const {
    const DevLayer& L = layers_[il];
    cuda::MoeLayerWeights w;
    w.gate_type = L.gate.type;
    w.up_type = L.up.type;
    w.down_type = L.down.type;
    w.n_embd = m_.hp.n_embd;
    w.n_ff = m_.hp.n_ff_exp;
    w.n_expert = m_.hp.n_expert;
    w.slots = slot_table_.get() + il * slot_stride();
    // dot_rows: 26.3 / 119.6 us per 30B-shape Q4_K layer at 1 / 8 tokens where the per-row
    // dots (kStaged) took 29.8 / 167.3 (moraine-kernel-bench cuda --moe-only, H200, 2026-11-29).
    w.dots = cuda::MoeLayerWeights::Dots::kRows;
    return w;
  }

  // ---- host side of a step ----

  void begin_step(const int32_t* tokens, int64_t n) {
    check_rows(n, "step");
    const model::HParams& hp = m_.hp;
    for (int64_t t = 0; t < n; ++t) {
      if (tokens[t] < 0 || tokens[t] >= hp.n_vocab)
        throw std::invalid_argument("token id " + std::to_string(tokens[t]) + " at position " +
                                    std::to_string(n_past_ + t) + " is outside the vocabulary [0, " +
                                    std::to_string(hp.n_vocab) + ")");
    }
    if (n_past_ + n > max_context_)
      throw std::runtime_error("CUDA backend: positions " + std::to_string(n_past_) + ".." +
                               std::to_string(n_past_ + n - 1) + " do not fit the KV cache of " +
                               std::to_string(max_context_) + " positions");
    std::copy_n(tokens, n, tok_pinned_.get());
    pos_pinned_[0] = static_cast<int32_t>(n_past_);
    step_n_ = n;
    pending_chosen_.clear();
  }

  void finish_step(int64_t rows, float* out) {
    copy_to_host(out, logits_.get(), static_cast<size_t>(rows * m_.hp.n_vocab) * sizeof(float));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (const PendingChosen& p : pending_chosen_) std::copy_n(p.from, p.count, p.to);
    pending_chosen_.clear();
  }

  void copy_to_host(void* dst, const void* src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  }

  bool capture(StepGraph& g, int64_t n, int64_t rows) {
    graphs_ok_ = capture_into(g, [&] {
      enqueue_embed(n);
      for (int64_t il = 0; il < m_.hp.n_layer; ++il) enqueue_layer_whole(il, n, false);
      copy_to_host(chosen_pinned_.get(), chosen_.get(), static_cast<size_t>(m_.hp.n_layer * n * m_.hp.n_expert_used) *
                                                            sizeof(int32_t));
      enqueue_logits(rows);
    });
    return graphs_ok_;
  }

  // What `enqueue` puts on stream_, captured into g. On failure (said once on stderr) g stays
  // empty and the caller runs without graphs from then on.
  template <class Enqueue>
  bool capture_into(StepGraph& g, const Enqueue& enqueue) {
    cudaGraph_t graph = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    std::string failed;
    try {
      enqueue();
    } catch (const std::exception& e) {
      failed = e.what();
    }
    const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
    if (failed.empty() && end != cudaSuccess) failed = std::string("cudaStreamEndCapture: ") + cudaGetErrorString(end);
    if (failed.empty()) {
      const cudaError_t inst = cudaGraphInstantiate(&g.exec, graph, 0);
      if (inst != cudaSuccess) failed = std::string("cudaGraphInstantiate: ") + cudaGetErrorString(inst);
    }
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (failed.empty()) return true;
    cudaGetLastError();
    g.exec = nullptr;
    std::cerr << "CUDA backend: capturing work as a graph failed (" << failed << "); it runs without graphs\n";
    return false;
  }

  // ---- what a step enqueues on stream_ (nothing here reads device data back or allocates, so
  // a short step's sequence can be captured as a graph) ----

  void enqueue_embed(int64_t n) {
    const model::HParams& hp = m_.hp;
    const int64_t d = hp.n_embd;
    CUDA_CHECK(cudaMemcpyAsync(pos_dev_.get(), pos_pinned_.get(), sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    if (tok_embd_.size() == 0) {  // a format without a device kernel: the scalar dequantizer
      std::vector<float> rows(static_cast<size_t>(n * d));
      for (int64_t t = 0; t < n; ++t) dequantize_row(m_.tok_embd.type, m_.tok_embd.row(tok_pinned_[t]), rows.data() + t * d, d);
      CUDA_CHECK(cudaMemcpyAsync(x_.get(), rows.data(), rows.size() * sizeof(float), cudaMemcpyHostToDevice, stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));  // `rows` is pageable and about to go
      return;
    }
    CUDA_CHECK(cudaMemcpyAsync(token_ids_.get(), tok_pinned_.get(), static_cast<size_t>(n) * sizeof(int32_t),
                               cudaMemcpyHostToDevice, stream_));
    cuda::embed_rows(m_.tok_embd.type, tok_embd_.get(), m_.tok_embd.row_bytes, d, token_ids_.get(), n, x_.get(),
                     stream_);
  }

  // copy_chosen: the layer's routing goes to chosen_pinned_ now (a captured step copies every
  // layer's at its end instead).
  void enqueue_layer_whole(int64_t il, int64_t n, bool copy_chosen) {
    enqueue_mixer(il, n);
    enqueue_route(il, n);
    if (copy_chosen)
      copy_to_host(chosen_pinned_.get() + il * n * m_.hp.n_expert_used, chosen_of(il, n),
                   static_cast<size_t>(n * m_.hp.n_expert_used) * sizeof(int32_t));
    if (!layers_[il].shared_up) {
      enqueue_fused_experts(il, n, true);
      return;
    }
    enqueue_fused_experts(il, n);
    enqueue_shared(il, n);
    enqueue_combine(il, n, false);
  }

  void enqueue_mixer(int64_t il, int64_t n) {
    DevLayer& L = layers_[il];
    norm_h(x_.get(), L.attn_norm.get(), n, L.recurrent ? L.qkv : L.attn_qkv ? L.attn_qkv : L.q);
    if (L.recurrent) {
      delta_net_block(L, n);
    } else {
      attention_block(L, n);
    }
    // The router is F32 in the files we know; the shared expert's matrices are quantized.
    norm_h(x_.get(), L.ffn_norm.get(), n, L.shared_gate ? L.shared_gate : L.router);
  }

  // h_ = RMSNorm(x) * w for n rows, and act_ = h_ quantized for `consumer` when it dots q8
  // activations; run_matvec then skips quantizing h_ again for every matrix of that activation
  // type (q, k and v when not stacked) until act_ is overwritten. Two launches: the first fused
  // rms_norm_quantize took 4.52 us per token inside a graph against 3.15 for this pair
  // (moraine-kernel-bench cuda --backend-only, H200, 2026-11-30); its faster rewrite has not run
  // on the GPU yet.
  void norm_h(const float* x, const float* w, int64_t n, const DevMatrix& consumer) {
    const int64_t d = m_.hp.n_embd;
    const float eps = static_cast<float>(m_.hp.rms_eps);
    cuda::rms_norm(x, w, h_.get(), d, n, eps, stream_);
    act_of_h_ = TensorType::F32;   // none
    if (consumer && consumer.cols == d && cuda::matvec_supported(consumer.type) && !use_gemm(consumer, n)) {
      const TensorType at = dot_activation_type(consumer.type);
      cuda::quantize_activations_llama(at, h_.get(), act_.get(), d, n, stream_);
      act_of_h_ = at;
      act_of_h_rows_ = n;
    }
  }

  void enqueue_route(int64_t il, int64_t n) {
    const model::HParams& hp = m_.hp;
    matmul(layers_[il].router, h_.get(), n, router_logits_.get());
    cuda::route_softmax_top_k(router_logits_.get(), n, hp.n_expert, hp.n_expert_used, hp.norm_topk_prob,
                              chosen_of(il, n), weight_.get(), stream_);
  }

  // The resident experts' unweighted rows into dev_slots_ (slot order), through moe_fused in
  // groups of kMoeMaxTokens tokens: a token's rows come from the same kernel whatever the
  // step's length, which keeps decode after prefill equal to a fresh prefill.
  // into_residual: the route-weighted sum goes straight into x_ (MoeOutputs::sum_accumulate, the
  // bits of moe_combine without the launch) instead of unweighted rows for enqueue_combine; only
  // for a layer whose every expert is here and that has no shared expert.
  void enqueue_fused_experts(int64_t il, int64_t n, bool into_residual = false) {
    const int64_t d = m_.hp.n_embd, k = m_.hp.n_expert_used;
    for (int64_t t0 = 0; t0 < n; t0 += cuda::kMoeMaxTokens) {
      cuda::MoeRouting routing;
      routing.n_tokens = static_cast<int>(std::min<int64_t>(cuda::kMoeMaxTokens, n - t0));
      routing.k = static_cast<int>(k);
      routing.chosen = chosen_of(il, n) + t0 * k;
      routing.weight = weight_.get() + t0 * k;
      cuda::MoeOutputs out;
      if (into_residual) {
        out.sum = x_.get() + t0 * d;
        out.sum_accumulate = true;
      } else {
        out.slot_rows = dev_slots_.get() + t0 * k * d;
      }
      cuda::moe_fused(fused_weights(il), h_.get() + t0 * d, routing, out, fused_ws_.get(), fused_ws_.size(), stream_);
    }
  }

  // The resident experts of a layer moe_fused does not take: rows gathered per expert on the
  // device from the host's plan, the batched matvec over slab ids, outputs scattered to slots.
  void enqueue_matvec_experts(int64_t il, int64_t n, const group::ExpertPlan& plan) {
    const model::HParams& hp = m_.hp;
    const DevLayer& L = layers_[il];
    const int64_t d = hp.n_embd, k = hp.n_expert_used, ff = hp.n_ff_exp, slots = n * k;
    int32_t* token = idx_pinned_.get();
    int32_t* slab = token + slots;
    int32_t* slot = slab + slots;
    int64_t rows = 0;
    for (int64_t e = 0; e < hp.n_expert; ++e) {
      if (L.slab_of[e] < 0) continue;
      for (int32_t r = plan.start[e]; r < plan.start[e + 1]; ++r) {
        if (plan.slot_of[r] < 0 || plan.slot_of[r] >= slots || rows >= slots)
          throw std::invalid_argument("layer_end: the plan names slot " + std::to_string(plan.slot_of[r]) +
                                      " outside the step's " + std::to_string(slots));
        token[rows] = plan.slot_of[r] / static_cast<int32_t>(k);
        slab[rows] = L.slab_of[e];
        slot[rows] = plan.slot_of[r];
        ++rows;
      }
    }
    if (rows == 0) return;
    int32_t* dev = expert_idx_.get();
    const size_t S = static_cast<size_t>(max_tokens_ * k);
    CUDA_CHECK(cudaMemcpyAsync(dev, token, rows * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaMemcpyAsync(dev + S, slab, rows * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaMemcpyAsync(dev + 2 * S, slot, rows * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    cuda::gather_rows(h_.get(), dev, expert_in_.get(), rows, d, stream_);
    if (gemm_experts(L, n)) {   // one GEMM per expert over its rows (they are contiguous, by expert)
      std::vector<cuda::ExpertRows>& g = gemm_groups_;
      g.clear();
      for (int64_t r = 0; r < rows;) {
        int64_t end = r;
        while (end < rows && slab[end] == slab[r]) ++end;
        g.push_back({nullptr, r, end - r});
        r = end;
      }
      const auto run = [&](const DevMatrix& W, const float* x, float* y) {
        for (cuda::ExpertRows& e : g) e.weight = W.matrix(slab[e.first_row]);
        gemm_->matmul_experts(W.type, g, W.rows, W.cols, x, y);
      };
      run(L.gate, expert_in_.get(), expert_g_.get());
      run(L.up, expert_in_.get(), expert_u_.get());
      cuda::swiglu(expert_g_.get(), expert_u_.get(), rows * ff, stream_);
      run(L.down, expert_g_.get(), expert_out_.get());
    } else {
      expert_matmul(L.gate, expert_in_.get(), rows, dev + S, expert_g_.get());
      expert_matmul(L.up, expert_in_.get(), rows, dev + S, expert_u_.get());
      cuda::swiglu(expert_g_.get(), expert_u_.get(), rows * ff, stream_);
      expert_matmul(L.down, expert_g_.get(), rows, dev + S, expert_out_.get());
    }
    cuda::scatter_rows(expert_out_.get(), dev + 2 * S, dev_slots_.get(), rows, d, stream_);
  }

  void enqueue_shared(int64_t il, int64_t n) {
    const DevLayer& L = layers_[il];
    if (!L.shared_up) return;
    const int64_t d = m_.hp.n_embd;
    matmul(L.shared_gate, h_.get(), n, shared_g_.get());
    matmul(L.shared_up, h_.get(), n, shared_u_.get());
    cuda::swiglu(shared_g_.get(), shared_u_.get(), n * m_.hp.n_ff_shexp, stream_);
    matmul(L.shared_down, shared_g_.get(), n, shared_out_.get());
    cuda::MatvecBatch b;  // the shared router: one F32 row dotted with each token's h
    b.count = static_cast<int>(n);
    b.act_stride_bytes = d * static_cast<int64_t>(sizeof(float));
    b.out_stride = 1;
    cuda::matvec_float_batched(TensorType::F32, L.shared_router.get(), 1, d, h_.get(), shared_logit_.get(), b, stream_);
  }

  void enqueue_combine(int64_t il, int64_t n, bool with_cpu_rows) {
    const DevLayer& L = layers_[il];
    const bool shared = static_cast<bool>(L.shared_up);
    cuda::moe_combine_mixed(x_.get(), dev_slots_.get(), with_cpu_rows ? cpu_rows_.get() : nullptr,
                            with_cpu_rows ? alt_row_.get() : nullptr, weight_.get(),
                            shared ? shared_out_.get() : nullptr, shared ? shared_logit_.get() : nullptr, n,
                            m_.hp.n_expert_used, m_.hp.n_embd, stream_);
  }

  void enqueue_logits(int64_t rows) {
    const model::HParams& hp = m_.hp;
    const int64_t d = hp.n_embd;
    norm_h(x_.get() + (step_n_ - rows) * d, output_norm_.get(), rows, output_);
    matmul(output_, h_.get(), rows, logits_.get());
  }

  // ---- layers ----

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
      CUDA_CHECK(cudaMemsetAsync(L.conv_state.get(), 0, L.conv_state.bytes(), stream_));
      CUDA_CHECK(cudaMemsetAsync(L.ssm_state.get(), 0, L.ssm_state.bytes(), stream_));
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
                        delta_ws_.get(), core_.get(), stream_);
    matmul_into_residual(L.ssm_out, core_.get(), n);
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

  // Full attention over the normalised rows in h_, its output added to x_. The new rows' K and V
  // are normalised and rotated in scratch, then stored into the cache at the step's position
  // (read from pos_dev_, as RoPE reads it: a captured step serves every position), so row t sees
  // positions 0 .. n_past + t as in decode.
  void attention_block(DevLayer& L, int64_t n) {
    const model::HParams& hp = m_.hp;
    const int64_t hd = hp.head_dim, kv_dim = hp.n_head_kv * hd;
    const int64_t q_rows = L.q_rows, q_stride = L.q_has_gate ? 2 * hd : hd;
    const float eps = static_cast<float>(hp.rms_eps);
    const int32_t* pos = pos_dev_.get();
    // The projections: row t of q at qg_ + t * row_stride (k and v beside it when stacked).
    int64_t row_stride = q_rows;
    const float *k_rows = k_new_.get(), *v_rows = v_new_.get();
    int64_t kv_row_stride = kv_dim;
    if (L.attn_qkv) {
      matmul(L.attn_qkv, h_.get(), n, qg_.get());
      row_stride = kv_row_stride = L.attn_qkv.rows;
      k_rows = qg_.get() + q_rows;
      v_rows = k_rows + kv_dim;
    } else {
      matmul(L.q, h_.get(), n, qg_.get());
      matmul(L.k, h_.get(), n, k_new_.get());
      matmul(L.v, h_.get(), n, v_new_.get());
    }
    // q and k normalised per head and rotated, k and v stored at the step's position: one
    // launch, the bits of head_rms_norm / rope_neox_at / kv_store_at.
    cuda::QkNormRopeStoreArgs a;
    a.q = qg_.get();
    a.q_row_stride = row_stride;
    a.q_head_stride = q_stride;
    a.k = k_rows;
    a.k_row_stride = kv_row_stride;
    a.v = v_rows;
    a.v_row_stride = kv_row_stride;
    a.q_norm = L.q_norm.get();
    a.k_norm = L.k_norm.get();
    a.rows = n;
    a.n_head = hp.n_head;
    a.n_head_kv = hp.n_head_kv;
    a.head_dim = hd;
    a.n_rot = hp.n_rot;
    a.pos0_dev = pos;
    a.freq_base = hp.rope_freq_base;
    a.eps = eps;
    a.max_pos = max_context_;
    a.q_out = q_.get();
    a.k_cache = L.k_cache.get();
    a.v_cache = L.v_cache.get();
    cuda::qk_norm_rope_store(a, stream_);
    const float* gate = L.q_has_gate ? qg_.get() + hd : nullptr;
    const cuda::AttentionShape shape = attention_shape();
    const int64_t scratch = static_cast<int64_t>(attn_scratch_.size());
    const bool tiled = tiled_prefill_rows_ > 0 && n >= tiled_prefill_rows_;
    if (!tiled && cuda::attention_decode_supported(shape)) {
      // Flash decoding in passes of 16 rows: a row's bits do not depend on the pass, so decode
      // after a prefill (below the tiled kernel's rows) equals a fresh prefill.
      const int64_t qd = hp.n_head * hd;
      for (int64_t r0 = 0; r0 < n; r0 += cuda::kAttentionDecodeMaxRows) {
        const int64_t rows = std::min<int64_t>(cuda::kAttentionDecodeMaxRows, n - r0);
        cuda::attention_decode(shape, q_.get() + r0 * qd, L.k_cache.get(), L.v_cache.get(), rows, pos, r0,
                               max_context_, gate != nullptr ? gate + r0 * row_stride : nullptr, row_stride, q_stride,
                               attn_.get() + r0 * qd, attn_scratch_.get(), scratch, stream_);
      }
    } else if (n <= kDecodeRows) {
      cuda::attention_at(shape, q_.get(), L.k_cache.get(), L.v_cache.get(), n, pos, max_context_, gate, row_stride,
                         q_stride, attn_.get(), attn_scratch_.get(), scratch, stream_);
    } else if (tiled_prefill_rows_ <= 0 || n < tiled_prefill_rows_) {
      cuda::attention(shape, q_.get(), L.k_cache.get(), L.v_cache.get(), n, n_past_, gate, row_stride, q_stride,
                      attn_.get(), attn_scratch_.get(), scratch, stream_);
    } else {
      cuda::attention_prefill(shape, q_.get(), L.k_cache.get(), L.v_cache.get(), n, n_past_, gate, row_stride, q_stride,
                              attn_.get(), stream_);
    }
    matmul_into_residual(L.o, attn_.get(), n);
  }

  // y[t] = W x[t] for n rows of x (device), one batched launch; quantized weights dot the rows
  // quantized with llama.cpp's x86 rule, as the reference executor's matmul does.
  // x_ += W x for n rows: the matvec adds into the residual itself (MatvecBatch::accumulate,
  // the bits of matvec then residual_add); cuBLAS steps add afterwards.
  void matmul_into_residual(const DevMatrix& W, const float* x, int64_t n) {
    if (use_gemm(W, n)) {
      matmul(W, x, n, y_.get());
      cuda::residual_add(x_.get(), y_.get(), n * m_.hp.n_embd, stream_);
      return;
    }
    cuda::MatvecBatch b;
    b.count = static_cast<int>(n);
    b.out_stride = W.rows;
    b.accumulate = true;
    run_matvec(W, x, n, x_.get(), b);
  }

  void matmul(const DevMatrix& W, const float* x, int64_t n, float* y) {
    if (use_gemm(W, n)) {
      gemm_->matmul(W.type, W.bytes.get(), W.rows, W.cols, x, n, y);
      return;
    }
    cuda::MatvecBatch b;
    b.count = static_cast<int>(n);
    b.out_stride = W.rows;
    run_matvec(W, x, n, y, b);
  }
  // Quantized weights of a long step go through cuBLAS; float weights keep the exact matvec (the
  // F32 golden bound is tighter than BF16 rounding).
  bool use_gemm(const DevMatrix& W, int64_t n) const {
    return gemm_ != nullptr && n >= gemm_prefill_rows_ && cuda::matvec_supported(W.type) &&
           cuda::prefill_gemm_supported(W.type) && W.cols % 32 == 0;
  }
  bool gemm_experts(const DevLayer& L, int64_t n) const {
    return L.resident > 0 && use_gemm(L.gate, n) && use_gemm(L.up, n) && use_gemm(L.down, n);
  }

  // Row r of x through the slab matrix slab_ids[r] (device).
  void expert_matmul(const DevMatrix& W, const float* x, int64_t rows, const int32_t* slab_ids, float* y) {
    cuda::MatvecBatch b;
    b.count = static_cast<int>(rows);
    b.weight_stride_bytes = static_cast<int64_t>(W.matrix_bytes);
    b.out_stride = W.rows;
    b.expert_ids = slab_ids;
    run_matvec(W, x, rows, y, b);
  }
  void run_matvec(const DevMatrix& W, const float* x, int64_t n, float* y, cuda::MatvecBatch& b) {
    if (cuda::matvec_float_supported(W.type)) {
      b.act_stride_bytes = W.cols * static_cast<int64_t>(sizeof(float));
      cuda::matvec_float_batched(W.type, W.bytes.get(), W.rows, W.cols, x, y, b, stream_);
      return;
    }
    const TensorType at = dot_activation_type(W.type);
    const size_t rb = row_bytes(at, W.cols);
    if (rb * static_cast<size_t>(n) > act_.size())
      throw std::logic_error("CUDA backend: activation scratch too small for " + std::to_string(n) + " rows");
    if (x != h_.get() || at != act_of_h_ || n != act_of_h_rows_) {
      cuda::quantize_activations_llama(at, x, act_.get(), W.cols, n, stream_);
      act_of_h_ = TensorType::F32;   // act_ no longer holds h_
    }
    b.act_stride_bytes = static_cast<int64_t>(rb);
    cuda::matvec_quantized_batched(W.type, W.bytes.get(), W.rows, W.cols, act_.get(), y, b, stream_);
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
  void check_step(int64_t il, int64_t n) const {
    check_layer(il);
    if (n != step_n_)
      throw std::invalid_argument("CUDA backend: layer " + std::to_string(il) + " asked for " + std::to_string(n) +
                                  " rows in a step of " + std::to_string(step_n_) + " (embed starts a step)");
  }

  const model::Model& m_;
  const int device_;
  const int64_t max_tokens_, tiled_prefill_rows_, gemm_prefill_rows_, max_context_;
  std::unique_ptr<cuda::PrefillGemm> gemm_;   // long steps' quantized matmuls (null: never)
  std::vector<cuda::ExpertRows> gemm_groups_;
  int64_t n_past_ = 0, step_n_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t routed_ = nullptr;   // layer_begin: routing and h copied to the host
  cudaStream_t copy_stream_ = nullptr;   // expert copies of the adaptive VRAM tier
  std::vector<PendingSwap> swaps_;
  std::vector<void*> pinned_;      // host ranges registered by pin_host_memory
  std::vector<DevLayer> layers_;
  DeviceBuffer<cuda::MoeExpertSlot> slot_table_;   // [layer][expert]: the VRAM tier's addresses
  DeviceBuffer<float> output_norm_;
  DevMatrix output_;
  DeviceBuffer<uint8_t> tok_embd_;  // empty when embed falls back to the host dequantizer
  DeviceBuffer<float> x_, h_, y_, qg_, q_, k_new_, v_new_, attn_, attn_scratch_, router_logits_, weight_;
  DeviceBuffer<uint8_t> act_;
  // What act_ holds: h_'s rows quantized as act_of_h_ (F32: nothing of h_), act_of_h_rows_ rows.
  // Host-side bookkeeping of the enqueue order (norm_h sets it, run_matvec clears it when it
  // quantizes something else into act_), valid inside captured graphs as well.
  TensorType act_of_h_ = TensorType::F32;
  int64_t act_of_h_rows_ = 0;
  DeviceBuffer<int32_t> chosen_, token_ids_, pos_dev_, alt_row_, expert_idx_;
  // dev_slots_: this device's expert rows in slot order; cpu_rows_: the cpu workers' packed rows.
  DeviceBuffer<float> dev_slots_, cpu_rows_;
  DeviceBuffer<float> expert_in_, expert_g_, expert_u_, expert_out_;
  DeviceBuffer<float> shared_g_, shared_u_, shared_out_, shared_logit_, logits_;
  DeviceBuffer<float> mixed_, z_, ba_, core_, delta_ws_;  // Gated DeltaNet scratch
  DeviceBuffer<uint8_t> fused_ws_;
  PinnedBuffer<int32_t> tok_pinned_, pos_pinned_, alt_pinned_, idx_pinned_;
  PinnedBuffer<int32_t> chosen_pinned_;   // [layer][max_tokens * k]: routing of layer_whole layers
  std::vector<PendingChosen> pending_chosen_;
  std::vector<int32_t> host_chosen_;
  std::vector<float> host_weight_;
  group::ExpertPlan host_plan_;
  bool graphs_ok_ = false;
  bool layer_graphs_ok_ = true;   // layer_begin's captures (begin_graphs_) work
  // The in-graph hand-off: flags [routed: n_layer][ready: n_layer] in mapped pinned memory, the
  // step's sequence number (host and device copies), the device's timeout flag.
  bool handoff_ok_ = true;
  PinnedBuffer<uint64_t> handoff_flags_, handoff_seq_pinned_;
  uint64_t* handoff_flags_dev_ = nullptr;   // the device's address of handoff_flags_
  DeviceBuffer<uint64_t> handoff_seq_dev_;
  DeviceBuffer<int32_t> handoff_error_;
  uint64_t handoff_seq_ = 0;
  int64_t handoff_rows_ = 0;
  std::vector<char> handoff_whole_;   // this step's layers run whole (handoff_begin's scratch)
  std::map<std::pair<int64_t, int64_t>, HandoffGraph> handoff_graphs_;
  std::vector<std::pair<const char*, size_t>> pinned_ranges_;
  std::map<std::pair<int64_t, int64_t>, LayerBeginGraphs> begin_graphs_;   // (layer, rows)
  std::map<std::pair<int64_t, int64_t>, StepGraph> graphs_;   // (rows, logit rows) -> captured step
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const model::Model& m, const BackendOptions& o) {
  return std::make_unique<CudaBackend>(m, o);
}

}  // namespace moraine::gpu_worker
