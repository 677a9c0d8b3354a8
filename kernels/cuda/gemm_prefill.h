// Prefill matrix products through cuBLAS: Y[n][rows] = X[n][cols] W^T for a weight matrix W of
// rows x cols in its GGUF layout on the device (any format dequantize_weights.h expands). W (or
// a slab of its rows, when it is larger than the workspace) is expanded to BF16 (or F16, see
// GemmInput) in a reusable device workspace, X is rounded to the same type, and cublasGemmEx
// multiplies them with F32 accumulation into F32 Y. Why: the matvec kernels (matvec.h) decode
// every weight block once per token row: pp512 at the Qwen3-30B shape ran 299 tok/s that way
// where llama.cpp reaches 6200 (issue #5); attn_q 4096 x 2048 at n = 8192 takes 236 us here (66%
// of the BF16 peak; docs/perf-log.md). A MoE layer's experts (matmul_experts) go through the
// grouped kernel of expert_gemm.h instead: one launch for all experts of a workspace chunk, or
// with weights decoded in the kernel, one launch for the layer (ExpertPath).
//
// Accuracy: each product sees x and w rounded once to the 16-bit type (relative error at most
// u = 2^-8 for BF16, 2^-11 for F16), summed in float: |Y - X W^T| <= ((1+u)^2 - 1 + gamma) *
// sum_k |x_k w_k| per output, gamma for the float sum (tests/cuda/gemm_prefill_test.cpp).
//
// One object per stream: it owns a cuBLAS handle bound to that stream and every buffer it needs
// (sized by PrefillGemmLimits at construction: prefill_gemm_buffers, gemm_prefill_limits.h); calls allocate nothing, enqueue work on the
// stream and return without waiting, except that matmul_experts' grouped paths wait (on the host)
// for the upload of their tile table from kTableRing calls before, which is long done in a
// pipeline but makes those calls unfit for stream capture. Not thread-safe; calls on one object
// are stream-ordered.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/formats/tensor_type.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/dequantize_weights.h"
#include "kernels/cuda/expert_gemm.h"
#include "kernels/cuda/gemm_prefill_limits.h"

struct cublasContext;  // cublasHandle_t, without making every includer see cublas_v2.h

namespace moraine::cuda {

bool prefill_gemm_supported(TensorType weight);  // = dequantize_weights_supported

// Rows [first_row, first_row + count) of X and Y belong to the expert whose weight matrix
// (rows x cols, GGUF layout) starts at `weight` (a device pointer).
struct ExpertRows {
  const void* weight = nullptr;
  int64_t first_row = 0;
  int64_t count = 0;
};

class PrefillGemm {
 public:
  PrefillGemm(cudaStream_t stream, const PrefillGemmLimits& limits, GemmInput input = GemmInput::BF16);
  ~PrefillGemm();
  PrefillGemm(const PrefillGemm&) = delete;
  PrefillGemm& operator=(const PrefillGemm&) = delete;

  // Y[i][r] (row stride ldy >= rows; 0 means rows) = sum_k X[i][k] W[r][k] for i < n, or
  // += when accumulate. cols must be a multiple of 32 and of the block size; x 16-byte aligned,
  // n*cols floats; y n rows. Throws std::invalid_argument naming the problem for a bad type,
  // shape, pointer or a size over the limits; std::runtime_error for a CUDA or cuBLAS failure.
  void matmul(TensorType weight, const void* w, int64_t rows, int64_t cols, const float* x, int64_t n, float* y,
              int64_t ldy = 0, bool accumulate = false);

  // The same product for F32 weights, entirely in F32 (cuBLAS with CUBLAS_COMPUTE_32F: no TF32,
  // no 16-bit rounding; only the order of the sums differs from the matvec's). Any cols and
  // pointers aligned as floats; n up to max_tokens. The per-row matvec reads the whole matrix
  // once per row: the Qwen3-Next router (512 x 2048 F32) took ~150 us per 512-row step that way
  // (session 10 run A, CUPTI trace of an 80B prefill).
  void matmul_f32(const float* w, int64_t rows, int64_t cols, const float* x, int64_t n, float* y, int64_t ldy = 0);

  // One MoE layer's expert matrices (all rows x cols of one type) over X rows grouped per expert:
  // Y[i][r] = sum_k X[i][k] W_e[r][k] for the rows i of each group with count >= min_rows; the
  // Y rows of smaller groups are left untouched (the caller may run those through the matvec
  // path). X and Y are indexed by absolute row (y row stride ldy, 0 means rows). The selected
  // groups' counts must sum to at most max_tokens (true of disjoint groups). Returns the rows
  // computed. The experts run in chunks of as many whole matrices as fit the weight workspace:
  // per chunk one dequantize_weights launch and one expert_gemm launch (expert_gemm.h) over all
  // of the chunk's groups (one cublasGemmEx per expert cost ~12 us each whatever its rows).
  //
  // reuse_input: X is the previous matmul_experts call's x, unchanged (same pointer and cols,
  // its contents the caller's promise), so the 16-bit copy that call made is used again instead
  // of rounding X anew: the gate and up products of a MoE layer share their X (~15 us of ~400 per
  // layer at pp512 on Qwen3-30B-A3B, estimated). Same bits as rounding again. Throws std::invalid_argument when the previous
  // call was not matmul_experts on this x and cols, or covered fewer rows, or rounded nothing.
  int64_t matmul_experts(TensorType weight, std::span<const ExpertRows> experts, int64_t rows, int64_t cols,
                         const float* x, float* y, int64_t min_rows = 1, int64_t ldy = 0, bool reuse_input = false);

  // How matmul_experts multiplies. Expanded: per chunk, dequantize_weights into the workspace
  // and one expert_gemm launch. Fused: one expert_gemm_fused launch for the whole layer, weights
  // decoded in the kernel (q4_k or q6_k with 16-byte aligned matrices; other calls take the
  // Expanded path); same bits as Expanded. CublasLoop: expand, then one cublasGemmEx per expert.
  // Auto (the default; a forced path is for the test and the bench): Fused where it applies;
  // else Expanded up to kExpandedMaxMeanRows rows per group on average, CublasLoop above (the
  // loop's per-call cost is amortized there). q4_k, 128 x (768 x 2048) at pp512, us loop /
  // expanded / fused: 2005 / 640 / 137 (docs/perf-log.md has the runs).
  enum class ExpertPath : uint8_t { Auto, Expanded, Fused, CublasLoop };
  static constexpr int64_t kExpandedMaxMeanRows = 256;
  // Auto takes fused q6_k only up to this many rows per group on average: where the expanded and
  // fused times of a q6_k down 128 x (2048 x 768) cross (~354 rows; docs/perf-log.md).
  static constexpr int64_t kQ6FusedMaxMeanRows = 352;
  void set_expert_path(ExpertPath p) { path_ = p; }
  ExpertPath expert_path() const { return path_; }
  bool last_call_fused() const { return last_fused_; }
  // The grouped kernel's tile shape: chosen per call from the group sizes (the widest of Wide,
  // Large whose padding of the token tiles stays within a quarter, else Small), or forced
  // (tests, bench).
  void force_expert_tiles(std::optional<ExpertTiles> shape) { forced_tiles_ = shape; }
  ExpertTiles last_expert_tiles() const { return last_tiles_; }  // what the last grouped call used

  GemmInput input_type() const { return input_; }
  const PrefillGemmLimits& limits() const { return limits_; }

 private:
  void gemm(const void* a, const void* b, float* c, int64_t m, int64_t n, int64_t k, int64_t ldc, bool accumulate);
  ExpertTiles choose_tiles(std::span<const ExpertRows> experts) const;

  cudaStream_t stream_;
  PrefillGemmLimits limits_;
  GemmInput input_;
  ExpertPath path_ = ExpertPath::Auto;
  bool last_fused_ = false;
  std::optional<ExpertTiles> forced_tiles_;
  ExpertTiles last_tiles_ = ExpertTiles::Large;
  cublasContext* handle_ = nullptr;
  DeviceBuffer<uint16_t> weights_;       // dequantized weights (16-bit elements)
  DeviceBuffer<uint16_t> inputs_;        // X rounded to the input type
  // What inputs_ holds (reuse_input): rows [0, rounded_rows_) of rounded_x_ with rounded_cols_
  // columns; rounded_x_ is null when it holds nothing reusable (after matmul).
  const float* rounded_x_ = nullptr;
  int64_t rounded_rows_ = 0, rounded_cols_ = 0;
  DeviceBuffer<uint8_t> cublas_space_;   // cuBLAS workspace, set once on the handle
  // The grouped kernel's tile tables, a ring of kTableRing parts used by successive calls: a call
  // fills its part of the pinned mirror once that part's previous upload (kTableRing calls ago)
  // has run, so the host may run that many calls ahead of the GPU before it waits.
  static constexpr int kTableRing = kPrefillGemmTableRing;
  int64_t tile_capacity_ = 0;            // tile entries per part; then max_experts weight pointers
  size_t part_bytes_ = 0;
  DeviceBuffer<uint8_t> table_;          // kTableRing parts
  uint8_t* staged_table_ = nullptr;      // pinned host mirror of table_
  cudaEvent_t staged_free_[kTableRing] = {};  // recorded after each part's upload
  int next_part_ = 0;
  std::vector<ExpertGemmTile> tile_list_;  // this call's tiles, built on the host
  std::vector<int64_t> chunk_tiles_;       // index in tile_list_ where each chunk's tiles start
  std::vector<int> selected_;            // indices of the experts a call runs
  std::vector<const void*> chunk_weights_;  // a chunk's matrices; the fused call's, all of them
};

}  // namespace moraine::cuda
