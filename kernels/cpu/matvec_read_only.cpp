// The pattern probe's read-only matvec (matvec_read_only.h).
#include "kernels/cpu/matvec_read_only.h"

#include <immintrin.h>

#include <algorithm>

#include "kernels/cpu/stream_read.h"

namespace moraine::cpu {
namespace {

// What the loads fold into, per thread, so they cannot be dropped.
thread_local uint64_t t_sink = 0;

// Loads the lines of [p, p + bytes) (widened to whole lines), prefetcht0 `distance` ahead.
void read_span(MatvecMath mode, const uint8_t* p, size_t bytes, size_t distance) {
  const auto lo = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const auto hi = (reinterpret_cast<uintptr_t>(p) + bytes + 63) & ~uintptr_t{63};
  const auto* b = reinterpret_cast<const uint8_t*>(lo);
  const size_t n = hi - lo;
  if (mode != MatvecMath::ReadOnlyPrefetch || distance == 0) {
    t_sink ^= stream_read(b, n);
    return;
  }
  // 1 KB at a time, each after its lines `distance` ahead were asked for (not one burst per step).
  for (size_t o = 0; o < n; o += 1024) {
    const size_t len = std::min<size_t>(1024, n - o);
    for (size_t l = o; l < o + len; l += 64) _mm_prefetch(reinterpret_cast<const char*>(b + l + distance), _MM_HINT_T0);
    t_sink ^= stream_read(b + o, len);
  }
}

void zero_rows(int64_t r0, int64_t r1, int n_tok, float* y, int64_t y_stride) {
  for (int t = 0; t < n_tok; ++t) std::fill(y + t * y_stride + r0, y + t * y_stride + r1, 0.0f);
}

}  // namespace

void read_rows_only(MatvecMath mode, const void* w, size_t wb, int64_t row_begin, int64_t row_end, int n_tok, float* y, int64_t y_stride,
                    size_t distance) {
  if (row_end <= row_begin) return;
  const auto* base = static_cast<const uint8_t*>(w);
  // 4-row steps, as the tiles take them (the prefetch stream then runs ahead of each step).
  for (int64_t r = row_begin; r < row_end; r += 4) {
    const int64_t e = std::min(r + 4, row_end);
    read_span(mode, base + static_cast<size_t>(r) * wb, static_cast<size_t>(e - r) * wb, distance);
  }
  zero_rows(row_begin, row_end, n_tok, y, y_stride);
  asm volatile("" : : "r"(t_sink));
}

void read_runs_only(MatvecMath mode, size_t wb, const MatvecRun* runs, int n_runs, int n_tok, int64_t y_stride, size_t distance) {
  int64_t longest = 0;
  for (int i = 0; i < n_runs; ++i) longest = std::max(longest, runs[i].row_end - runs[i].row_begin);
  for (int64_t s = 0; s < longest; s += 4) {
    for (int i = 0; i < n_runs; ++i) {
      const MatvecRun& run = runs[i];
      const int64_t r = run.row_begin + s;
      if (r >= run.row_end) continue;
      const int64_t e = std::min(r + 4, run.row_end);
      read_span(mode, static_cast<const uint8_t*>(run.w) + static_cast<size_t>(r) * wb, static_cast<size_t>(e - r) * wb, distance);
    }
  }
  for (int i = 0; i < n_runs; ++i) zero_rows(runs[i].row_begin, runs[i].row_end, n_tok, runs[i].y, y_stride);
  asm volatile("" : : "r"(t_sink));
}

}  // namespace moraine::cpu
