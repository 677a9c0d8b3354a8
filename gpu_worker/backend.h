// What the gpu_worker asks of a device: the dense part of each layer (mixer, router, shared
// expert, the weighted sum of expert outputs) and the routed experts the placement put on it,
// with the residual stream, KV cache and recurrent state kept on the device between calls. Two
// implementations: CUDA (cuda_backend.h) and CPU (the reference kernels, so the whole group runs
// and is tested on machines without a GPU).
//
// A step of n tokens: embed, then per layer either layer_whole (every routed expert of the layer
// is on this device: no host round trip) or layer_begin / [cpu workers] / layer_end, then advance
// and logits. Only routing, h for the cpu workers and the cpu workers' rows cross to the host.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/model/kv_type.h"
#include "common/model/model.h"
#include "coordinator/group_layout.h"

namespace moraine::gpu_worker {

struct BackendOptions {
  int device = 0;              // GPU index (cuda)
  int max_tokens = 1;          // rows of one step, or of one window of a long step
  // Rows of a long step (GroupManifest::long_step_rows, Backend::set_window); 0: none.
  int long_step_rows = 0;
  int64_t max_context = 0;     // positions the KV cache holds; 0: kDefaultContext
  // The KV cache's element type (CUDA; the CPU backend holds F32): the gpu_worker takes it from
  // the placement (coordinator --kv-type), which charged its bytes against --vram.
  model::KvType kv_type = model::KvType::F32;
  int threads = 0;             // CPU backend threads (0: all)
  // The routed experts this device computes: every expert when all_experts, else per layer the
  // ascending ids in device_experts[layer] (the placement's VRAM tier).
  bool all_experts = true;
  std::vector<std::vector<int32_t>> device_experts;
  // Steps of at least this many rows take the tiled prefill attention (CUDA; not bit-identical
  // to decode); 0: never (every row through the split-KV kernel, as decode). Over an F16 KV cache
  // the tensor-core kernel (attention_prefill_tc.h) where it takes the shape, else (F32 caches,
  // other head sizes) the F32 tiled kernel (attention_prefill.h).
  int64_t tiled_prefill_rows = 64;
  // Steps of at least this many rows multiply quantized weights through cuBLAS (BF16 inputs, F32
  // sums: kernels/cuda/gemm_prefill.h) instead of the per-row matvec, the resident experts too;
  // 0: never. Within BF16 rounding of the matvec path, not equal to it.
  int64_t gemm_prefill_rows = 64;
  // The cuBLAS path's 16-bit inputs: BF16 (the default: no overflow) or F16 (8x finer rounding,
  // range 65504): the golden tests measure how far the BF16 rounding alone moves a model's logits.
  bool prefill_gemm_f16 = false;
  // The hand-off (gpu_worker): at a layer where one cpu worker has at least this many experts to
  // compute, the device copies one of them in from the RAM tier over PCIe and computes it itself
  // (handoff_take_expert), beside the worker's share; 0: never (then the CUDA backend allocates
  // no buffer for it). Off by default: slower on the H200 host, whose 16 cores already stream
  // its DRAM (30B, 12G, from 3 experts on: 137.9-161.0 tok/s against 153.4-169.1 off; the runs
  // in docs/perf-log.md). For hosts whose DRAM outruns their cores.
  int take_expert_from = 0;
  // Long steps (prefill: at least gemm_prefill_rows rows, CUDA): the device computes the RAM-tier
  // experts a layer uses itself, their arena slots copied in over PCIe in rounds of this many
  // experts through a buffer of as many slots (stage_experts, Backend::stage_supported), instead
  // of the cpu workers computing them for every row; 0: never (no buffer, the arena not pinned).
  // Why: a layer's ~45 RAM-tier experts cross the bus in ~2.4 ms where the workers took ~13 ms
  // for a 512-row step (30B, 12G: pp512 661 -> 2375 tok/s, decode unchanged; docs/perf-log.md).
  // The coordinator's reserve holds the buffer (~21 MB at the 30B shape).
  int stage_experts = 8;
  // ... from steps of this many rows (the gpu_worker's choice): a step uses ~45 RAM-tier experts
  // from ~100 rows on (~2.4 ms over the bus at the 30B shape) while the workers take ~25 us a
  // row, so below ~100 rows the workers are quicker.
  int stage_min_rows = 128;
  // ... this share of a layer's RAM-tier experts, those with the most rows in the step first
  // (the gpu_worker's choice; ties at the last one's row count staged too): the cpu workers
  // compute the others at the same time (the device's part is queued before they start,
  // Backend::experts_planned). 1: all of them, since the workers' share sets the time where the
  // device is faster (30B pp512 at 12G: 2668 tok/s all staged, 1887 at 0.75; docs/perf-log.md).
  double stage_share = 1.0;
  // ... and the FILE-tier experts of such a step that the cpu workers' file cache holds (the
  // gpu_worker's choice, gpu_worker/file_stage.h): copied from their cache slots as the RAM-tier
  // ones are, checked against the slot's seqlock once landed. Why: the 80B shape at --vram 12G
  // --ram 32G prefilled 486 tok/s with the workers computing every FILE expert for every row,
  // against 3,747 with everything in RAM (bench/RESULTS.md, "The 80B shape"); at prefill the
  // read-ahead has read the layer's FILE experts anyway, so only the bus copy is added.
  bool stage_file = true;
  // CPU backend: stage as the CUDA backend does (stage_supported for any layer with routed
  // experts), computing staged experts with the reference kernel from copies made when they are
  // staged, so that the gpu_worker's staging protocol (the FILE tier's fill, check and redo)
  // runs in CI without a GPU. Off: the CPU backend stages nothing, as before.
  bool cpu_stage = false;
  // Fault injection (gpu_worker --fault-tear-file-copies): this many of each window's FILE-tier
  // copies are reported torn (gpu_worker/file_stage.h), so the recovery path runs in tests.
  int fault_tear_file_copies = 0;
  // Long steps (long_step_rows): layer il+1's RAM-tier experts are copied in on a stream of their
  // own while layer il computes (Backend::prefetch_staged), into the other half of a stage buffer
  // twice the size; false: each layer's copies run in order before its GEMMs.
  bool stage_prefetch = true;
  // Sequence slots (issue 33): how many sequences the backend caches at once (each its own KV
  // cache and recurrent state), so a step can carry rows of several of them (Backend::set_segments).
  // 1: one cached sequence, as before.
  int slots = 1;
  // A batched step's attention, one launch per segment, on up to this many streams at once (CUDA;
  // segments of decode rows only): the segments' kernels are small (a few heads x splits each) and
  // in order they added up per layer. 0: in order on the step's stream.
  int segment_streams = 4;
};

// Rows of one sequence slot in a step (Backend::set_segments): the step's rows are the segments'
// in order. first_position must be the slot's n_past (a rewind comes before the step);
// logit_rows: logits (and greedy tokens) of this segment's last logit_rows rows, 1..rows.
struct Segment {
  int32_t slot = 0;
  int64_t first_position = 0;
  int64_t rows = 0;
  int64_t logit_rows = 1;
};

// A RAM-tier expert a long step's device computes (Backend::stage_experts): its gate / up / down
// rows in host memory (GGUF layout; an arena slot, coordinator/group_layout.h, or the model's
// own mapping).
struct StagedExpert {
  int32_t expert = -1;
  std::array<model::Matrix, 3> parts;
};

inline constexpr int64_t kDefaultContext = 8192;

class Backend {
 public:
  virtual ~Backend() = default;
  // Sequence slots (BackendOptions::slots). select_slot: the slot the per-sequence calls act on
  // (reset, n_past, snapshot, rewind, state_bytes / save_state / load_state, mtp_*) and a step
  // without set_segments runs on; 0 at the start. set_segments: the next step (its embed, or
  // step_whole / handoff_begin) carries these segments' rows, in order, n = the sum of their
  // rows: every mixer runs per segment against its slot's cache, the rest of each layer (router,
  // experts, shared expert, combine) once over all the rows, and logits(R) with R = the sum of the
  // segments' logit_rows gives each segment's last logit_rows rows, segment by segment (greedy
  // tokens likewise). Distinct slots; std::invalid_argument for a bad segment list. A backend
  // without slots takes one segment of slot 0 at its n_past (the step it runs anyway).
  virtual int slots() const { return 1; }
  virtual void select_slot(int slot) {
    if (slot != 0) throw std::logic_error("this backend has one sequence slot, not slot " + std::to_string(slot));
  }
  virtual void set_segments(std::span<const Segment> segments) {
    if (segments.size() != 1 || segments[0].slot != 0 || segments[0].first_position != n_past())
      throw std::logic_error("this backend runs steps of one sequence (slot 0 at its cached position), not " +
                             std::to_string(segments.size()) + " segments");
  }
  virtual void reset() = 0;   // forget the cached sequence
  virtual int64_t n_past() const = 0;
  // Speculation (StepHeader::rewind): drop the cached positions from n_past on, the draft tokens
  // a verify step rejected. Attention caches are overwritten in place, so any n_past will do; a
  // recurrent (DeltaNet) state cannot be taken back token by token, so a model with one rewinds
  // only to the position of its last snapshot() (StepHeader::snapshot, before a verify step),
  // whose saved states come back. A backend that cannot throws std::logic_error.
  virtual bool can_rewind() const { return false; }
  virtual void snapshot() { throw std::logic_error("this backend cannot snapshot its recurrent state"); }
  virtual void rewind(int64_t n_past) {
    throw std::logic_error("this backend cannot rewind its cache to " + std::to_string(n_past) + " positions");
  }
  // MTP drafts (StepHeader::mtp): the model's first nextn block, as the reference executor runs it
  // (executor.h, mtp_forward). mtp_step, after a step's logits() (any path), runs the MTP head over
  // the step's rows `tokens` [0, n) up to row base_row (the slots whose next token is settled: slot
  // i takes position i's output-normed hidden and token i+1) and then, with max_drafts > 0, drafts
  // up to max_drafts tokens greedily after base_row, base_token first (each draft's slot takes the
  // MTP head's own output row and the draft before it); the drafted slots are dropped again.
  // Returns the drafts written, or -1 when the head cannot follow the sequence (a step without
  // mtp_step since the last reset(), a load_state, a rewind past what it kept): then no drafts until
  // reset(). mtp_skip: a step that ran without mtp_step. rewind() takes the head back with the
  // trunk. A backend without it (can_mtp false) throws std::logic_error.
  virtual bool can_mtp() const { return false; }
  virtual int64_t mtp_step(const int32_t* tokens, int64_t n, int64_t base_row, int32_t base_token, int64_t max_drafts,
                           int32_t* drafts) {
    (void)tokens, (void)n, (void)base_row, (void)base_token, (void)max_drafts, (void)drafts;
    throw std::logic_error("this backend has no MTP head (can_mtp is false)");
  }
  virtual void mtp_skip() {}
  // The conversation cache (StepHeader::state_save / state_load, the gpu_worker's state store):
  // the cached sequence (every attention layer's K/V at positions [0, n_past()), every recurrent
  // state) as bytes in host memory (model/sequence_state.h, the backend's own layout), and back:
  // load_state makes that sequence the cached one (n_past() is its length; no snapshot since).
  // Between steps only. load_state throws std::invalid_argument for bytes of another shape.
  // save_state writes exactly state_bytes() bytes (the sequence as it is now) into memory from
  // host_buffer, which a device backend pins so that the copies run at the bus rate (30B, 5,100
  // cached positions: 508 MB; into pageable memory a save and a load took ~1.3 s on the H200).
  virtual bool can_save_state() const { return false; }
  virtual size_t state_bytes() const { return 0; }
  virtual void save_state(std::span<uint8_t> out) {
    (void)out;
    throw std::logic_error("this backend cannot save its cached sequence");
  }
  struct HostBuffer {
    std::shared_ptr<uint8_t> data;
    size_t capacity = 0;
  };
  virtual HostBuffer host_buffer(size_t bytes) {
    return {std::shared_ptr<uint8_t>(new uint8_t[bytes], std::default_delete<uint8_t[]>()), bytes};
  }
  virtual void load_state(std::span<const uint8_t> in) {
    (void)in;
    throw std::logic_error("this backend cannot load a saved sequence");
  }
  // Host memory the backend will copy to and from at every step (the exchange segment): a device
  // backend pins it once so those copies are direct DMA. Optional.
  virtual void pin_host_memory(void* p, size_t bytes) { (void)p, (void)bytes; }
  // Device memory in use now, as the driver reports it for the whole device (every process:
  // on a machine given to the group, the gpu_worker's own). 0 for a backend without a device.
  virtual uint64_t device_bytes_in_use() const { return 0; }
  // Starts a step: the n tokens' embeddings become the residual.
  virtual void embed(const int32_t* tokens, int64_t n) = 0;
  // Whether every routed expert of layer il is computed on this device.
  virtual bool layer_on_device(int64_t il) const = 0;
  // Layer il without the host (only when layer_on_device(il)): mixer, router, experts, combine.
  // The routing ids [n][k] are copied to chosen_out (nullable) asynchronously: valid once the
  // step's logits() returned.
  virtual void layer_whole(int64_t il, int64_t n, int32_t* chosen_out) = 0;
  // Layer il up to its routing: mixer, normalised MoE input h, router. On return chosen and
  // weight [n][k] hold the routing, and h_out [n][n_embd] (nullable) the MoE input the cpu
  // workers read. The device's own experts of the layer may already be running.
  virtual void layer_begin(int64_t il, int64_t n, int32_t* chosen, float* weight, float* h_out) = 0;
  // Optional, between layer_begin(il) and layer_end(il) with the plan layer_end will get, once the
  // host has it and before the cpu workers start: the device's own work that needs the plan (a
  // long step's resident experts through the GEMM, its staged experts) is queued now, so it runs
  // while the workers compute theirs. Without the call layer_end queues it.
  virtual void experts_planned(int64_t il, int64_t n, const group::ExpertPlan& plan) { (void)il, (void)n, (void)plan; }
  // Finishes layer il: adds to the residual the route-weighted expert outputs in top-k order
  // (the device's own; for a slot whose expert is not on this device, packed row
  // plan.row_of[slot] of host_rows, as the cpu workers wrote it) and the shared expert.
  virtual void layer_end(int64_t il, int64_t n, const group::ExpertPlan& plan, const float* host_rows) = 0;
  virtual void advance(int64_t n) = 0;   // the step's positions are now cached
  // Long steps (BackendOptions::long_step_rows): embed takes up to long_step_rows rows; then the
  // host runs each layer over windows of at most max_tokens rows, in order (set_window(first,
  // rows), then the window's layer_whole or layer_begin / layer_end with n = rows), so that what a
  // layer needs from the host (its staged experts) crosses PCIe once for all the step's rows. A
  // window's rows sit at positions n_past() + first ..; the step's last window must end at its
  // last row before advance(whole step) and logits. embed resets the window to the whole step.
  virtual void set_window(int64_t first, int64_t rows) {
    (void)first, (void)rows;
    throw std::logic_error("this backend runs no long steps (BackendOptions::long_step_rows)");
  }
  // Logits of the step's last `rows` rows (after advance).
  virtual void logits(int64_t rows, float* out) = 0;

  // Whether every layer is layer_on_device: then a step can go through step_whole.
  bool all_on_device() const {
    for (int64_t il = 0; il < n_layer(); ++il)
      if (!layer_on_device(il)) return false;
    return true;
  }
  // A whole step when all_on_device(): embed, every layer_whole, advance, logits of the last
  // logit_rows rows. chosen_out (nullable): layer il's routing at chosen_out + il * chosen_stride.
  // A device backend may replay a captured graph here.
  virtual void step_whole(const int32_t* tokens, int64_t n, int64_t logit_rows, float* logits_out,
                          int32_t* chosen_out, int64_t chosen_stride) {
    embed(tokens, n);
    for (int64_t il = 0; il < n_layer(); ++il)
      layer_whole(il, n, chosen_out != nullptr ? chosen_out + il * chosen_stride : nullptr);
    advance(n);
    logits(logit_rows, logits_out);
  }
  virtual int64_t n_layer() const = 0;

  // Greedy decode (StepHeader::greedy_token): while `token` is set, every call that produces a
  // step's logits (logits, step_whole, handoff_finish) of R rows also puts the argmax of each
  // logits row (sampling::argmax's rule) in token[0 .. R) (at most kMaxTokenRows rows), and a
  // backend that computes it where the logits are may leave the logits rows unwritten: the CUDA
  // backend copies the ids, not the 607 KB rows. nullptr: logits only, as always. nonfinite (with
  // token): also each row's first non-finite logit in nonfinite[0 .. R), coded as
  // StepReply::nonfinite (-1: none).
  void set_token_output(int32_t* token, int32_t* nonfinite = nullptr) {
    token_out_ = token;
    nonfinite_out_ = token != nullptr ? nonfinite : nullptr;
  }

 protected:
  int32_t* token_out_ = nullptr;
  int32_t* nonfinite_out_ = nullptr;

 public:

  // A step with cpu workers, launched whole (a device backend that can: the CUDA one replays one
  // captured graph): the device runs every layer in order; at each layer that is not
  // layer_on_device it copies the routing and h into `io` (host memory pinned by
  // pin_host_memory), raises a flag and waits until the host releases the layer; the host
  // meanwhile walks those layers: handoff_wait_routed(il), has the cpu workers write the rows
  // the plan names into io.host_rows, handoff_release(il, plan). handoff_finish ends the step
  // (advance and logits included); after a failure on the host side, handoff_abort lets the
  // device run to the end and the sequence must be reset. Layers stay the same for the whole
  // step: layer_on_device does not change between steps' begin_swap / landed_swaps.
  struct HandoffIo {
    int32_t* chosen = nullptr;     // [n][k]
    float* weight = nullptr;       // [n][k]
    float* h = nullptr;            // [n][n_embd]: what the cpu workers read
    const float* host_rows = nullptr;   // the cpu workers' packed rows, plan.row_of order
  };
  virtual bool handoff_supported(int64_t n) const { return (void)n, false; }
  // False when the backend could not start it after all (nothing started: run the step layer
  // by layer).
  virtual bool handoff_begin(const int32_t* tokens, int64_t n, int64_t logit_rows, const HandoffIo& io) {
    (void)tokens, (void)n, (void)logit_rows, (void)io;
    no_handoff();
  }
  virtual void handoff_wait_routed(int64_t il) { (void)il, no_handoff(); }
  virtual void handoff_release(int64_t il, const group::ExpertPlan& plan) { (void)il, (void)plan, no_handoff(); }
  // Logits of the last logit_rows rows to logits_out; chosen_out as in step_whole.
  virtual void handoff_finish(float* logits_out, int32_t* chosen_out, int64_t chosen_stride) {
    (void)logits_out, (void)chosen_out, (void)chosen_stride;
    no_handoff();
  }
  virtual void handoff_abort() {}
  // Between handoff_wait_routed(il) and handoff_release(il): this device computes routed expert
  // e of layer il itself, from its gate / up / down rows in host memory (`parts`: the matrices'
  // data in memory given to pin_host_memory, GGUF rows in an arena slot, coordinator/
  // group_layout.h), so the cpu workers skip it; handoff_release then takes the device's rows for
  // e's slots (the plan's rows of e in io.host_rows are not read). handoff_can_take says whether
  // it can (no buffer for it, a format its kernels do not take, e already on the device, one
  // expert already taken for this layer, memory not pinned: no) without starting anything, so
  // the caller can tell the cpu workers and ring them first; handoff_take_expert then must be
  // called, and throws std::logic_error where handoff_can_take says no.
  virtual bool handoff_can_take(int64_t il, int32_t e, const std::array<model::Matrix, 3>& parts) const {
    return (void)il, (void)e, (void)parts, false;
  }
  virtual void handoff_take_expert(int64_t il, int32_t e, const std::array<model::Matrix, 3>& parts) {
    (void)il, (void)e, (void)parts;
    throw std::logic_error("this backend takes no expert off the cpu workers (handoff_can_take is false)");
  }

  // Long steps: whether this backend computes, for layer il of a step of n rows, the off-device
  // experts the host names with stage_experts (BackendOptions::stage_experts). Between layer_begin(il) and
  // layer_end(il) the host then names layer il's experts it wants computed here (each with rows
  // in the plan, none on the device): layer_end computes their slots as its own (their rows in
  // host_rows are not read), and the cpu workers must skip them. Calls name distinct experts of
  // one layer and add to the list; layer_end clears it. std::logic_error where stage_supported(il,
  // n) is false or an expert is on the device or named twice; std::invalid_argument for parts
  // that are not the layer's expert shape.
  virtual bool stage_supported(int64_t il, int64_t n) const { return (void)il, (void)n, false; }
  // Whether this backend stages at all (stage_supported can say yes for some step): the gpu_worker
  // maps and pins the RAM tier (the arena) for staging only for a backend that copies its experts
  // in from there.
  virtual bool stages_experts() const { return false; }
  // Long steps: layer il's experts that the host will stage in this step, to be copied in now,
  // beside the layers before il (a backend with BackendOptions::stage_prefetch; others ignore it):
  // stage_experts(il, ...) of these experts later in the step then uses the copies. Same checks
  // as stage_experts; at most as many experts as a layer's stage slots (more are not prefetched).
  virtual void prefetch_staged(int64_t il, std::span<const StagedExpert> experts) { (void)il, (void)experts; }
  virtual void stage_experts(int64_t il, std::span<const StagedExpert> experts) {
    (void)il, (void)experts;
    throw std::logic_error("this backend computes no off-device experts (stage_supported is false)");
  }
  // Staging from memory that another process may overwrite (the FILE tier's file-cache slots,
  // read under their seqlock, gpu_worker/file_stage.h): stage_held says whether expert e's copy
  // from an earlier window of this step is still on the device for layer il (a stage_experts of
  // it then copies nothing again); await_staged_copies returns once every copy the staged
  // experts queued so far has landed (their source bytes may change after it); unstage_expert,
  // between experts_planned / stage_experts and layer_end, drops the device's rows of staged
  // expert e (its copy was found torn): layer_end takes e's rows from host_rows as for an expert
  // not on the device, and the copy is not kept for later windows.
  virtual bool stage_held(int64_t il, int32_t e) const { return (void)il, (void)e, false; }
  virtual void await_staged_copies() {}
  virtual void unstage_expert(int64_t il, int32_t e) {
    (void)il, (void)e;
    throw std::logic_error("this backend computes no off-device experts (stage_supported is false)");
  }

 private:
  [[noreturn]] static void no_handoff() {
    throw std::logic_error("this backend has no in-graph hand-off (handoff_supported is false)");
  }

 public:

  // The VRAM tier adapting while running (called between steps only). begin_swap: expert `out`
  // of layer il is no longer computed here from now on and `in` is copied into its place in the
  // background; false when this backend cannot (the CPU backend, a copy already pending for
  // `out`'s slot, `out` not here or `in` already here). landed_swaps: the swaps whose copy has
  // landed since the last call, as (layer, expert): those experts are computed here from the next
  // step on.
  virtual bool begin_swap(int64_t il, int32_t out, int32_t in) { return (void)il, (void)out, (void)in, false; }
  virtual std::vector<std::pair<int64_t, int32_t>> landed_swaps() { return {}; }
};

// The layer parts each backend implements (backend_support.cpp); make_backend refuses a model
// whose recipes use another (model::check_supported names the layer, part and backend).
const model::BackendSupport& cpu_backend_support();
const model::BackendSupport& cuda_backend_support();

// `kind` "cpu" or "cuda"; throws std::runtime_error for a backend this build does not have.
std::unique_ptr<Backend> make_backend(const std::string& kind, const model::Model& m, const BackendOptions& o);

}  // namespace moraine::gpu_worker
