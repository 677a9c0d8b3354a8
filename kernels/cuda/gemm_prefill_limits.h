// PrefillGemm's limits and the bytes of the buffers its constructor allocates from them, without
// CUDA headers: kernels/cuda/gemm_prefill.cu allocates exactly these, and the CUDA backend's
// scratch list (gpu_worker/cuda_step_scratch.h), which the coordinator sums without CUDA, reads
// the same function. Before (session 10) the scratch list restated four of PrefillGemm's
// constants and only a GPU test (CudaBackend.ScratchIsTheListedBuffers) caught drift.
#pragma once
#include <cstddef>
#include <cstdint>

namespace moraine::cuda {

struct PrefillGemmLimits {
  int64_t max_tokens = 8192;  // rows of X (n) per call, and the highest expert row end
  int64_t max_cols = 4096;    // columns (K) of any weight matrix
  // Dequantized weight elements held at once: a dense matrix larger than this runs in slabs of
  // rows (the 151936 x 2048 output head in 16 slabs at the default, 2 bytes each: 40 MiB), and
  // experts run in chunks of as many whole matrices as fit (13 of 768 x 2048).
  int64_t weight_workspace_elems = int64_t{20} << 20;
  int max_experts = 256;      // expert groups per matmul_experts call
  // X elements rounded to 16 bits at once (n x cols of one matmul, end row x cols of one
  // matmul_experts); 0: max_tokens x max_cols. The CUDA backend's expert rows are at most
  // n_embd or n_ff wide, its dense rows (a window's) up to max_cols: sizing by both halves the
  // 30B shape's buffer (256 -> 128 MiB at 4096-row windows).
  int64_t input_elems = 0;
  int64_t input_capacity() const { return input_elems > 0 ? input_elems : max_tokens * max_cols; }
};

// What NVIDIA recommends for Hopper (cuBLAS docs, cublasSetWorkspace): 32 MiB.
inline constexpr uint64_t kPrefillGemmCublasBytes = uint64_t{32} << 20;
// The grouped kernel's tile tables are a ring of this many parts (gemm_prefill.h, kTableRing).
inline constexpr int kPrefillGemmTableRing = 4;
// The fewest tokens of an expert_gemm token tile (Small and Tall; expert_gemm.cu asserts it):
// a group of count rows needs at most count / 32 + 1 tiles.
inline constexpr int64_t kExpertMinTileTokens = 32;
// sizeof(ExpertGemmTile) (expert_gemm.h asserts it): four int32.
inline constexpr uint64_t kExpertGemmTileBytes = 16;

struct PrefillGemmBuffers {
  uint64_t weight_bytes = 0;   // the 16-bit weight workspace
  uint64_t input_bytes = 0;    // X rounded to 16 bits, input_capacity() elements
  uint64_t cublas_bytes = 0;   // cuBLAS workspace
  int64_t tile_capacity = 0;   // tile entries per table part
  uint64_t table_part_bytes = 0;  // tile_capacity entries, then max_experts weight pointers
  uint64_t table_bytes() const { return kPrefillGemmTableRing * table_part_bytes; }  // device; pinned mirror alike
};

// Valid for limits PrefillGemm's constructor accepts (it checks them first).
inline PrefillGemmBuffers prefill_gemm_buffers(const PrefillGemmLimits& lim) {
  PrefillGemmBuffers b;
  b.weight_bytes = static_cast<uint64_t>(lim.weight_workspace_elems) * sizeof(uint16_t);
  b.input_bytes = static_cast<uint64_t>(lim.input_capacity()) * sizeof(uint16_t);
  b.cublas_bytes = kPrefillGemmCublasBytes;
  // Each selected group adds at most count / 32 + 1 token tiles; the selected counts sum to at
  // most max_tokens.
  b.tile_capacity = lim.max_experts + lim.max_tokens / kExpertMinTileTokens + 1;
  b.table_part_bytes = kExpertGemmTileBytes * static_cast<uint64_t>(b.tile_capacity) +
                       sizeof(const void*) * static_cast<uint64_t>(lim.max_experts);
  return b;
}

}  // namespace moraine::cuda
