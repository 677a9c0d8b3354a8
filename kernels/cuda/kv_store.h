// Copy of new K or V rows into a KV cache at a position read from device memory, for CUDA graph
// capture (the decode step is one graph per token: a captured cudaMemcpy would bake the
// destination address in). Row t of src goes to cache + (*pos0_dev + t) * row_floats.
//
// Memory contract (device pointers, floats): src [rows][row_floats] packed; cache holds at least
// max_pos positions of row_floats. The caller guarantees 0 <= *pos0_dev and
// *pos0_dev + rows <= max_pos; a device value outside that cannot be thrown from inside a graph,
// so the kernel then writes nothing (never out of bounds); attention_at gives NaN at that position.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moraine::cuda {

void kv_store_at(const float* src, float* cache, int64_t rows, int64_t row_floats, const int32_t* pos0_dev,
                 int64_t max_pos, cudaStream_t stream = nullptr);

}  // namespace moraine::cuda
