// Prefill matrix products through cuBLAS: Y[n][rows] = X[n][cols] W^T for a weight matrix W of
// rows x cols in its GGUF layout on the device (any format dequantize_weights.h expands). W (or
// a slab of its rows, when it is larger than the workspace) is expanded to BF16 (or F16, see
// GemmInput) in a reusable device workspace, X is rounded to the same type, and cublasGemmEx
// multiplies them with F32 accumulation into F32 Y. Why: the matvec kernels (matvec.h) decode
// every weight block once per token row; at pp512 on the Qwen3-30B shape that path ran 299 tok/s
// on the H200 where llama.cpp reaches 6200 (issue #5). Measured with this path (H200, q4_k,
// moraine-kernel-bench cuda --gemm-only; plain cublasGemmEx BF16 peak 882 TFLOP/s): attn_q
// 4096 x 2048 at n = 512 takes 33 us (260 TFLOP/s; expansion 14 us, cuBLAS alone 15 us), at
// n = 8192 236 us (583 TFLOP/s, 66% of peak).
//
// Accuracy: each product sees x and w rounded once to the 16-bit type (relative error at most
// u = 2^-8 for BF16, 2^-11 for F16), summed in float: |Y - X W^T| <= ((1+u)^2 - 1 + gamma) *
// sum_k |x_k w_k| per output, gamma for the float sum (tests/cuda/gemm_prefill_test.cpp).
//
// One object per stream: it owns a cuBLAS handle bound to that stream and every buffer it needs
// (sized by PrefillGemmLimits at construction); calls allocate nothing, enqueue work on the
// stream and return without waiting. Not thread-safe; calls on one object are stream-ordered.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/formats/tensor_type.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/dequantize_weights.h"

struct cublasContext;  // cublasHandle_t, without making every includer see cublas_v2.h

namespace moraine::cuda {

bool prefill_gemm_supported(TensorType weight);  // = dequantize_weights_supported

struct PrefillGemmLimits {
  int64_t max_tokens = 8192;  // rows of X (n) per call, and the highest expert row end
  int64_t max_cols = 4096;    // columns (K) of any weight matrix
  // Dequantized weight elements held at once: a dense matrix larger than this runs in slabs of
  // rows (the 151936 x 2048 output head in 16 slabs at the default, 2 bytes each: 40 MiB), and
  // experts run in chunks of as many whole matrices as fit (13 of 768 x 2048).
  int64_t weight_workspace_elems = int64_t{20} << 20;
  int max_experts = 256;      // expert groups per matmul_experts call
};

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

  // One MoE layer's expert matrices (all rows x cols of one type) over X rows grouped per expert:
  // Y[i][r] = sum_k X[i][k] W_e[r][k] for the rows i of each group with count >= min_rows; the
  // Y rows of smaller groups are left untouched (the caller runs those through the matvec path,
  // where one decoded block per row costs less than expanding the whole matrix). X and Y are
  // indexed by absolute row (y row stride ldy, 0 means rows). Returns the rows computed.
  // Choosing min_rows (H200, q4_k, 128 experts, moraine-kernel-bench cuda --gemm-only): the GEMM
  // path costs about 12 us per expert whatever its rows up to 512 (1.5 ms for 128 experts:
  // expansion plus one small cuBLAS call each), the matvec about 0.46 us per row for 768 x 2048
  // and 0.75 us for 2048 x 768; so min_rows of about 24 (gate/up) and 16 (down).
  int64_t matmul_experts(TensorType weight, std::span<const ExpertRows> experts, int64_t rows, int64_t cols,
                         const float* x, float* y, int64_t min_rows = 1, int64_t ldy = 0);

  // Experts run as one cublasGemmEx each (default) or, when set_grouped(true), as one
  // cublasGemmGroupedBatchedEx per workspace chunk; if cuBLAS refuses the grouped call
  // (NOT_SUPPORTED or INVALID_VALUE) the object switches to the loop for good. Off by default
  // because cuBLAS 13.1 on the H200 refuses it for BF16 in / F32 out (NOT_SUPPORTED, measured by
  // moraine-kernel-bench cuda --gemm-only), so trying costs a wasted call and a host sync.
  void set_grouped(bool on) { grouped_ = on; }
  bool grouped() const { return grouped_; }
  const std::string& grouped_off_reason() const { return grouped_off_reason_; }  // empty unless it fell back

  GemmInput input_type() const { return input_; }
  const PrefillGemmLimits& limits() const { return limits_; }

 private:
  void gemm(const void* a, const void* b, float* c, int64_t m, int64_t n, int64_t k, int64_t ldc, bool accumulate);
  // Chunk [c0, c0 + count) of selected_, its matrices dequantized in workspace slots 0..count-1.
  bool grouped_gemm(std::span<const ExpertRows> experts, int c0, int count, int64_t rows, int64_t cols, float* y,
                    int64_t ldy);

  cudaStream_t stream_;
  PrefillGemmLimits limits_;
  GemmInput input_;
  bool grouped_ = false;
  std::string grouped_off_reason_;
  cublasContext* handle_ = nullptr;
  DeviceBuffer<uint16_t> weights_;       // dequantized weights (16-bit elements)
  DeviceBuffer<uint16_t> inputs_;        // X rounded to the input type
  DeviceBuffer<uint8_t> cublas_space_;   // cuBLAS workspace, set once on the handle
  DeviceBuffer<const void*> group_ptrs_; // A, B, C pointer arrays of the grouped call, 3 * max_experts
  const void** staged_ptrs_ = nullptr;   // pinned host mirror of group_ptrs_
  cudaEvent_t staged_free_ = nullptr;    // recorded after the last upload of staged_ptrs_
  struct GroupedArgs;                    // host arrays of the grouped call (gemm_prefill.cu)
  std::unique_ptr<GroupedArgs> args_;
  std::vector<int> selected_;            // indices of the experts a call runs
  std::vector<const void*> chunk_weights_;
};

}  // namespace moraine::cuda
