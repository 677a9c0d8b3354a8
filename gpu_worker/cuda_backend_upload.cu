// The CUDA backend's construction (cuda_backend_impl.h): the weights uploaded once in their
// GGUF formats, the VRAM tier's expert slabs and slot table, the step scratch.
#include "gpu_worker/cuda_backend_impl.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <stdexcept>

#include "common/formats/quant.h"
#include "kernels/cuda/attention_decode.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/embed_rows.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/matvec_float.h"

namespace moraine::gpu_worker::cuda_impl {

namespace {

bool has_kernel(TensorType t) { return cuda::matvec_supported(t) || cuda::matvec_float_supported(t); }

void check_kernel(const model::Matrix& m) {
  if (has_kernel(m.type)) return;
  const std::string name = m.info != nullptr ? m.info->name : std::string("(unnamed)");
  throw std::runtime_error("CUDA backend: tensor " + name + " is " + std::string(type_name(m.type)) +
                           ", which has no CUDA matvec kernel (kernels/cuda/matvec.h and matvec_float.h list "
                           "the formats); requantize it with moraine-quantize");
}

DevMatrix upload_matrix(cuda::DeviceArena& arena, const model::Matrix& m) {
  DevMatrix d;
  if (!m) return d;
  check_kernel(m);
  d.type = m.type;
  d.rows = m.n_rows;
  d.cols = m.n_cols;
  d.matrix_bytes = m.row_bytes * static_cast<size_t>(m.n_rows);
  d.bytes = DeviceBuffer<uint8_t>(d.matrix_bytes, arena);
  d.bytes.upload(m.data, d.matrix_bytes);
  return d;
}

// The experts `ids` of one expert tensor packed in a slab. The stride between experts is a whole
// number of format blocks (the batched matvec steps through the slab in blocks) and of 16 bytes
// (moe_fused and the matvec read aligned 16-byte words from each expert's start).
DevMatrix expert_slab_shape(const model::ExpertTensor& t) {
  DevMatrix d;
  if (!t.all) return d;
  check_kernel(t.all);
  d.type = t.all.type;
  d.rows = t.rows_per_expert;
  d.cols = t.all.n_cols;
  const size_t one = t.all.row_bytes * static_cast<size_t>(t.rows_per_expert);
  const size_t block = type_traits(d.type).block_bytes;
  const size_t unit = block / std::gcd(block, size_t{16}) * 16;   // lcm(block bytes, 16)
  d.matrix_bytes = (one + unit - 1) / unit * unit;
  return d;
}

// The gate, up and down slabs of a layer's experts `ids`, in one allocation (one 2 MiB-rounded
// cudaMalloc per layer instead of three; device_buffer.h's DeviceArena says why that matters).
void upload_expert_slabs(cuda::DeviceArena& arena, const model::MoeWeights& moe, const std::vector<int32_t>& ids,
                         DevLayer& D) {
  if (ids.empty()) return;
  DevMatrix* parts[3] = {&D.gate, &D.up, &D.down};
  const model::ExpertTensor* tensors[3] = {&moe.gate, &moe.up, &moe.down};
  size_t total = 0;
  for (int i = 0; i < 3; ++i) {
    *parts[i] = expert_slab_shape(*tensors[i]);
    total += parts[i]->matrix_bytes * ids.size();
  }
  D.expert_slabs = DeviceBuffer<uint8_t>(total, arena);
  size_t at = 0;
  for (int i = 0; i < 3; ++i) {
    DevMatrix& d = *parts[i];
    if (!d) continue;
    d.bytes = DeviceBuffer<uint8_t>::view(D.expert_slabs.get() + at, d.matrix_bytes * ids.size());
    at += d.matrix_bytes * ids.size();
    const model::ExpertTensor& t = *tensors[i];
    const size_t one = t.all.row_bytes * static_cast<size_t>(t.rows_per_expert);
    for (size_t j = 0; j < ids.size(); ++j)
      CUDA_CHECK(cudaMemcpy(d.bytes.get() + j * d.matrix_bytes, t.all.data + static_cast<size_t>(ids[j]) * one, one,
                            cudaMemcpyHostToDevice));
  }
}

// Rows `order` of m (in that order) as a matrix of their own: the legacy fused ssm_in of
// qwen3next is split into its qkv and z rows at upload, so one code path serves both layouts.
DevMatrix upload_rows(cuda::DeviceArena& arena, const model::Matrix& m, const std::vector<int64_t>& order) {
  std::vector<uint8_t> bytes(m.row_bytes * order.size());
  for (size_t i = 0; i < order.size(); ++i) std::copy_n(m.row(order[i]), m.row_bytes, bytes.data() + i * m.row_bytes);
  model::Matrix part = m;
  part.n_rows = static_cast<int64_t>(order.size());
  part.data = bytes.data();
  return upload_matrix(arena, part);
}

// q, k and v stacked into one matrix (rows q | k | v) when they share a format and a width: one
// activation quantization and one matvec launch instead of three, each output row the same bits
// (a row's dot does not depend on its neighbours). Empty when they differ (per-tensor formats).
DevMatrix upload_stacked(cuda::DeviceArena& arena, const std::vector<const model::Matrix*>& parts) {
  DevMatrix d;
  for (const model::Matrix* m : parts)
    if (!*m || m->type != parts[0]->type || m->n_cols != parts[0]->n_cols) return d;
  check_kernel(*parts[0]);
  d.type = parts[0]->type;
  d.cols = parts[0]->n_cols;
  for (const model::Matrix* m : parts) d.rows += m->n_rows;
  d.matrix_bytes = parts[0]->row_bytes * static_cast<size_t>(d.rows);
  d.bytes = DeviceBuffer<uint8_t>(d.matrix_bytes, arena);
  size_t at = 0;
  for (const model::Matrix* m : parts) {
    const size_t bytes = m->row_bytes * static_cast<size_t>(m->n_rows);
    CUDA_CHECK(cudaMemcpy(d.bytes.get() + at, m->data, bytes, cudaMemcpyHostToDevice));
    at += bytes;
  }
  return d;
}

DeviceBuffer<float> upload_vector(cuda::DeviceArena& arena, const std::vector<float>& v) {
  DeviceBuffer<float> d(v.size(), arena);
  if (!v.empty()) d.upload(v.data(), v.size());
  return d;
}

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

}  // namespace

CudaBackend::CudaBackend(const model::Model& m, const BackendOptions& o)
    : m_(m), device_(o.device), max_tokens_(o.max_tokens), tiled_prefill_rows_(o.tiled_prefill_rows),
      gemm_prefill_rows_(o.gemm_prefill_rows), prefill_gemm_f16_(o.prefill_gemm_f16), take_expert_from_(o.all_experts ? 0 : o.take_expert_from),
      stage_slots_(o.all_experts ? 0 : std::max(0, o.stage_experts)),
      long_step_rows_(std::max(0, o.long_step_rows)),
      max_context_(o.max_context > 0 ? o.max_context : std::max<int64_t>(kDefaultContext, o.max_tokens)),
      kv_f16_(o.kv_type == model::KvType::F16), slots_(o.slots),
      past_(static_cast<size_t>(std::max(1, o.slots)), 0), snapshot_pos_(static_cast<size_t>(std::max(1, o.slots)), -1) {
  const model::HParams& hp = m.hp;
  if (o.slots < 1 || o.slots > static_cast<int>(group::kMaxSegments))
    throw std::invalid_argument("CUDA backend: " + std::to_string(o.slots) + " sequence slots, expected 1.." +
                                std::to_string(group::kMaxSegments));
  stage_halves_ = o.stage_prefetch && long_step_rows_ > 0 ? 2 : 1;
  model::check_supported(m, cuda_backend_support());   // a part the kernels lack: refused, never run wrongly
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
  if (slots_ > 1 && o.segment_streams > 0) {
    for (int i = 0; i < std::min(o.segment_streams, slots_); ++i) {
      segment_streams_.emplace_back();
      CUDA_CHECK(cudaStreamCreateWithFlags(&segment_streams_.back(), cudaStreamNonBlocking));
    }
    CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
    for (int i = 0; i < slots_; ++i) {
      join_.emplace_back();
      CUDA_CHECK(cudaEventCreateWithFlags(&join_.back(), cudaEventDisableTiming));
    }
  }
  log_device_memory("context");

  std::vector<int32_t> all(static_cast<size_t>(hp.n_expert));
  for (int64_t e = 0; e < hp.n_expert; ++e) all[e] = static_cast<int32_t>(e);
  std::vector<cuda::MoeExpertSlot> table(static_cast<size_t>(hp.n_layer * slot_stride()));
  layers_.resize(static_cast<size_t>(hp.n_layer));
  for (int64_t il = 0; il < hp.n_layer; ++il) upload_layer(il, o.all_experts ? all : o.device_experts[il], table);
  slot_table_ = DeviceBuffer<cuda::MoeExpertSlot>(table.size(), weights_arena_);
  slot_table_.upload(table.data(), table.size());
  output_norm_ = upload_vector(weights_arena_, m.output_norm);
  output_ = upload_matrix(weights_arena_, m.output);
  if (cuda::embed_rows_supported(m.tok_embd.type)) {
    tok_embd_ = cuda::PinnedBuffer<uint8_t>(m.tok_embd.row_bytes * static_cast<size_t>(m.tok_embd.n_rows));
    std::memcpy(tok_embd_.get(), m.tok_embd.data, tok_embd_.size());
  }

  log_device_memory("weights");
  if (slots_ > 1) {   // what the placement charged per slot (coordinator --batch-decode), said where it is held
    uint64_t per_slot = 0;
    for (const DevLayer& L : layers_)
      per_slot += (L.k_cache.empty() ? 0 : 2 * L.k_cache[0].bytes()) + (L.k_cache_f16.empty() ? 0 : 2 * L.k_cache_f16[0].bytes()) +
                  (L.conv_state.empty() ? 0 : L.conv_state[0].bytes() + L.ssm_state[0].bytes());
    std::cerr << "gpu_worker: " << slots_ << " sequence slots, each its own KV cache and recurrent state: " << (per_slot >> 20)
              << " MiB a slot, " << ((per_slot * static_cast<uint64_t>(slots_)) >> 20) << " MiB in all\n";
  }
  // The step scratch (the expert path decides which buffers it has).
  choose_expert_paths();
  scratch_ = cuda_step_scratch(hp, scratch_options());
  const uint64_t live_before_scratch = cuda::device_buffer_live_bytes().load();
  allocate_scratch();
  setup_experts();
  scratch_allocated_bytes_ = cuda::device_buffer_live_bytes().load() - live_before_scratch;
  log_device_memory("scratch");
  const size_t T = static_cast<size_t>(max_tokens_), step_rows = static_cast<size_t>(max_step_rows());
  const size_t slots = T * static_cast<size_t>(hp.n_expert_used);
  tok_pinned_ = PinnedBuffer<int32_t>(step_rows);
  // A word per window of a long step, or per segment of a batched step (they do not mix).
  pos_pinned_ = PinnedBuffer<int32_t>(std::max((step_rows + T - 1) / T, static_cast<size_t>(slots_)));
  alt_pinned_ = PinnedBuffer<int32_t>(slots);
  idx_pinned_ = PinnedBuffer<int32_t>(4 * slots);   // token, slab, slot, expert per row
  chosen_pinned_ = PinnedBuffer<int32_t>(static_cast<size_t>(hp.n_layer) * step_rows * static_cast<size_t>(hp.n_expert_used));
  handoff_flags_ = PinnedBuffer<uint64_t>(static_cast<size_t>(2 * hp.n_layer));
  std::fill_n(handoff_flags_.get(), 2 * hp.n_layer, uint64_t{0});
  CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&handoff_flags_dev_), handoff_flags_.get(), 0));
  CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&alt_pinned_dev_), alt_pinned_.get(), 0));
  handoff_seq_pinned_ = PinnedBuffer<uint64_t>(1);
  setup_swaps(o.all_experts);
  zero_states();
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  log_device_memory("setup");
}

// Layer il's weights (its device experts `ids`, ascending, into slabs and their slot-table
// entries in `table`) and, for an attention layer, its KV cache.
void CudaBackend::upload_layer(int64_t il, const std::vector<int32_t>& ids, std::vector<cuda::MoeExpertSlot>& table) {
  const model::HParams& hp = m_.hp;
  const int64_t kv_dim = hp.n_head_kv * hp.head_dim;
  const model::LayerWeights& L = m_.layers[il];
  DevLayer& D = layers_[il];
  D.attn_norm = upload_vector(weights_arena_, L.attn_norm);
  D.ffn_norm = upload_vector(weights_arena_, L.ffn_norm);
  D.router = upload_matrix(weights_arena_, L.moe.router);
  D.router_bias = upload_vector(weights_arena_, L.moe.router_bias);
  D.score_bias = upload_vector(weights_arena_, L.moe.score_bias);
  D.dense = L.recipe.ffn.kind == model::FfnKind::Dense;
  if (D.dense) {   // placement gives its zero-byte experts the device: the slabs below stay empty
    D.dense_gate = upload_matrix(weights_arena_, L.dense.gate);
    D.dense_up = upload_matrix(weights_arena_, L.dense.up);
    D.dense_down = upload_matrix(weights_arena_, L.dense.down);
  }
  D.clamped = L.recipe.ffn.experts.act == model::Activation::SwiGluClamped;
  if (L.recipe.ffn.experts.biases) {
    D.gate_bias = upload_vector(weights_arena_, L.moe.gate_bias);
    D.up_bias = upload_vector(weights_arena_, L.moe.up_bias);
    D.down_bias = upload_vector(weights_arena_, L.moe.down_bias);
  }
  D.slab_of.assign(static_cast<size_t>(hp.n_expert), -1);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= hp.n_expert || (i > 0 && ids[i] <= ids[i - 1]))
      throw std::invalid_argument("CUDA backend: layer " + std::to_string(il) + "'s device experts must be "
                                  "ascending ids in [0, " + std::to_string(hp.n_expert) + ")");
    D.slab_of[ids[i]] = static_cast<int32_t>(i);
  }
  D.resident = static_cast<int64_t>(ids.size());
  upload_expert_slabs(weights_arena_, L.moe, ids, D);
  for (size_t i = 0; i < ids.size(); ++i)
    table[il * slot_stride() + ids[i]] = {D.gate.matrix(i), D.up.matrix(i), D.down.matrix(i)};
  if (L.moe.shared_up) {
    D.shared_gate = upload_matrix(weights_arena_, L.moe.shared_gate);
    D.shared_up = upload_matrix(weights_arena_, L.moe.shared_up);
    D.shared_down = upload_matrix(weights_arena_, L.moe.shared_down);
    D.shared_router = upload_vector(weights_arena_, L.moe.shared_router);
  }
  if (L.recurrent) {
    upload_delta_net(L.delta, L.recipe.mixer.delta, D);
    return;
  }
  D.q_norm = upload_vector(weights_arena_, L.attn.q_norm);
  D.q_bias = upload_vector(weights_arena_, L.attn.q_bias);
  D.k_bias = upload_vector(weights_arena_, L.attn.k_bias);
  D.v_bias = upload_vector(weights_arena_, L.attn.v_bias);
  D.o_bias = upload_vector(weights_arena_, L.attn.o_bias);
  D.sinks = upload_vector(weights_arena_, L.attn.sinks);
  D.window = L.recipe.mixer.attn.sliding_window;
  const model::RopePart& rope = L.recipe.mixer.attn.rope;
  if (rope.scaling == model::RopeScaling::Yarn) {   // the reference's ramp (model::yarn_ramp), its base
    const model::YarnRamp r = model::yarn_ramp(rope, hp.n_rot);
    D.yarn = {true, rope.yarn_factor, r.low, r.high, r.mscale};
    D.rope_base = rope.freq_base;
  }
  D.k_norm = upload_vector(weights_arena_, L.attn.k_norm);
  D.attn_qkv = upload_stacked(weights_arena_, {&L.attn.q, &L.attn.k, &L.attn.v});
  if (!D.attn_qkv) {
    D.q = upload_matrix(weights_arena_, L.attn.q);
    D.k = upload_matrix(weights_arena_, L.attn.k);
    D.v = upload_matrix(weights_arena_, L.attn.v);
  }
  D.q_rows = L.attn.q.n_rows;
  D.o = upload_matrix(weights_arena_, L.attn.o);
  D.q_has_gate = L.attn.q_has_gate;
  // Each sequence slot's own cache of max_context_ positions: the placement charged the KV bytes
  // once per slot (coordinator --batch-decode: plan_for's kv_slots).
  const size_t cache_elems = static_cast<size_t>(max_context_ * kv_dim);
  for (int slot = 0; slot < slots_; ++slot) {
    if (kv_f16_) {   // every attention kernel reads a half cache (attention.h, attention_decode.h, ...)
      D.k_cache_f16.emplace_back(cache_elems, weights_arena_);
      D.v_cache_f16.emplace_back(cache_elems, weights_arena_);
    } else {
      D.k_cache.emplace_back(cache_elems, weights_arena_);
      D.v_cache.emplace_back(cache_elems, weights_arena_);
    }
  }
}

// The step scratch: every buffer of scratch_ (cuda_step_scratch.h's list, the bytes the
// coordinator charges against --vram), in the list's order.
void CudaBackend::allocate_scratch() {
  const CudaStepScratch& s = scratch_;
  x_ = DeviceBuffer<float>(s.count<float>("x"));
  h_ = DeviceBuffer<float>(s.count<float>("h"));
  y_ = DeviceBuffer<float>(s.count<float>("y"));
  qg_ = DeviceBuffer<float>(s.count<float>("qg"));
  q_ = DeviceBuffer<float>(s.count<float>("q"));
  k_new_ = DeviceBuffer<float>(s.count<float>("k_new"));
  v_new_ = DeviceBuffer<float>(s.count<float>("v_new"));
  attn_ = DeviceBuffer<float>(s.count<float>("attn"));
  // Split-KV records for 16 rows at a time (longer steps between 16 and the tiled prefill go
  // through in passes): enough to fill the GPU, about 34 MB at 32K context for 32 heads of 128.
  attn_scratch_ = DeviceBuffer<float>(s.count<float>("attn_scratch"));
  act_ = DeviceBuffer<uint8_t>(s.count<uint8_t>("act"));
  router_logits_ = DeviceBuffer<float>(s.count<float>("router_logits"));
  route_arrivals_ = DeviceBuffer<uint32_t>(s.count<uint32_t>("route_arrivals"));   // zero between calls
  CUDA_CHECK(cudaMemsetAsync(route_arrivals_.get(), 0, route_arrivals_.bytes(), stream_));
  chosen_ = DeviceBuffer<int32_t>(s.count<int32_t>("chosen"));
  weight_ = DeviceBuffer<float>(s.count<float>("weight"));
  token_ids_ = DeviceBuffer<int32_t>(s.count<int32_t>("token_ids"));
  pos_dev_ = DeviceBuffer<int32_t>(s.count<int32_t>("pos"));
  dev_slots_ = DeviceBuffer<float>(s.count<float>("dev_slots"));
  cpu_rows_ = DeviceBuffer<float>(s.count<float>("cpu_rows"));
  alt_row_ = DeviceBuffer<int32_t>(s.count<int32_t>("alt_row"));
  shared_g_ = DeviceBuffer<float>(s.count<float>("shared_g"));   // empty without a shared expert
  shared_u_ = DeviceBuffer<float>(s.count<float>("shared_u"));
  shared_out_ = DeviceBuffer<float>(s.count<float>("shared_out"));
  shared_logit_ = DeviceBuffer<float>(s.count<float>("shared_logit"));
  dense_g_ = DeviceBuffer<float>(s.count<float>("dense_g"));   // empty without dense layers
  dense_u_ = DeviceBuffer<float>(s.count<float>("dense_u"));
  // Logits for one decode-sized step at a time (longer requests go in passes: CudaBackend::logits).
  logits_rows_ = std::min<int64_t>(max_tokens_, kDecodeRows);
  logits_ = DeviceBuffer<float>(s.count<float>("logits"));
  mixed_ = DeviceBuffer<float>(s.count<float>("delta_mixed"));   // empty without Gated DeltaNet layers
  z_ = DeviceBuffer<float>(s.count<float>("delta_z"));
  ba_ = DeviceBuffer<float>(s.count<float>("delta_ba"));
  core_ = DeviceBuffer<float>(s.count<float>("delta_core"));
  delta_ws_ = DeviceBuffer<float>(s.count<float>("delta_ws"));
  delta_snapshot_ = DeviceBuffer<float>(s.count<float>("delta_snapshot"));
  handoff_seq_dev_ = DeviceBuffer<uint64_t>(s.count<uint64_t>("handoff_seq"));
  handoff_error_ = DeviceBuffer<int32_t>(s.count<int32_t>("handoff_error"));
  CUDA_CHECK(cudaMemsetAsync(handoff_error_.get(), 0, sizeof(int32_t), stream_));
}

void CudaBackend::upload_delta_net(const model::DeltaNetWeights& W, const model::DeltaNetPart& part, DevLayer& D) {
  const cuda::DeltaNetShape s = delta_net_shape_of(m_.hp, part);
  D.recurrent = true;
  D.delta_net_shape = s;
  if (W.qkv) {
    D.qkv = upload_matrix(weights_arena_, W.qkv);
    D.z = upload_matrix(weights_arena_, W.z);
  } else {
    std::vector<int64_t> qkv_rows, z_rows;
    legacy_qkvz_orders(m_.hp, qkv_rows, z_rows);
    D.qkv = upload_rows(weights_arena_, W.qkvz, qkv_rows);
    D.z = upload_rows(weights_arena_, W.qkvz, z_rows);
  }
  if (part.split_ba) {
    // One matvec of ssm_beta over ssm_alpha gives a token's [b(n_v) | alpha(n_v)] row, the
    // kernels' split_ba layout; formats that differ cannot stack (delta_net_gate_rows).
    D.ba = upload_stacked(weights_arena_, {&W.beta, &W.alpha});
    if (!D.ba) {
      D.beta = upload_matrix(weights_arena_, W.beta);
      D.alpha = upload_matrix(weights_arena_, W.alpha);
    }
  } else {
    D.ba = upload_matrix(weights_arena_, W.ba);
  }
  D.ssm_out = upload_matrix(weights_arena_, W.out);
  D.conv_w = upload_vector(weights_arena_, W.conv);
  D.ssm_a = upload_vector(weights_arena_, W.a);
  D.dt_bias = upload_vector(weights_arena_, W.dt_bias);
  D.ssm_norm = upload_vector(weights_arena_, W.norm);
  for (int slot = 0; slot < slots_; ++slot) {   // each sequence slot's states
    D.conv_state.emplace_back(static_cast<size_t>(std::max<int64_t>(s.conv_state_floats(), 1)), weights_arena_);
    D.ssm_state.emplace_back(static_cast<size_t>(s.ssm_state_floats()), weights_arena_);
  }
}

}  // namespace moraine::gpu_worker::cuda_impl
