// PrefillGemm (gemm_prefill.h): dequantize into the workspace, then cuBLAS. cuBLAS is
// column-major, so the row-major product Y[n][rows] = X[n][cols] W^T is computed as its
// transpose Y^T (rows x n, leading dimension ldy) = op_T(W) (W row-major is a cols x rows
// column-major matrix, lda = cols) * X^T (cols x n column-major, ldb = cols).
#include "kernels/cuda/gemm_prefill.h"

#include <cublas_v2.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"

#define CUBLAS_CHECK(call)                                                                              \
  do {                                                                                                  \
    const cublasStatus_t moraine_cublas_status_ = (call);                                               \
    if (moraine_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                                \
      throw std::runtime_error(std::string("cuBLAS error ") + cublasGetStatusName(moraine_cublas_status_) + \
                               " in " #call " at " __FILE__ ":" + std::to_string(__LINE__));           \
  } while (0)

namespace moraine::cuda {
namespace {

// Slabs of a large dense matrix start on multiples of 64 rows, so each slab's Y columns stay
// 256-byte aligned for any ldy that is (cuBLAS picks its fastest kernels for aligned C).
constexpr int64_t kSlabRowAlign = 64;

cudaDataType_t cuda_type(GemmInput t) { return t == GemmInput::BF16 ? CUDA_R_16BF : CUDA_R_16F; }

std::string describe(TensorType t, int64_t rows, int64_t cols) {
  return " (weight " + std::string(type_name(t)) + ", " + std::to_string(rows) + " x " + std::to_string(cols) + ")";
}

void check_weight_shape(const char* who, TensorType t, int64_t rows, int64_t cols, int64_t ldy,
                        const PrefillGemmLimits& lim) {
  if (!dequantize_weights_supported(t))
    throw std::invalid_argument(std::string(who) + ": unsupported weight type" + describe(t, rows, cols) +
                                "; supported: q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, mxfp4, q4_0, q4_1, q5_0, q5_1, iq4_nl, "
                                "iq4_xs, tq1_0, tq2_0, the iq grid types, f16, bf16, f32");
  const int64_t block = type_traits(t).block_elems;
  if (rows <= 0 || rows > (int64_t{1} << 30) || cols <= 0 || cols % 32 != 0 || cols % block != 0 || cols > lim.max_cols)
    throw std::invalid_argument(std::string(who) + ": rows must be in 1..2^30 and cols a multiple of 32 and of " +
                                std::to_string(block) + " up to max_cols " + std::to_string(lim.max_cols) +
                                describe(t, rows, cols));
  if (ldy < rows || ldy > (int64_t{1} << 31) - 1)
    throw std::invalid_argument(std::string(who) + ": ldy " + std::to_string(ldy) + " is below rows" + describe(t, rows, cols));
}

}  // namespace

bool prefill_gemm_supported(TensorType weight) { return dequantize_weights_supported(weight); }

PrefillGemm::PrefillGemm(cudaStream_t stream, const PrefillGemmLimits& limits, GemmInput input)
    : stream_(stream), limits_(limits), input_(input) {
  if (limits.max_tokens < 1 || limits.max_tokens > (int64_t{1} << 30) || limits.max_cols < 32 ||
      limits.max_cols % 32 != 0 || limits.max_experts < 1 || limits.max_experts > (1 << 20) ||
      limits.weight_workspace_elems < limits.max_cols * kSlabRowAlign || limits.input_elems < 0 ||
      (limits.input_elems > 0 && limits.input_elems < limits.max_cols))
    throw std::invalid_argument("PrefillGemm: limits need max_tokens in 1..2^30, max_cols a positive multiple of 32, "
                                "max_experts >= 1, weight_workspace_elems >= 64 * max_cols and input_elems 0 or at "
                                "least max_cols (got max_tokens " +
                                std::to_string(limits.max_tokens) + ", max_cols " + std::to_string(limits.max_cols) +
                                ", workspace " + std::to_string(limits.weight_workspace_elems) + ", input_elems " +
                                std::to_string(limits.input_elems) + ")");
  // The sizes the CUDA backend's scratch list reads too (gemm_prefill_limits.h).
  const PrefillGemmBuffers sizes = prefill_gemm_buffers(limits);
  weights_ = DeviceBuffer<uint16_t>(static_cast<size_t>(sizes.weight_bytes / sizeof(uint16_t)));
  inputs_ = DeviceBuffer<uint16_t>(static_cast<size_t>(sizes.input_bytes / sizeof(uint16_t)));
  cublas_space_ = DeviceBuffer<uint8_t>(static_cast<size_t>(sizes.cublas_bytes));
  tile_capacity_ = sizes.tile_capacity;
  part_bytes_ = static_cast<size_t>(sizes.table_part_bytes);
  table_ = DeviceBuffer<uint8_t>(static_cast<size_t>(sizes.table_bytes()));
  tile_list_.reserve(static_cast<size_t>(tile_capacity_));
  chunk_tiles_.reserve(static_cast<size_t>(limits.max_experts) + 1);
  selected_.reserve(static_cast<size_t>(limits.max_experts));
  chunk_weights_.reserve(static_cast<size_t>(limits.max_experts));
  CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&staged_table_), kTableRing * part_bytes_));
  for (cudaEvent_t& e : staged_free_) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  CUBLAS_CHECK(cublasCreate(&handle_));
  // The stream first: cublasSetStream resets the handle's workspace to cuBLAS's own pool.
  CUBLAS_CHECK(cublasSetStream(handle_, stream_));
  CUBLAS_CHECK(cublasSetWorkspace(handle_, cublas_space_.get(), cublas_space_.size()));
  CUBLAS_CHECK(cublasSetPointerMode(handle_, CUBLAS_POINTER_MODE_HOST));
}

PrefillGemm::~PrefillGemm() {
  // No throws from a destructor: errors here would surface on the next CUDA call anyway.
  if (handle_ != nullptr) cublasDestroy(handle_);
  for (cudaEvent_t e : staged_free_)
    if (e != nullptr) cudaEventDestroy(e);
  if (staged_table_ != nullptr) cudaFreeHost(staged_table_);
}

void PrefillGemm::gemm(const void* a, const void* b, float* c, int64_t m, int64_t n, int64_t k, int64_t ldc,
                       bool accumulate) {
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  const cudaDataType_t t = cuda_type(input_);
  CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(m), static_cast<int>(n),
                            static_cast<int>(k), &alpha, a, t, static_cast<int>(k), b, t, static_cast<int>(k), &beta, c,
                            CUDA_R_32F, static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void PrefillGemm::matmul(TensorType weight, const void* w, int64_t rows, int64_t cols, const float* x, int64_t n,
                         float* y, int64_t ldy, bool accumulate) {
  if (ldy == 0) ldy = rows;
  check_weight_shape("PrefillGemm::matmul", weight, rows, cols, ldy, limits_);
  if (n < 1 || n > limits_.max_tokens)
    throw std::invalid_argument("PrefillGemm::matmul: n = " + std::to_string(n) + " not in 1..max_tokens " +
                                std::to_string(limits_.max_tokens) + describe(weight, rows, cols));
  if (n * cols > limits_.input_capacity())
    throw std::invalid_argument("PrefillGemm::matmul: " + std::to_string(n) + " rows of " + std::to_string(cols) +
                                " columns exceed the input buffer's " + std::to_string(limits_.input_capacity()) +
                                " elements" + describe(weight, rows, cols));
  if (w == nullptr || x == nullptr || y == nullptr)
    throw std::invalid_argument("PrefillGemm::matmul: null weight, input or output pointer" + describe(weight, rows, cols));
  rounded_x_ = nullptr;  // inputs_ now holds this call's X, which matmul_experts must not reuse
  convert_gemm_input(x, n * cols, input_, inputs_.get(), stream_);
  const int64_t fit = limits_.weight_workspace_elems / cols;
  const int64_t slab = std::min(rows, fit / kSlabRowAlign * kSlabRowAlign);
  const size_t rb = row_bytes(weight, cols);
  for (int64_t r0 = 0; r0 < rows; r0 += slab) {
    const int64_t here = std::min(slab, rows - r0);
    const void* part = static_cast<const uint8_t*>(w) + static_cast<size_t>(r0) * rb;
    dequantize_weights(weight, &part, 1, here * cols, input_, weights_.get(), stream_);
    gemm(weights_.get(), inputs_.get(), y + r0, here, n, cols, ldy, accumulate);
  }
}

void PrefillGemm::matmul_f32(const float* w, int64_t rows, int64_t cols, const float* x, int64_t n, float* y,
                             int64_t ldy) {
  if (ldy == 0) ldy = rows;
  if (rows < 1 || cols < 1 || ldy < rows || rows > INT32_MAX || cols > INT32_MAX || ldy > INT32_MAX)
    throw std::invalid_argument("PrefillGemm::matmul_f32: bad shape " + std::to_string(rows) + " x " +
                                std::to_string(cols) + " (ldy " + std::to_string(ldy) + ")");
  if (n < 1 || n > limits_.max_tokens)
    throw std::invalid_argument("PrefillGemm::matmul_f32: n = " + std::to_string(n) + " not in 1..max_tokens " +
                                std::to_string(limits_.max_tokens));
  if (w == nullptr || x == nullptr || y == nullptr)
    throw std::invalid_argument("PrefillGemm::matmul_f32: null weight, input or output pointer");
  const float alpha = 1.0f, beta = 0.0f;
  CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(rows), static_cast<int>(n),
                            static_cast<int>(cols), &alpha, w, CUDA_R_32F, static_cast<int>(cols), x, CUDA_R_32F,
                            static_cast<int>(cols), &beta, y, CUDA_R_32F, static_cast<int>(ldy), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
}

int64_t PrefillGemm::matmul_experts(TensorType weight, std::span<const ExpertRows> experts, int64_t rows, int64_t cols,
                                    const float* x, float* y, int64_t min_rows, int64_t ldy, bool reuse_input) {
  if (ldy == 0) ldy = rows;
  check_weight_shape("PrefillGemm::matmul_experts", weight, rows, cols, ldy, limits_);
  if (experts.size() > static_cast<size_t>(limits_.max_experts))
    throw std::invalid_argument("PrefillGemm::matmul_experts: " + std::to_string(experts.size()) +
                                " expert groups, more than max_experts " + std::to_string(limits_.max_experts) +
                                describe(weight, rows, cols));
  const int64_t elems = rows * cols;
  if (elems > limits_.weight_workspace_elems)
    throw std::invalid_argument("PrefillGemm::matmul_experts: one expert matrix does not fit the weight workspace of " +
                                std::to_string(limits_.weight_workspace_elems) + " elements" + describe(weight, rows, cols));
  if (x == nullptr || y == nullptr)
    throw std::invalid_argument("PrefillGemm::matmul_experts: null input or output pointer" + describe(weight, rows, cols));
  selected_.clear();
  int64_t end_row = 0, computed = 0;
  for (size_t i = 0; i < experts.size(); ++i) {
    const ExpertRows& e = experts[i];
    if (e.first_row < 0 || e.count < 0 || e.first_row + e.count > limits_.max_tokens || e.weight == nullptr)
      throw std::invalid_argument("PrefillGemm::matmul_experts: group " + std::to_string(i) + " (rows " +
                                  std::to_string(e.first_row) + " + " + std::to_string(e.count) +
                                  ") is outside 0..max_tokens " + std::to_string(limits_.max_tokens) +
                                  " or has a null weight" + describe(weight, rows, cols));
    if (e.count == 0 || e.count < min_rows) continue;
    selected_.push_back(static_cast<int>(i));
    end_row = std::max(end_row, e.first_row + e.count);
    computed += e.count;
  }
  if (reuse_input && (x != rounded_x_ || cols != rounded_cols_ || end_row > rounded_rows_))
    throw std::invalid_argument("PrefillGemm::matmul_experts: reuse_input, but the previous call " +
                                (rounded_x_ == nullptr ? std::string("left no rounded X (not matmul_experts, or none)")
                                                       : "rounded rows 0.." + std::to_string(rounded_rows_) + " of " +
                                                             std::to_string(rounded_cols_) + " columns at another x") +
                                " where this call needs rows 0.." + std::to_string(end_row) + " of " +
                                std::to_string(cols) + describe(weight, rows, cols));
  if (selected_.empty()) return 0;
  if (computed > limits_.max_tokens)  // the tile table is sized for max_tokens rows in all
    throw std::invalid_argument("PrefillGemm::matmul_experts: the selected groups' rows sum to " +
                                std::to_string(computed) + ", more than max_tokens " +
                                std::to_string(limits_.max_tokens) + " (do the groups overlap?)" +
                                describe(weight, rows, cols));
  if (end_row * cols > limits_.input_capacity())
    throw std::invalid_argument("PrefillGemm::matmul_experts: rows 0.." + std::to_string(end_row) + " of " +
                                std::to_string(cols) + " columns exceed the input buffer's " +
                                std::to_string(limits_.input_capacity()) + " elements" + describe(weight, rows, cols));
  if (!reuse_input) {
    convert_gemm_input(x, end_row * cols, input_, inputs_.get(), stream_);
    rounded_x_ = x;
    rounded_rows_ = end_row;
    rounded_cols_ = cols;
  }
  const int per_chunk = static_cast<int>(std::min<int64_t>(limits_.weight_workspace_elems / elems, limits_.max_experts));
  const int total = static_cast<int>(selected_.size());
  const auto group = [&](int s) -> const ExpertRows& { return experts[static_cast<size_t>(selected_[static_cast<size_t>(s)])]; };
  const auto expand_chunk = [&](int c0, int count) {
    chunk_weights_.clear();
    for (int i = 0; i < count; ++i) chunk_weights_.push_back(group(c0 + i).weight);
    dequantize_weights(weight, chunk_weights_.data(), count, elems, input_, weights_.get(), stream_);
  };
  const bool fusable = expert_gemm_fused_supported(weight) &&
                       std::all_of(selected_.begin(), selected_.end(), [&](int i) {
                         return reinterpret_cast<uintptr_t>(experts[static_cast<size_t>(i)].weight) % 16 == 0;
                       });
  const bool loop = path_ == ExpertPath::CublasLoop ||
                    (path_ == ExpertPath::Auto && !fusable && computed > kExpandedMaxMeanRows * total);
  last_fused_ = false;
  if (loop) {
    for (int c0 = 0; c0 < total; c0 += per_chunk) {
      const int count = std::min(per_chunk, total - c0);
      expand_chunk(c0, count);
      for (int i = 0; i < count; ++i) {
        const ExpertRows& e = group(c0 + i);
        gemm(weights_.get() + static_cast<size_t>(i) * static_cast<size_t>(elems),
             inputs_.get() + static_cast<size_t>(e.first_row * cols), y + e.first_row * ldy, rows, e.count, cols, ldy,
             false);
      }
    }
    return computed;
  }
  // The grouped kernels: every chunk's tiles in one table (slot = index in the chunk; for the
  // fused kernel one chunk of all groups, slot = index in selected_, with the weight pointers).
  const bool auto_fused = weight != TensorType::Q6_K || computed <= kQ6FusedMaxMeanRows * total;
  const bool fused = (path_ == ExpertPath::Fused || (path_ == ExpertPath::Auto && auto_fused)) && fusable;
  last_fused_ = fused;
  const int chunk = fused ? total : per_chunk;
  const ExpertTiles shape = forced_tiles_ ? *forced_tiles_ : choose_tiles(experts);
  last_tiles_ = shape;
  tile_list_.clear();
  chunk_tiles_.clear();
  for (int c0 = 0; c0 < total; c0 += chunk) {
    chunk_tiles_.push_back(static_cast<int64_t>(tile_list_.size()));
    for (int i = 0; i < std::min(chunk, total - c0); ++i)
      expert_gemm_tiles(shape, i, group(c0 + i).first_row, group(c0 + i).count, tile_list_);
  }
  chunk_tiles_.push_back(static_cast<int64_t>(tile_list_.size()));
  if (static_cast<int64_t>(tile_list_.size()) > tile_capacity_)  // cannot happen after the check above
    throw std::logic_error("PrefillGemm::matmul_experts: " + std::to_string(tile_list_.size()) +
                           " token tiles overflow the table of " + std::to_string(tile_capacity_));
  const int part = next_part_;
  next_part_ = (next_part_ + 1) % kTableRing;
  CUDA_CHECK(cudaEventSynchronize(staged_free_[part]));  // this part's previous upload has run
  uint8_t* host = staged_table_ + static_cast<size_t>(part) * part_bytes_;
  uint8_t* dev = table_.get() + static_cast<size_t>(part) * part_bytes_;
  const size_t ptr_at = sizeof(ExpertGemmTile) * static_cast<size_t>(tile_capacity_);
  std::copy(tile_list_.begin(), tile_list_.end(), reinterpret_cast<ExpertGemmTile*>(host));
  size_t upload = sizeof(ExpertGemmTile) * tile_list_.size();
  if (fused) {
    const void** ptrs = reinterpret_cast<const void**>(host + ptr_at);
    for (int i = 0; i < total; ++i) ptrs[i] = group(i).weight;
    upload = ptr_at + sizeof(const void*) * static_cast<size_t>(total);
  }
  CUDA_CHECK(cudaMemcpyAsync(dev, host, upload, cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaEventRecord(staged_free_[part], stream_));
  const auto* dev_tiles = reinterpret_cast<const ExpertGemmTile*>(dev);
  if (fused) {
    expert_gemm_fused(weight, input_, shape, reinterpret_cast<const void* const*>(dev + ptr_at), rows, cols,
                      inputs_.get(), dev_tiles, static_cast<int>(tile_list_.size()), y, ldy, stream_);
    return computed;
  }
  for (int c0 = 0, c = 0; c0 < total; c0 += per_chunk, ++c) {
    expand_chunk(c0, std::min(per_chunk, total - c0));
    const int64_t t0 = chunk_tiles_[static_cast<size_t>(c)], t1 = chunk_tiles_[static_cast<size_t>(c) + 1];
    expert_gemm(input_, shape, weights_.get(), elems, rows, cols, inputs_.get(), dev_tiles + t0,
                static_cast<int>(t1 - t0), y, ldy, stream_);
  }
  return computed;
}

// Wider token tiles do more work per CTA and per ldmatrix (and, fused, decode each weight for
// more tokens), but pad every group to a multiple of their tokens: the widest shape whose padding
// stays within a quarter of the rows. One shape per call: choosing per group (one launch per
// shape) measured slower, the launches run one after another and the wide one has few CTAs
// (session 10 run B, 128 x (768 x 2048), Zipf split: fused pp512 201 us mixed vs 188 all small;
// expanded pp512 1122 vs 656, pp8192 2445 vs 1559 all wide).
ExpertTiles PrefillGemm::choose_tiles(std::span<const ExpertRows> experts) const {
  for (ExpertTiles shape : {ExpertTiles::Wide, ExpertTiles::Large}) {
    const int64_t bn = expert_tile_tokens(shape);
    int64_t rows = 0, padded = 0;
    for (int s : selected_) {
      const int64_t c = experts[static_cast<size_t>(s)].count;
      rows += c;
      padded += (c + bn - 1) / bn * bn;
    }
    if (padded * 4 <= rows * 5) return shape;
  }
  return ExpertTiles::Small;
}

}  // namespace moraine::cuda
