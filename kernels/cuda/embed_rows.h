// Embedding lookup: out[t] = dequantize(table row ids[t]) for n token ids, straight from the
// token_embd tensor in its GGUF format: every format the GPU decodes (dequantize_blocks.cuh, the
// prefill GEMM's decoders: F32/F16/BF16, Q8_0, the k-quants, the legacy and IQ hub types), so a
// hub file's quantized token_embd keeps the captured decode graph. Scalar reference:
// moraine::dequantize_row (common/formats/quant.h); the rows are bit-identical to it.
//
// Memory contract (device or mapped pinned host memory): table holds n_vocab rows of row_bytes
// bytes (blocks read at 2-byte alignment, F32 at 4); ids [n] int32 in 0..n_vocab-1 (checked on
// the host by the caller: an id out of range reads outside the table); out [n][n_cols] floats.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/formats/tensor_type.h"

namespace moraine::cuda {

bool embed_rows_supported(TensorType t);

// Throws std::invalid_argument for an unsupported type or n_cols not a multiple of the block.
void embed_rows(TensorType t, const void* table, size_t row_bytes, int64_t n_cols, const int32_t* ids, int64_t n,
                float* out, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
