// The CUDA backend's class, private to gpu_worker/ (cuda_backend.h is the public face: only
// make_cuda_backend). The members are defined by idea, one file each:
//   cuda_backend.cu          the layer-by-layer calls (embed, layer_whole / begin / end, logits),
//                            the expert path's setup, a step's host side, make_cuda_backend
//   cuda_backend_upload.cu   construction: weights to the device (matrices, stacked q | k | v,
//                            expert slabs and the slot table, DeltaNet weights), the step scratch
//   cuda_backend_graph.cu    a whole step captured once per token count and replayed (step_whole)
//   cuda_backend_handoff.cu  the in-graph GPU <-> CPU hand-off (handoff_*)
//   cuda_backend_swap.cu     the adaptive VRAM tier's expert swaps (begin_swap / landed_swaps)
//   cuda_backend_enqueue.cu  what a step enqueues on the stream (embed, mixer, route, experts)
//   cuda_backend_layers.cu   the attention and Gated DeltaNet blocks, the recurrent state
//   cuda_backend_matmul.cu   matmuls: batched matvec or cuBLAS, the activation quantization
// capture_into is a template (layer_begin and handoff_begin capture too), so it stays here.
#pragma once
#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <iostream>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gpu_worker/cuda_backend.h"
#include "gpu_worker/cuda_step_scratch.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/delta_net.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm_prefill.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/moe_fused.h"
#include "kernels/cuda/qk_norm_rope_store.h"

namespace moraine::gpu_worker::cuda_impl {

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

struct DevLayer {
  bool recurrent = false;
  DeviceBuffer<float> attn_norm, ffn_norm, q_norm, k_norm, shared_router;
  // gpt-oss (empty when the recipe has none): q / k / v / o biases, a sink logit per head, the
  // router's logit bias, per-expert biases [n_expert][n_ff] (gate, up) and [n_expert][n_embd] (down).
  DeviceBuffer<float> q_bias, k_bias, v_bias, o_bias, sinks, router_bias, gate_bias, up_bias, down_bias;
  DeviceBuffer<float> score_bias;   // the sigmoid router's choice bias (exp_probs_b; empty: none)
  // A dense FFN layer (glm4moe's leading ones): its SwiGLU matrices; no router, no experts.
  bool dense = false;
  DevMatrix dense_gate, dense_up, dense_down;
  int64_t window = 0;   // sliding window (0: full attention)
  cuda::RopeYarn yarn;  // the layer's YaRN rotation (yarn.on false: plain RoPE)
  double rope_base = 0; // with YaRN: the RopePart's frequency base (reference::rope_neox_yarn's)
  bool clamped = false; // the routed experts' activation is the clamped SwiGLU
  DevMatrix q, k, v, o, router, shared_gate, shared_up, shared_down;
  DevMatrix attn_qkv;     // q | k | v stacked (upload_stacked); then q, k, v stay empty
  int64_t q_rows = 0;     // rows of the q projection (with the gate beside each head, if any)
  // The VRAM tier: resident experts' gate / up / down slabs and expert id -> slab index (-1).
  DevMatrix gate, up, down;      // views into expert_slabs
  DeviceBuffer<uint8_t> expert_slabs;
  std::vector<int32_t> slab_of;
  int64_t resident = 0;
  bool fused = false;   // the routed experts go through moe_fused
  // handoff_take_expert may take one of its experts: its arena part layout in take_layouts_ (-1: none)
  int take_layout = -1;
  bool q_has_gate = false;
  // Per sequence slot (BackendOptions::slots): [max_context][n_head_kv * head_dim] floats, or
  // halves with an F16 cache (the other pair empty).
  std::vector<DeviceBuffer<float>> k_cache, v_cache;
  std::vector<DeviceBuffer<__half>> k_cache_f16, v_cache_f16;
  // Gated DeltaNet (qwen3next, qwen35moe): the layer's kernel shape (its head layout), projections
  // (qwen35moe: ssm_beta over ssm_alpha stacked in ba; beta and alpha apart only when their
  // formats differ), small weights, and the recurrent state.
  cuda::DeltaNetShape delta_net_shape;
  DevMatrix qkv, z, ba, beta, alpha, ssm_out;
  DeviceBuffer<float> conv_w, ssm_a, dt_bias, ssm_norm;
  std::vector<DeviceBuffer<float>> conv_state, ssm_state;   // [slot]
};

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

// A whole step with in-graph hand-offs (handoff_begin) for one (rows, logit rows), the host
// addresses it was captured with, and which layers it runs whole (the rest hand off).
struct HandoffGraph {
  StepGraph step;
  Backend::HandoffIo io;
  std::vector<char> whole;
};

// A mixed layer's first half (layer_begin) for one token count, captured: the mixer, the router
// and the routing's copies to the host (into the addresses it was captured with), then the
// device's experts and the shared expert, which run while the host plans and the cpu workers
// work. Two launches instead of ~25 per layer: the host, not the GPU, bounded these layers
// (3-5 us per kernel launch).
struct LayerBeginGraphs {
  StepGraph route, experts;
  const void *chosen = nullptr, *weight = nullptr, *h_out = nullptr;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(const model::Model& m, const BackendOptions& o);
  ~CudaBackend() override;
  void pin_host_memory(void* p, size_t bytes) override;
  uint64_t device_bytes_in_use() const override;
  void log_device_memory(const char* stage) const;
  // Sequence slots (backend.h; issue 33): each slot its own KV caches, recurrent states, position
  // and snapshot; a step's segments (set_segments) run the mixer per segment against its slot and
  // the rest of each layer (router, experts, shared expert, lm head) once over all rows.
  int slots() const override { return slots_; }
  void select_slot(int slot) override;
  void set_segments(std::span<const Segment> segments) override;
  void reset() override;
  int64_t n_past() const override { return past_[static_cast<size_t>(selected_)]; }
  // Attention caches are written at their positions each step: dropping positions is moving
  // n_past back (the next step overwrites them). DeltaNet layers' states are copied into
  // delta_snapshot_ by snapshot() and back by a rewind to that position (cuda_backend_layers.cu).
  bool can_rewind() const override { return true; }
  void snapshot() override;
  void rewind(int64_t n_past) override;
  // Every layer's K/V rows [0, n_past) and recurrent states, copied to or from host memory.
  bool can_save_state() const override { return true; }
  size_t state_bytes() const override;
  void save_state(std::span<uint8_t> out) override;
  HostBuffer host_buffer(size_t bytes) override;   // pinned (cudaMallocHost), else pageable
  void load_state(std::span<const uint8_t> in) override;
  int64_t n_layer() const override { return m_.hp.n_layer; }
  bool layer_on_device(int64_t il) const override;
  void embed(const int32_t* tokens, int64_t n) override;
  void layer_whole(int64_t il, int64_t n, int32_t* chosen_out) override;
  void layer_begin(int64_t il, int64_t n, int32_t* chosen, float* weight, float* h_out) override;
  void experts_planned(int64_t il, int64_t n, const group::ExpertPlan& plan) override;
  void layer_end(int64_t il, int64_t n, const group::ExpertPlan& plan, const float* host_rows) override;

  void advance(int64_t n) override;   // the window stays: logits reads its last rows
  void set_window(int64_t first, int64_t rows) override;

  // The step scratch as listed (cuda_step_scratch.h) and the device-buffer bytes its allocation
  // took (cuda::device_buffer_live_bytes before and after): equal to step_scratch().total(16)
  // unless a buffer was allocated outside the list (tests/cuda/cuda_backend_golden_test checks).
  const CudaStepScratch& step_scratch() const { return scratch_; }
  uint64_t step_scratch_allocated_bytes() const { return scratch_allocated_bytes_; }

  void logits(int64_t rows, float* out) override;
  bool begin_swap(int64_t il, int32_t out, int32_t in) override;
  std::vector<std::pair<int64_t, int32_t>> landed_swaps() override;

  void step_whole(const int32_t* tokens, int64_t n, int64_t logit_rows, float* logits_out, int32_t* chosen_out,
                  int64_t chosen_stride) override;

  // ---- the in-graph hand-off (backend.h) ----

  bool handoff_supported(int64_t n) const override;
  bool handoff_begin(const int32_t* tokens, int64_t n, int64_t logit_rows, const HandoffIo& io) override;
  void handoff_wait_routed(int64_t il) override;
  void handoff_release(int64_t il, const group::ExpertPlan& plan) override;
  void handoff_finish(float* logits_out, int32_t* chosen_out, int64_t chosen_stride) override;
  void handoff_abort() override;
  bool handoff_can_take(int64_t il, int32_t e, const std::array<model::Matrix, 3>& parts) const override;
  void handoff_take_expert(int64_t il, int32_t e, const std::array<model::Matrix, 3>& parts) override;

  // ---- long steps' staged experts (backend.h) ----

  bool stage_supported(int64_t il, int64_t n) const override;
  bool stages_experts() const override { return true; }
  void stage_experts(int64_t il, std::span<const StagedExpert> experts) override;
  void prefetch_staged(int64_t il, std::span<const StagedExpert> experts) override;
  bool stage_held(int64_t il, int32_t e) const override;
  void await_staged_copies() override;
  void unstage_expert(int64_t il, int32_t e) override;

 private:
  static constexpr std::chrono::seconds kHandoffTimeout{60};

  bool embed_on_device() const { return tok_embd_.size() != 0; }

  bool pinned(const void* p, size_t bytes) const;
  // The device's address of [p, p + bytes) in memory given to pin_host_memory; nullptr when it is
  // not there or not mapped.
  void* mapped(const void* p, size_t bytes) const;
  void check_handoff_error();
  // device_expert: an expert off the device whose rows the device computes anyway (the taken one).
  std::pair<int32_t, int32_t> fill_alt_rows(int64_t il, const group::ExpertPlan& plan, int32_t device_expert = -1);
  void enqueue_handoff_step(int64_t n, int64_t rows, const HandoffIo& io, const std::vector<char>& whole);
  // Layer il's experts as moe_fused sees them with the slot table naming only expert e's copy.
  cuda::MoeLayerWeights take_weights(int64_t il, int32_t e) const;
  // Returns once the taken expert's rows are in dev_slots_ (take_done_), or throws on a CUDA error
  // or after kHandoffTimeout.
  void wait_taken();

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
  void setup_swaps(bool all_experts);
  void set_table_entry(int64_t il, int32_t e, const cuda::MoeExpertSlot& v);
  void choose_expert_paths();
  CudaStepScratchOptions scratch_options() const;
  void setup_experts();
  static bool fused_formats(const DevLayer& L);
  cuda::MoeLayerWeights fused_weights(int64_t il) const;

  // ---- host side of a step ----

  void begin_step(const int32_t* tokens, int64_t n);
  void finish_step(int64_t rows, float* out);
  void copy_to_host(void* dst, const void* src, size_t bytes);
  bool capture(StepGraph& g, int64_t n, int64_t rows);

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

  void enqueue_embed(int64_t n);
  void enqueue_layer_whole(int64_t il, int64_t n, bool copy_chosen);
  void enqueue_mixer(int64_t il, int64_t n);
  void norm_h(const float* x, const float* w, int64_t n, const DevMatrix& consumer);
  void enqueue_route(int64_t il, int64_t n);
  void enqueue_fused_experts(int64_t il, int64_t n, bool into_residual = false);
  // moe_fused over the step's routing of layer il in kMoeMaxTokens-token groups, on `stream`.
  void fused_experts(const cuda::MoeLayerWeights& w, int64_t il, int64_t n, bool into_residual,
                     DeviceBuffer<uint8_t>& workspace, cudaStream_t stream);
  void enqueue_matvec_experts(int64_t il, int64_t n, const group::ExpertPlan& plan);
  // The staged experts' rows [first_row, ...) of expert_in_ (staged_list_ order, each expert's
  // rows contiguous) through the PrefillGemm, stage_slots_ experts a round.
  void enqueue_staged_experts(int64_t il, const group::ExpertPlan& plan, int64_t first_row);
  // One staged expert's gate / up / down from host memory into a stage slot (`off`: the layer's
  // ArenaLayout::part_offsets), on stream_.
  void copy_staged(const StagedExpert& x, uint8_t* to, const std::array<size_t, 3>& off, cudaStream_t stream);
  void check_staged(int64_t il, const StagedExpert& x) const;
  void record_stage_copied();
  // The per-expert path's activation and down bias (SwiGLU; gpt-oss's biases and clamped SwiGLU).
  static bool oss_experts(const DevLayer& L) {
    return L.gate_bias.size() != 0 || L.up_bias.size() != 0 || L.down_bias.size() != 0 || L.clamped;
  }
  void expert_activation(int64_t il, int64_t first, int64_t rows);
  void expert_down_bias(int64_t il, int64_t first, int64_t rows);
  void enqueue_shared(int64_t il, int64_t n);
  // A dense layer's FFN into the residual (x_ += down(silu(gate h) * up h)), its routing slots -1.
  void enqueue_dense_ffn(int64_t il, int64_t n);
  void enqueue_combine(int64_t il, int64_t n, bool with_cpu_rows);
  // The head over `rows` rows of the step starting at row `first` (default: the step's last
  // rows), into logits_ (at most logits_rows_ rows).
  // A segmented step (set_segments): each segment's last logit_rows rows, gathered first (rows:
  // their sum).
  void enqueue_logits(int64_t rows) {
    if (!segmented_) {
      enqueue_logits(step_n_ - rows, rows);
      return;
    }
    enqueue_gather_logit_rows();
    enqueue_head(y_.get(), rows);
  }
  void enqueue_logits(int64_t first, int64_t rows) { enqueue_head(xw() + first * m_.hp.n_embd, rows); }

  // ---- layers ----

  cuda::DeltaNetShape delta_shape() const;
  void upload_layer(int64_t il, const std::vector<int32_t>& ids, std::vector<cuda::MoeExpertSlot>& table);
  void allocate_scratch();
  void upload_delta_net(const model::DeltaNetWeights& W, const model::DeltaNetPart& part, DevLayer& D);
  void delta_net_gate_rows(const DevLayer& L, int64_t n);
  void zero_states();
  void zero_slot_states(int slot);
  void copy_states(bool save);   // the selected slot's recurrent states to (save) or from its delta_snapshot_ part
  void delta_net_block(DevLayer& L, int64_t n);
  cuda::AttentionShape attention_shape() const;
  void attention_block(DevLayer& L, int64_t n);
  void matmul_into_residual(const DevMatrix& W, const float* x, int64_t n);
  void matmul(const DevMatrix& W, const float* x, int64_t n, float* y);
  bool use_gemm(const DevMatrix& W, int64_t n) const;
  bool gemm_experts(const DevLayer& L, int64_t n) const;
  void expert_matmul(const DevMatrix& W, const float* x, int64_t rows, const int32_t* slab_ids, float* y);
  void run_matvec(const DevMatrix& W, const float* x, int64_t n, float* y, cuda::MatvecBatch& b);

  // The current device is per host thread: a backend built on one thread and stepped on another
  // must select its device again (a no-op when it already is the current one).
  void use_device() const { CUDA_CHECK(cudaSetDevice(device_)); }

  void check_layer(int64_t il) const;
  void check_step(int64_t il, int64_t n) const;

  const model::Model& m_;
  const int device_;
  const int64_t max_tokens_, tiled_prefill_rows_, gemm_prefill_rows_;
  const bool prefill_gemm_f16_;       // BackendOptions::prefill_gemm_f16
  const int take_expert_from_;        // BackendOptions::take_expert_from
  const int stage_slots_;             // BackendOptions::stage_experts (0 without off-device experts)
  const int64_t long_step_rows_;      // BackendOptions::long_step_rows
  const int64_t max_context_;
  const bool kv_f16_;   // the KV cache holds IEEE halves (BackendOptions::kv_type)
  int64_t logits_rows_ = 1;   // rows logits_ holds
  std::unique_ptr<cuda::PrefillGemm> gemm_;   // long steps' quantized matmuls (null: never)
  std::vector<cuda::ExpertRows> gemm_groups_;
  // step_n_: rows of the step, or of its window (set_window: rows window_first_ .. of the
  // step_rows_ that embed took); xw() is the window's residual.
  int64_t step_n_ = 0, step_rows_ = 0, window_first_ = 0;
  int64_t max_step_rows() const { return std::max(max_tokens_, long_step_rows_); }
  float* xw() const { return x_.get() + window_first_ * m_.hp.n_embd; }
  // Sequence slots: past_[s] positions cached, snapshot_pos_[s] the position of slot s's part of
  // delta_snapshot_ (-1: none since its reset); selected_: select_slot's.
  const int slots_;
  std::vector<int64_t> past_, snapshot_pos_;
  int selected_ = 0;
  // This step's segments (begin_step: set_segments' pending_, else one of the selected slot with
  // logit_rows 0, a plain step), each segment's first row in the step, and whether it came from
  // set_segments (then logits are per segment).
  std::vector<Segment> segments_, pending_;
  std::vector<int64_t> segment_first_;
  bool segmented_ = false;
  // The key of a captured graph of this step (its rows, logit rows and segments: a graph bakes in
  // each slot's caches), with `lead` values first.
  std::vector<int64_t> step_key(std::initializer_list<int64_t> lead) const;
  void check_segments(std::span<const Segment> segments) const;
  void advance_step(int64_t n);
  // The mixer's segments of the current window: rows [first, first + rows) of it on slot `slot`,
  // position word `word` of pos_dev_, host position `pos` of its first row.
  struct MixSegment {
    int slot;
    int64_t first, rows;
    int word;
    int64_t pos;
  };
  const std::vector<MixSegment>& mix_segments();
  std::vector<MixSegment> mix_;
  // BackendOptions::segment_streams: side streams a batched step's attention segments fork onto
  // (fork_ recorded on stream_, join_[i] after segment i), none when 0 or one slot.
  std::vector<cudaStream_t> segment_streams_;
  cudaEvent_t fork_ = nullptr;
  std::vector<cudaEvent_t> join_;
  // The rows logits() reads: the step's last rows, or (segmented) each segment's last logit_rows
  // rows, gathered into y_ (enqueue_gather_logit_rows) before the head runs over them.
  void enqueue_gather_logit_rows();
  void enqueue_head(const float* x, int64_t rows);
  // Slot s's recurrent states: its part of delta_snapshot_ (floats from delta_snapshot_.get()).
  size_t snapshot_floats_per_slot() const { return delta_snapshot_.size() / static_cast<size_t>(slots_); }
  cudaStream_t stream_ = nullptr;
  cudaEvent_t routed_ = nullptr;   // layer_begin: routing and h copied to the host
  cudaStream_t copy_stream_ = nullptr;   // expert copies of the adaptive VRAM tier
  std::vector<PendingSwap> swaps_;
  std::vector<void*> pinned_;      // host ranges registered by pin_host_memory
  // Weights, KV caches and the slot table: placed with little rounding waste, freed with the backend.
  cuda::DeviceArena weights_arena_;
  std::vector<DevLayer> layers_;
  DeviceBuffer<cuda::MoeExpertSlot> slot_table_;   // [layer][expert]: the VRAM tier's addresses
  DeviceBuffer<float> output_norm_;
  DevMatrix output_;
  // The embedding table in pinned host memory, read by the embed kernel (one row per token over
  // PCIe) so that its bytes go to experts (coordinator/device_reserve.h cuda_host_resident_bytes);
  // empty when embed falls back to the host dequantizer.
  cuda::PinnedBuffer<uint8_t> tok_embd_;
  CudaStepScratch scratch_;   // what the scratch buffers below were allocated from
  uint64_t scratch_allocated_bytes_ = 0;
  DeviceBuffer<float> x_, h_, y_, qg_, q_, k_new_, v_new_, attn_, attn_scratch_, router_logits_, weight_;
  DeviceBuffer<uint8_t> act_;
  // What act_ holds: act_src_'s rows quantized as act_of_h_ (F32: nothing), act_of_h_rows_ rows;
  // act_src_ is h_ after norm_h, attn_ after an attention that quantized its own output.
  // Host-side bookkeeping of the enqueue order (norm_h sets it, run_matvec clears it when it
  // quantizes something else into act_), valid inside captured graphs as well.
  TensorType act_of_h_ = TensorType::F32;
  int64_t act_of_h_rows_ = 0;
  const float* act_src_ = nullptr;
  DeviceBuffer<uint32_t> route_arrivals_;   // [max_tokens]: rms_norm_router_fused's counters
  DeviceBuffer<int32_t> chosen_, token_ids_, pos_dev_, alt_row_, expert_idx_;
  // dev_slots_: this device's expert rows in slot order; cpu_rows_: the cpu workers' packed rows.
  DeviceBuffer<float> dev_slots_, cpu_rows_;
  DeviceBuffer<float> expert_in_, expert_g_, expert_u_, expert_out_;
  DeviceBuffer<float> shared_g_, shared_u_, shared_out_, shared_logit_, logits_;
  DeviceBuffer<float> dense_g_, dense_u_;   // dense FFN layers' gate / up rows (empty without them)
  DeviceBuffer<float> mixed_, z_, ba_, core_, delta_ws_;  // Gated DeltaNet scratch
  DeviceBuffer<float> delta_snapshot_;   // the recurrent layers' conv and ssm states, in layer order
  DeviceBuffer<uint8_t> fused_ws_;
  PinnedBuffer<int32_t> tok_pinned_, pos_pinned_, alt_pinned_, idx_pinned_;
  PinnedBuffer<int32_t> chosen_pinned_;   // [layer][max_tokens * k]: routing of layer_whole layers
  // Greedy decode (Backend::set_token_output): the argmax kernel's scratch and the token it
  // writes into host memory; allocated at the first such step (finish_step).
  DeviceBuffer<uint8_t> argmax_scratch_;
  PinnedBuffer<int32_t> token_pinned_;
  int32_t* token_dev_ = nullptr;   // the device's address of token_pinned_
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
  int32_t* alt_pinned_dev_ = nullptr;       // and of alt_pinned_
  DeviceBuffer<uint64_t> handoff_seq_dev_;
  DeviceBuffer<int32_t> handoff_error_;
  uint64_t handoff_seq_ = 0;
  int64_t handoff_rows_ = 0;
  std::vector<char> handoff_whole_;   // this step's layers run whole (handoff_begin's scratch)
  // The taken expert (handoff_take_expert): its arena slot copied in, and per (part layout,
  // expert) a slot table naming only that expert's copy (built once: a take is one copy and the
  // kernels, no table write), moe_fused's workspace, all on take_stream_, which records
  // take_done_ after the kernel; take_layer_ / take_e_ while one is in flight (-1: none).
  std::vector<std::array<size_t, 3>> take_layouts_;
  cudaStream_t take_stream_ = nullptr;
  cudaEvent_t take_done_ = nullptr;
  DeviceBuffer<uint8_t> take_expert_, take_ws_;
  DeviceBuffer<cuda::MoeExpertSlot> take_tables_;
  int64_t take_layer_ = -1;
  int32_t take_e_ = -1;
  // Long steps' staged experts (stage_experts): the host's list for layer staged_layer_ (-1:
  // none), staged_[e] marking them, and stage_ holding stage_slots_ experts at a time, each at
  // ArenaLayout::part_offsets of its layer in slots of stage_slot_bytes_. layer_end copies a round
  // in on the stream and runs it through the PrefillGemm before the next round's copy.
  std::vector<StagedExpert> staged_list_;
  std::vector<uint8_t> staged_;
  int64_t staged_layer_ = -1;
  int64_t experts_queued_layer_ = -1;   // experts_planned queued this layer's plan-dependent experts
  void clear_staged() {  // the list spent (layer_end) or left by a failed step (begin_step)
    for (const StagedExpert& x : staged_list_) staged_[static_cast<size_t>(x.expert)] = 0;
    staged_list_.clear();
    staged_layer_ = -1;
    experts_queued_layer_ = -1;
  }
  DeviceBuffer<uint8_t> stage_;
  size_t stage_slot_bytes_ = 0;
  // A half of stage_ (two with BackendOptions::stage_prefetch: layer il uses half il % 2, so
  // layer il+1's copies land while layer il computes): the slots of layer `layer`'s experts
  // copied this step (slot[e], -1: none; the first `used` slots), which a long step's later
  // windows of the layer reuse. `prefetched`: copies queued on stage_stream_, `ready` recorded
  // after them (stream_ waits on it before the first GEMM); `free` after its last GEMMs.
  struct StageHalf {
    int64_t layer = -1;
    int used = 0;
    std::vector<int32_t> slot;
    bool prefetched = false;
    cudaEvent_t ready = nullptr, free = nullptr;
  };
  std::array<StageHalf, 2> stage_half_;
  // Recorded on stream_ after enqueue_staged_experts' last copy (await_staged_copies waits on it).
  cudaEvent_t stage_copied_ = nullptr;
  bool stage_copied_pending_ = false;
  StageHalf& stage_half_of(int64_t il) { return stage_half_[stage_halves_ == 2 ? static_cast<size_t>(il % 2) : 0]; }
  const StageHalf& stage_half_of(int64_t il) const {
    return stage_half_[stage_halves_ == 2 ? static_cast<size_t>(il % 2) : 0];
  }
  int stage_halves_ = 1;
  cudaStream_t stage_stream_ = nullptr;
  uint8_t* stage_half_base(int h) const { return stage_.get() + static_cast<size_t>(h) * stage_slots_ * stage_slot_bytes_; }
  void reset_stage_half(StageHalf& half, int64_t il) {
    half.layer = il;
    half.used = 0;
    std::fill(half.slot.begin(), half.slot.end(), -1);
  }
  // stream_ waits for copies still queued in a half (before its slots are read or overwritten).
  void await_stage_half(StageHalf& half) {
    if (!half.prefetched) return;
    CUDA_CHECK(cudaStreamWaitEvent(stream_, half.ready, 0));
    half.prefetched = false;
  }
  std::vector<const uint8_t*> stage_bases_;   // enqueue_staged_experts' slot per GEMM group
  std::map<std::vector<int64_t>, HandoffGraph> handoff_graphs_;   // step_key({})
  std::vector<std::pair<const char*, size_t>> pinned_ranges_;
  std::vector<char*> pinned_dev_;   // [range]: its device address (nullptr: not mapped)
  std::map<std::vector<int64_t>, LayerBeginGraphs> begin_graphs_;   // step_key({layer, window rows})
  std::map<std::vector<int64_t>, StepGraph> graphs_;   // step_key({logit rows}) -> captured step
};

}  // namespace moraine::gpu_worker::cuda_impl
