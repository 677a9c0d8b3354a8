// One MoE layer's expert products in ONE launch: for every group g of a chunk,
//   Y[first_row_g + i][r] = sum_k X[first_row_g + i][k] * W_g[r][k]   (i < count_g, r < rows),
// on 16-bit operands (BF16 or F16, GemmInput) that dequantize_weights / convert_gemm_input have
// already written, with F32 accumulation on the tensor cores (mma.sync m16n8k16, ldmatrix,
// cp.async multi-stage tiles) and F32 output with row stride ldy. Why: PrefillGemm ran one
// cublasGemmEx per expert (cublasGemmGroupedBatchedEx refuses BF16 in / F32 out), about 12 us
// per expert matrix whatever its rows on the H200, most of a pp512 step on Qwen3-30B-A3B.
//
// The grid is flattened by a tile table built on the host (expert_gemm_tiles): one entry per
// token tile of a group (its workspace slot, first X/Y row, tokens in the tile); blockIdx.y
// walks the tiles of weight rows. Groups of any size (0 included: no entry) share the launch.
//
// Accuracy: each output is the float sum, in K order within each 16-wide block, of the exact
// products of the 16-bit operands: the contract of gemm_prefill.h holds unchanged.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "common/formats/tensor_type.h"
#include "kernels/cuda/dequantize_weights.h"
#include "kernels/cuda/gemm_prefill_limits.h"

namespace moraine::cuda {

// One token tile of one group: tokens [x_row, x_row + count) of X and Y (count 1..tile tokens)
// against the weight matrix in workspace slot `slot`.
struct ExpertGemmTile {
  int32_t slot = 0;
  int32_t x_row = 0;
  int32_t count = 0;
  int32_t unused = 0;  // pads the entry to 16 bytes (one vector load)
};
static_assert(sizeof(ExpertGemmTile) == kExpertGemmTileBytes, "gemm_prefill_limits.h sizes the tile tables");

// Tile shapes (weight rows x tokens, warps): Wide 128 x 128 (2 x 2 warps of 64 x 64: 32 mma per
// 8 ldmatrix, for long groups), Large 128 x 64 (4 x 2 warps of 32 x 32), Tall 128 x 32 (4 x 2
// warps of 32 x 16) and Small 64 x 32 (2 x 2 warps of 32 x 16) for groups of a few dozen tokens,
// where a wider tile would be mostly padding and a chunk would launch too few CTAs.
enum class ExpertTiles : uint8_t { Large, Small, Wide, Tall };
int expert_tile_rows(ExpertTiles shape);    // 64 (Small) or 128
int expert_tile_tokens(ExpertTiles shape);  // 128 (Wide), 64 (Large) or 32
const char* expert_tiles_name(ExpertTiles shape);  // "large", "small", "wide", "tall"

// Appends the token tiles of a group (first_row, count >= 0; none when count is 0) to `out`.
void expert_gemm_tiles(ExpertTiles shape, int32_t slot, int64_t first_row, int64_t count,
                       std::vector<ExpertGemmTile>& out);

// Runs the tiles[0 .. n_tiles) (a device array) of one chunk: weight slot s is the rows x cols
// matrix at weights + s * slot_stride elements (row-major, K contiguous), X is x (row-major,
// cols per row), Y is y (row stride ldy >= rows). cols a multiple of 32; weights, x 16-byte
// aligned; slot_stride a multiple of 8. Throws std::invalid_argument naming the problem for a
// bad shape or pointer, std::runtime_error for a launch failure. n_tiles = 0 launches nothing.
void expert_gemm(GemmInput type, ExpertTiles shape, const void* weights, int64_t slot_stride, int64_t rows,
                 int64_t cols, const void* x, const ExpertGemmTile* tiles, int n_tiles, float* y, int64_t ldy,
                 cudaStream_t stream = nullptr);

// The same product with the weights decoded inside the kernel from their GGUF bytes (no
// expansion pass, no workspace: one launch for a whole layer): weight_of is a DEVICE array of
// per-slot matrix pointers (rows x cols in the GGUF layout, each 16-byte aligned, which the
// caller must check). Bit-identical to dequantize_weights + expert_gemm with the same tiles.
// Why: expanding 128 x 3 expert matrices writes and re-reads ~1.2 GB of 16-bit weights per
// layer. Q4_K and Q6_K (cols a multiple of 256).
bool expert_gemm_fused_supported(TensorType weight);
void expert_gemm_fused(TensorType weight, GemmInput type, ExpertTiles shape, const void* const* weight_of, int64_t rows,
                       int64_t cols, const void* x, const ExpertGemmTile* tiles, int n_tiles, float* y, int64_t ldy,
                       cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
