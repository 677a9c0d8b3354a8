#include "kernels/cuda/embed_rows.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"

namespace moraine::cuda {
namespace {

__device__ __forceinline__ uint16_t load_u16(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (p[1] << 8));  // little-endian, any alignment
}

// Grid (column blocks, token); one thread per element.
__global__ void embed_rows_kernel(TensorType type, const uint8_t* __restrict__ table, size_t row_bytes,
                                  int64_t n_cols, const int32_t* __restrict__ ids, float* __restrict__ out) {
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t t = blockIdx.y;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_cols) return;
  const uint8_t* row = table + static_cast<size_t>(ids[t]) * row_bytes;
  float v;
  switch (type) {
    case TensorType::F32: {
      const uint8_t* p = row + 4 * i;
      v = __uint_as_float(static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                          (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24));
      break;
    }
    case TensorType::F16: v = __half2float(__ushort_as_half(load_u16(row + 2 * i))); break;
    case TensorType::BF16: v = __bfloat162float(__ushort_as_bfloat16(load_u16(row + 2 * i))); break;
    default: {  // Q8_0: 34-byte blocks of fp16 scale + 32 int8
      const uint8_t* b = row + (i / 32) * 34;
      const float d = __half2float(__ushort_as_half(load_u16(b)));
      v = __fmul_rn(d, static_cast<float>(static_cast<int8_t>(b[2 + i % 32])));
      break;
    }
  }
  out[t * n_cols + i] = v;
}

}  // namespace

bool embed_rows_supported(TensorType t) {
  return t == TensorType::F32 || t == TensorType::F16 || t == TensorType::BF16 || t == TensorType::Q8_0;
}

void embed_rows(TensorType t, const void* table, size_t row_bytes, int64_t n_cols, const int32_t* ids, int64_t n,
                float* out, cudaStream_t stream) {
  if (!embed_rows_supported(t))
    throw std::invalid_argument("embed_rows: no CUDA kernel for " + std::string(type_name(t)) +
                                " (supported: f32, f16, bf16, q8_0)");
  if (n_cols <= 0 || n_cols % type_traits(t).block_elems != 0 || n <= 0 || n > 65535)
    throw std::invalid_argument("embed_rows: n_cols=" + std::to_string(n_cols) + ", n=" + std::to_string(n) +
                                " (n_cols a positive multiple of the block, n in 1..65535)");
  constexpr int kThreads = 256;
  const dim3 grid(static_cast<unsigned>((n_cols + kThreads - 1) / kThreads), static_cast<unsigned>(n));
  launch_kernel(embed_rows_kernel, grid, dim3(kThreads), 0, stream, t, static_cast<const uint8_t*>(table), row_bytes, n_cols,
                ids, out);
}

}  // namespace moraine::cuda
