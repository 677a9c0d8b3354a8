// The CUDA backend's mixers (cuda_backend_impl.h): full attention and Gated DeltaNet.
#include "gpu_worker/cuda_backend_impl.h"
#include "gpu_worker/cuda_step_scratch.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <type_traits>
#include <utility>

#include "common/formats/quant.h"
#include "common/model/sequence_state.h"
#include "kernels/cuda/attention_decode.h"
#include "kernels/cuda/attention_prefill.h"
#include "kernels/cuda/attention_prefill_tc.h"
#include "kernels/cuda/qk_norm_rope_store.h"
#include "kernels/cuda/residual_add.h"

namespace moraine::gpu_worker::cuda_impl {

cuda::DeltaNetShape CudaBackend::delta_shape() const { return delta_net_shape_of(m_.hp); }

// A new sequence: the recurrent layers start from zero state (the KV cache needs no clearing:
// attention reads only positions below n_past + n, all written by then). Every slot's.
void CudaBackend::zero_states() {
  for (int slot = 0; slot < slots_; ++slot) zero_slot_states(slot);
}

void CudaBackend::zero_slot_states(int slot) {
  for (DevLayer& L : layers_) {
    if (!L.recurrent) continue;
    DeviceBuffer<float>& conv = L.conv_state[static_cast<size_t>(slot)];
    DeviceBuffer<float>& ssm = L.ssm_state[static_cast<size_t>(slot)];
    CUDA_CHECK(cudaMemsetAsync(conv.get(), 0, conv.bytes(), stream_));
    CUDA_CHECK(cudaMemsetAsync(ssm.get(), 0, ssm.bytes(), stream_));
  }
}

// The selected slot's recurrent layers' two states to or from their places in its part of
// delta_snapshot_, on stream_ (in order with the steps around them).
void CudaBackend::copy_states(bool save) {
  const size_t per_slot = snapshot_floats_per_slot();
  float* const base = delta_snapshot_.get() + static_cast<size_t>(selected_) * per_slot;
  float* at = base;
  const bool conv = delta_shape().conv_kernel > 1;   // else conv_state is a 1-float placeholder
  for (DevLayer& L : layers_) {
    if (!L.recurrent) continue;
    for (DeviceBuffer<float>* state : {&L.conv_state[static_cast<size_t>(selected_)], &L.ssm_state[static_cast<size_t>(selected_)]}) {
      if (state == &L.conv_state[static_cast<size_t>(selected_)] && !conv) continue;
      if (at + state->size() > base + per_slot)
        throw std::logic_error("CUDA backend: the recurrent states outgrow their snapshot buffer");
      CUDA_CHECK(cudaMemcpyAsync(save ? at : state->get(), save ? state->get() : at, state->bytes(),
                                 cudaMemcpyDeviceToDevice, stream_));
      at += state->size();
    }
  }
}

void CudaBackend::snapshot() {
  use_device();
  copy_states(true);
  snapshot_pos_[static_cast<size_t>(selected_)] = n_past();
}

void CudaBackend::rewind(int64_t n_past) {
  use_device();
  const bool recurrent = delta_snapshot_.size() > 0;
  const int64_t past = this->n_past(), snap = snapshot_pos_[static_cast<size_t>(selected_)];
  if (n_past < 0 || n_past > past || (recurrent && n_past != snap))
    throw std::logic_error("CUDA backend: cannot rewind to " + std::to_string(n_past) + " of " +
                           std::to_string(past) + " cached positions" +
                           (slots_ > 1 ? " of slot " + std::to_string(selected_) : std::string()) +
                           (recurrent ? " (recurrent layers: only to the snapshot, " +
                                            (snap < 0 ? std::string("none taken") : "at " + std::to_string(snap)) + ")"
                                      : std::string()));
  if (recurrent) copy_states(false);
  past_[static_cast<size_t>(selected_)] = n_past;
}

// A layer's parts in the saved sequence, in order: K and V rows of the cached positions (empty
// for a recurrent layer), then the conv and ssm states (empty for an attention layer).
namespace {
struct StatePart {
  void* dev;
  size_t bytes;
};
std::array<StatePart, 4> state_parts(const DevLayer& L, int slot, int64_t n_past, int64_t kv_dim, bool f16) {
  const size_t s = static_cast<size_t>(slot);
  if (L.recurrent)
    return {StatePart{nullptr, 0}, StatePart{nullptr, 0}, StatePart{L.conv_state[s].get(), L.conv_state[s].bytes()},
            StatePart{L.ssm_state[s].get(), L.ssm_state[s].bytes()}};
  const size_t kv = static_cast<size_t>(n_past * kv_dim) * (f16 ? sizeof(__half) : sizeof(float));
  void* k = f16 ? static_cast<void*>(L.k_cache_f16[s].get()) : static_cast<void*>(L.k_cache[s].get());
  void* v = f16 ? static_cast<void*>(L.v_cache_f16[s].get()) : static_cast<void*>(L.v_cache[s].get());
  return {StatePart{k, kv}, StatePart{v, kv}, StatePart{nullptr, 0}, StatePart{nullptr, 0}};
}
}  // namespace

size_t CudaBackend::state_bytes() const {
  const int64_t kv_dim = m_.hp.n_head_kv * m_.hp.head_dim;
  size_t sum = 0;
  for (const DevLayer& L : layers_)
    for (const StatePart& p : state_parts(L, selected_, n_past(), kv_dim, kv_f16_)) sum += p.bytes;
  return model::sequence_state_bytes(4 * layers_.size(), sum);
}

Backend::HostBuffer CudaBackend::host_buffer(size_t bytes) {
  use_device();
  void* p = nullptr;
  if (cudaMallocHost(&p, bytes) == cudaSuccess)
    return {std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [](uint8_t* q) { cudaFreeHost(q); }), bytes};
  cudaGetLastError();   // not sticky: the copies still work from pageable memory, only slower
  return Backend::host_buffer(bytes);
}

void CudaBackend::save_state(std::span<uint8_t> out) {
  use_device();
  const int64_t kv_dim = m_.hp.n_head_kv * m_.hp.head_dim;
  model::SequenceStateWriter w(out, n_past(), static_cast<int64_t>(layers_.size()));
  for (DevLayer& L : layers_) {
    for (const StatePart& p : state_parts(L, selected_, n_past(), kv_dim, kv_f16_)) {
      uint8_t* dst = w.part(p.bytes);
      if (p.bytes > 0) CUDA_CHECK(cudaMemcpyAsync(dst, p.dev, p.bytes, cudaMemcpyDeviceToHost, stream_));
    }
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::load_state(std::span<const uint8_t> in) {
  use_device();
  model::SequenceStateReader r(in, static_cast<int64_t>(layers_.size()));
  const int64_t n = r.n_past();
  if (n < 0 || n > max_context_)
    throw std::invalid_argument("CUDA backend: a saved sequence of " + std::to_string(n) + " positions, the cache holds " +
                                std::to_string(max_context_));
  const int64_t kv_dim = m_.hp.n_head_kv * m_.hp.head_dim;
  // Every part's size is checked before the first copy: a bad state leaves the cache as it was.
  model::SequenceStateReader check = r;
  for (DevLayer& L : layers_)
    for (const StatePart& p : state_parts(L, selected_, n, kv_dim, kv_f16_)) check.part(p.bytes);
  check.finish();
  for (DevLayer& L : layers_) {
    for (const StatePart& p : state_parts(L, selected_, n, kv_dim, kv_f16_)) {
      const uint8_t* src = r.part(p.bytes);
      if (p.bytes > 0) CUDA_CHECK(cudaMemcpyAsync(p.dev, src, p.bytes, cudaMemcpyHostToDevice, stream_));
    }
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  past_[static_cast<size_t>(selected_)] = n;
  snapshot_pos_[static_cast<size_t>(selected_)] = -1;
}

// Gated DeltaNet over the normalised rows in h_, its output added to x_: the projections as
// matvecs, the conv / gates / recurrence / gated norm by delta_net_mix, then the out projection.
void CudaBackend::delta_net_block(DevLayer& L, int64_t n) {
  const model::HParams& hp = m_.hp;
  const cuda::DeltaNetShape& s = L.delta_net_shape;
  matmul(L.qkv, h_.get(), n, mixed_.get());
  matmul(L.z, h_.get(), n, z_.get());
  delta_net_gate_rows(L, n);
  cuda::DeltaNetWeightsDevice w;
  w.conv_w = L.conv_w.get();
  w.a = L.ssm_a.get();
  w.dt_bias = L.dt_bias.get();
  w.norm_w = L.ssm_norm.get();
  // The recurrence per segment, from its slot's states (the projections above and below are
  // per row, so they run once over all the step's rows).
  const int64_t conv_dim = s.conv_dim(), value_dim = s.value_dim(), nv2 = 2 * s.n_v_heads;
  for (const MixSegment& g : mix_segments()) {
    cuda::DeltaNetStateDevice st;
    st.conv_state = s.conv_kernel > 1 ? L.conv_state[static_cast<size_t>(g.slot)].get() : nullptr;
    st.ssm_state = L.ssm_state[static_cast<size_t>(g.slot)].get();
    cuda::delta_net_mix(s, w, st, mixed_.get() + g.first * conv_dim, z_.get() + g.first * value_dim, ba_.get() + g.first * nv2,
                        g.rows, static_cast<float>(hp.rms_eps), delta_ws_.get(), core_.get() + g.first * value_dim, stream_);
  }
  matmul_into_residual(L.ssm_out, core_.get(), n);
}

// ba_'s rows [n][2 * n_v_heads] (delta_net.h's ba): one matmul, or, for ssm_beta and ssm_alpha in
// different formats, each into core_ (free until delta_net_mix writes it) and copied into its half.
void CudaBackend::delta_net_gate_rows(const DevLayer& L, int64_t n) {
  if (L.ba) {
    matmul(L.ba, h_.get(), n, ba_.get());
    return;
  }
  const int64_t nv = L.delta_net_shape.n_v_heads;
  const size_t row = static_cast<size_t>(nv) * sizeof(float);
  for (const auto& [W, column] : {std::pair{&L.beta, int64_t{0}}, std::pair{&L.alpha, nv}}) {
    matmul(*W, h_.get(), n, core_.get());
    CUDA_CHECK(cudaMemcpy2DAsync(ba_.get() + column, 2 * row, core_.get(), row, row, static_cast<size_t>(n),
                                 cudaMemcpyDeviceToDevice, stream_));
  }
}

cuda::AttentionShape CudaBackend::attention_shape() const {
  cuda::AttentionShape s = attention_shape_of(m_.hp);
  s.scale = 1.0f / std::sqrt(static_cast<float>(m_.hp.head_dim));
  return s;
}

// Full attention over the normalised rows in h_, its output added to x_. The new rows' K and V
// are normalised and rotated in scratch, then stored into the cache at the step's position
// (read from pos_dev_, as RoPE reads it: a captured step serves every position), so row t sees
// positions 0 .. n_past + t as in decode.
void CudaBackend::attention_block(DevLayer& L, int64_t n) {
  const model::HParams& hp = m_.hp;
  const int64_t hd = hp.head_dim, kv_dim = hp.n_head_kv * hd;
  const int64_t q_rows = L.q_rows, q_stride = L.q_has_gate ? 2 * hd : hd;
  const float eps = static_cast<float>(hp.rms_eps);
  // The projections (per row: once over all the step's rows, whatever segments they belong to): row t of q at qg_ + t * row_stride (k and v beside it when stacked).
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
  const float* gate = L.q_has_gate ? qg_.get() + hd : nullptr;
  cuda::AttentionShape shape = attention_shape();
  shape.sinks = L.sinks.size() != 0 ? L.sinks.get() : nullptr;
  shape.window = L.window;
  const int64_t scratch = static_cast<int64_t>(attn_scratch_.size());
  const int64_t qd = hp.n_head * hd;
  const size_t act_row = row_bytes(TensorType::Q8_0, qd);
  // The o projection's q8_0 activations written by attention_decode's merge (the bits of the
  // quantize launch run_matvec would make): when o dots q8_0 rows through the matvec.
  const bool quantize_out = L.o.cols == qd && cuda::matvec_supported(L.o.type) && !use_gemm(L.o, n) &&
                            dot_activation_type(L.o.type) == TensorType::Q8_0 &&
                            act_row * static_cast<size_t>(n) <= act_.size();
  // The o projection, from act_ when the attention wrote attn_'s q8_0 rows there.
  auto project_out = [&](bool quantized) {
    act_of_h_ = TensorType::F32;   // act_ held h_'s rows (q | k | v), now consumed or overwritten
    if (quantized) {
      act_of_h_ = TensorType::Q8_0;
      act_of_h_rows_ = n;
      act_src_ = attn_.get();
    }
    if (L.o_bias.size() == 0) {
      matmul_into_residual(L.o, attn_.get(), n);
      return;
    }
    matmul(L.o, attn_.get(), n, y_.get());   // gpt-oss: x += (o(attn) + bo), as the reference rounds it
    cuda::residual_add_bias(xw(), y_.get(), L.o_bias.get(), n, m_.hp.n_embd, stream_);
  };
  // Each segment's rows against its slot's cache, at its position (pos_dev_ word g.word): the
  // kernels a step of only its rows takes, so its bits are those of the sequence run alone.
  // Returns whether its rows of act_ hold attn_'s q8_0 rows. On stream st, with the split-KV
  // records at sc (sc_floats of them).
  const auto attend_segment = [&](const MixSegment& g, cudaStream_t st, float* sc, int64_t sc_floats) -> bool {
    const int64_t rows_n = g.rows, f = g.first;
    const size_t slot = static_cast<size_t>(g.slot);
    const int32_t* pos = pos_dev_.get() + g.word;
    const bool tiled = tiled_prefill_rows_ > 0 && rows_n >= tiled_prefill_rows_;
    // q and k normalised per head and rotated, k and v stored at the segment's position: one
    // launch, the bits of head_rms_norm / rope_neox_at / kv_store_at (or, one decode row, inside
    // the attention's split kernel: attention_decode_fused_qk below).
    cuda::QkNormRopeStoreArgs a;
    a.q = qg_.get() + f * row_stride;
    a.q_row_stride = row_stride;
    a.q_head_stride = q_stride;
    a.k = k_rows + f * kv_row_stride;
    a.k_row_stride = kv_row_stride;
    a.v = v_rows + f * kv_row_stride;
    a.v_row_stride = kv_row_stride;
    a.q_norm = L.q_norm.get();
    a.k_norm = L.k_norm.get();
    a.rows = rows_n;
    a.n_head = hp.n_head;
    a.n_head_kv = hp.n_head_kv;
    a.head_dim = hd;
    a.n_rot = hp.n_rot;
    a.pos0_dev = pos;
    a.freq_base = hp.rope_freq_base;
    a.eps = eps;
    a.max_pos = max_context_;
    a.q_out = q_.get() + f * qd;
    // gpt-oss: the projections' biases join in the rotation's kernel, YaRN in its table.
    a.q_bias = L.q_bias.size() != 0 ? L.q_bias.get() : nullptr;
    a.k_bias = L.k_bias.size() != 0 ? L.k_bias.get() : nullptr;
    a.v_bias = L.v_bias.size() != 0 ? L.v_bias.get() : nullptr;
    a.yarn = L.yarn;
    if (L.yarn.on) a.freq_base = L.rope_base;
    if (kv_f16_) {
      a.k_cache_f16 = L.k_cache_f16[slot].get();
      a.v_cache_f16 = L.v_cache_f16[slot].get();
    } else {
      a.k_cache = L.k_cache[slot].get();
      a.v_cache = L.v_cache[slot].get();
    }
    const float* seg_gate = gate != nullptr ? gate + f * row_stride : nullptr;
    float* out = attn_.get() + f * qd;
    uint8_t* out_q8 = act_.get() + static_cast<size_t>(f) * act_row;
    // One decode row: the split kernel normalises, rotates and stores q / k / v itself (the bits
    // of qk_norm_rope_store, one link less in the chain).
    const bool norms = a.q_norm != nullptr && a.k_norm != nullptr;   // the fused kernel normalises (gpt-oss has none)
    if (rows_n == 1 && !tiled && norms && cuda::attention_decode_fused_qk_supported(a, shape)) {
      cuda::attention_decode_fused_qk(a, shape, seg_gate, row_stride, q_stride, out,
                                      quantize_out ? static_cast<void*>(out_q8) : nullptr, sc, sc_floats,
                                      st);
      return quantize_out;
    }
    cuda::qk_norm_rope_store(a, st);
    bool quantized = false;
    const float* q = a.q_out;
    // The cache's element type picks the kernels' overload (float or __half caches, same choice).
    auto attend = [&](const auto* kc, const auto* vc) {
      if (!tiled && cuda::attention_decode_supported(shape)) {
        // Flash decoding in passes of 16 rows: a row's bits do not depend on the pass, so decode
        // after a prefill (below the tiled kernel's rows) equals a fresh prefill.
        for (int64_t r0 = 0; r0 < rows_n; r0 += cuda::kAttentionDecodeMaxRows) {
          const int64_t rows = std::min<int64_t>(cuda::kAttentionDecodeMaxRows, rows_n - r0);
          const float* gr = seg_gate != nullptr ? seg_gate + r0 * row_stride : nullptr;
          if (quantize_out) {
            cuda::attention_decode_quantized(shape, q + r0 * qd, kc, vc, rows, pos, r0, max_context_, gr, row_stride,
                                             q_stride, out + r0 * qd, out_q8 + r0 * act_row, sc, sc_floats,
                                             st);
          } else {
            cuda::attention_decode(shape, q + r0 * qd, kc, vc, rows, pos, r0, max_context_, gr, row_stride, q_stride,
                                   out + r0 * qd, sc, sc_floats, st);
          }
        }
        quantized = quantize_out;
      } else if (rows_n <= kDecodeRows) {
        cuda::attention_at(shape, q, kc, vc, rows_n, pos, max_context_, seg_gate, row_stride, q_stride, out,
                           sc, sc_floats, st);
      } else if (!tiled) {
        cuda::attention(shape, q, kc, vc, rows_n, g.pos, seg_gate, row_stride, q_stride, out, sc, sc_floats,
                        st);
      } else {
        if constexpr (std::is_same_v<std::remove_cv_t<std::remove_pointer_t<decltype(kc)>>, __half>) {
          if (cuda::attention_prefill_tc_supports(shape, kc, vc)) {  // else the F32 kernel below
            cuda::attention_prefill_tc(shape, q, kc, vc, rows_n, g.pos, seg_gate, row_stride, q_stride, out, st);
            return;
          }
        }
        cuda::attention_prefill(shape, q, kc, vc, rows_n, g.pos, seg_gate, row_stride, q_stride, out, st);
      }
    };
    if (kv_f16_) attend(L.k_cache_f16[slot].get(), L.v_cache_f16[slot].get());
    else attend(L.k_cache[slot].get(), L.v_cache[slot].get());
    return quantized;
  };
  // act_ is read as q8_0 rows only when every segment's kernel wrote its rows there; else the o
  // projection quantizes attn_ itself (the same bytes).
  bool quantized = true;
  const std::vector<MixSegment>& segs = mix_segments();
  // Decode segments fork onto the side streams (BackendOptions::segment_streams), each with its
  // own rows of the split-KV records (they are per row: attention_decode_scratch_floats), and join
  // before the o projection. Same kernels and inputs: the same bits as in order.
  const int64_t per_row = cuda::attention_decode_scratch_floats(shape, 1, max_context_);
  bool fork = segmented_ && segs.size() > 1 && !segment_streams_.empty() && cuda::attention_decode_supported(shape) &&
              n <= cuda::kAttentionDecodeMaxRows && n * per_row <= scratch;
  for (const MixSegment& g : segs) fork = fork && !(tiled_prefill_rows_ > 0 && g.rows >= tiled_prefill_rows_);
  if (!fork) {
    for (const MixSegment& g : segs) quantized = attend_segment(g, stream_, attn_scratch_.get(), scratch) && quantized;
    project_out(quantized);
    return;
  }
  CUDA_CHECK(cudaEventRecord(fork_, stream_));
  for (size_t i = 0; i < segs.size(); ++i) {
    cudaStream_t st = segment_streams_[i % segment_streams_.size()];
    CUDA_CHECK(cudaStreamWaitEvent(st, fork_, 0));
    const MixSegment& g = segs[i];
    quantized = attend_segment(g, st, attn_scratch_.get() + g.first * per_row, scratch - g.first * per_row) && quantized;
    CUDA_CHECK(cudaEventRecord(join_[i], st));
  }
  for (size_t i = 0; i < segs.size(); ++i) CUDA_CHECK(cudaStreamWaitEvent(stream_, join_[i], 0));
  project_out(quantized);
}

}  // namespace moraine::gpu_worker::cuda_impl
