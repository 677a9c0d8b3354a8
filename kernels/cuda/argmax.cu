#include "kernels/cuda/argmax.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"

namespace moraine::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 8;   // elements per thread per block: 151,936 logits -> 75 blocks

// Per row: the best key so far (atomicMax), how many of its blocks are done, and the first
// non-finite logit's code (index * 2 + is-NaN) complemented, so that atomicMax keeps the first
// and 0 stays "none" (the scratch's zeroed state).
struct RowScratch {
  unsigned long long best;
  unsigned int done;
  unsigned int bad;
};

// One 64-bit key per element whose unsigned order is the argmax order: the value's bits made
// monotonic in the high half (sign flipped for positives, all bits for negatives; -0 first
// turned into +0, so equal values tie), the complemented index in the low half (a tie goes to
// the lower index). 0 is "nothing yet": no non-NaN value maps there.
__device__ __forceinline__ unsigned long long key_of(float v, uint32_t i) {
  const uint32_t u = __float_as_uint(v == 0.0f ? 0.0f : v);
  const uint32_t ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(ordered) << 32) | (0xFFFFFFFFu - i);
}

// kReportNonFinite: whether the caller asked for the non-finite report (nonfinite != nullptr).
// Without it the kernel neither scans for non-finite logits nor touches RowScratch::bad (which
// stays 0, so a later call that asks finds it clean): greedy decode's usual token does only the
// argmax.
template <bool kReportNonFinite>
__global__ void argmax_kernel(const float* __restrict__ logits, uint32_t n, int32_t* __restrict__ out,
                              RowScratch* __restrict__ scratch, int32_t* __restrict__ nonfinite) {
  wait_for_prior_grids();   // PDL (launch.h): the logits come from the kernel before
  const uint32_t row = blockIdx.y;
  const float* x = logits + static_cast<size_t>(row) * n;
  const uint32_t begin = blockIdx.x * (kThreads * kPerThread);
  const uint32_t end = min(n, begin + kThreads * kPerThread);
  unsigned long long best = 0;
  unsigned int bad = 0;   // ~(first non-finite code), 0: none
  for (uint32_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float v = x[i];
    if (v == v) best = max(best, key_of(v, i));   // a NaN never wins
    if constexpr (kReportNonFinite)
      if (!isfinite(v)) bad = max(bad, ~(2u * i + (v != v ? 1u : 0u)));
  }
  for (int o = 16; o > 0; o >>= 1) {
    best = max(best, __shfl_xor_sync(0xFFFFFFFFu, best, o));
    if constexpr (kReportNonFinite) bad = max(bad, __shfl_xor_sync(0xFFFFFFFFu, bad, o));
  }
  __shared__ unsigned long long warp_best[kThreads / 32];
  __shared__ unsigned int warp_bad[kThreads / 32];
  __shared__ bool last;
  if (threadIdx.x % 32 == 0) {
    warp_best[threadIdx.x / 32] = best;
    if constexpr (kReportNonFinite) warp_bad[threadIdx.x / 32] = bad;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) {
      best = max(best, warp_best[w]);
      if constexpr (kReportNonFinite) bad = max(bad, warp_bad[w]);
    }
    RowScratch& s = scratch[row];
    if (best != 0) atomicMax(&s.best, best);
    if constexpr (kReportNonFinite)
      if (bad != 0) atomicMax(&s.bad, bad);
    __threadfence();   // the max is visible before this block counts as done
    last = atomicAdd(&s.done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  allow_dependent_grids();
  if (!last || threadIdx.x != 0) return;
  // The row's last block: every other block's max is in. Read and clear for the next call.
  __threadfence();
  RowScratch& s = scratch[row];
  const unsigned long long key = atomicExch(&s.best, 0ull);
  s.done = 0;
  if constexpr (kReportNonFinite) {
    const unsigned int first_bad = atomicExch(&s.bad, 0u);
    nonfinite[row] = first_bad == 0 ? -1 : static_cast<int32_t>(~first_bad);
  }
  const float x0 = x[0];
  out[row] = (x0 != x0 || key == 0) ? 0 : static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(key));
}

}  // namespace

size_t argmax_scratch_bytes(int64_t rows) { return static_cast<size_t>(rows > 0 ? rows : 0) * sizeof(RowScratch); }

void argmax_rows(const float* logits, int64_t rows, int64_t n, int32_t* out, void* scratch, cudaStream_t stream,
                 int32_t* nonfinite) {
  if (rows < 1 || rows > 65535 || n < 1 || n >= (int64_t{1} << 31))
    throw std::invalid_argument("argmax_rows: " + std::to_string(rows) + " rows of " + std::to_string(n) +
                                " logits (expected 1..65535 rows of 1..2^31-1)");
  if (nonfinite != nullptr && n >= (int64_t{1} << 30))
    throw std::invalid_argument("argmax_rows: the non-finite report codes index * 2 + 1 in an int32: rows of " +
                                std::to_string(n) + " logits are too long for it");
  const int64_t per_block = kThreads * kPerThread;
  const dim3 grid(static_cast<unsigned>((n + per_block - 1) / per_block), static_cast<unsigned>(rows));
  // The flag as a template argument, not a branch per element: the kernel without the report has
  // no trace of the scan (PTX 138 instructions against 188). H200, 151936 logits, moraine-kernel-bench
  // cuda --backend-only (session 9 run B): 2.54 us per call in a graph, 3.58 per stream launch,
  // against 2.76 / 3.76 with the report (what every greedy token paid before the flag).
  launch_kernel(nonfinite != nullptr ? argmax_kernel<true> : argmax_kernel<false>, grid, dim3(kThreads), 0, stream,
                logits, static_cast<uint32_t>(n), out, static_cast<RowScratch*>(scratch), nonfinite);
}

}  // namespace moraine::cuda
