// Row-outer, token-inner matrix-vector products over the per-row dot kernels.
#include "kernels/cpu/matvec.h"

#include <atomic>
#include <stdexcept>
#include <string>

#include "kernels/cpu/amx_kernels.h"
#include "kernels/cpu/avx512_kernels.h"
#include "kernels/cpu/vec_dot.h"

namespace moraine::cpu {
namespace {

constexpr size_t kPrefetchBytes = 4096;

inline void prefetch_line(const void* p) { __builtin_prefetch(p, 0, 3); }

std::atomic<int> g_amx_min_tokens{kPrefillTokens};

}  // namespace

void set_amx_min_tokens(int n_tok) { g_amx_min_tokens.store(n_tok < 1 ? 1 : n_tok, std::memory_order_relaxed); }

int amx_min_tokens() { return g_amx_min_tokens.load(std::memory_order_relaxed); }

bool matvec_uses_amx(TensorType type, int n_tok) {
  return n_tok >= amx_min_tokens() && detect_cpu_isa() == CpuIsa::Amx && amx::supports(type);
}

void matvec_tokens(TensorType type, int64_t n_cols, const void* w, int64_t row_begin, int64_t row_end, const void* acts,
                   size_t act_row_bytes, const int32_t* tok, int n_tok, float* y, int64_t y_stride) {
  const VecDotFn fn = best_vec_dot_fn(type);
  if (!fn) throw std::invalid_argument("matvec_tokens: no kernel for weight type " + std::string(type_name(type)));
  if (row_end <= row_begin || n_tok <= 0) return;
  if (matvec_uses_amx(type, n_tok)) {
    return amx::matmul_tokens(type, n_cols, w, row_begin, row_end, acts, act_row_bytes, tok, n_tok, y, y_stride);
  }
  const size_t wb = row_bytes(type, n_cols);
  const auto* wrow = static_cast<const uint8_t*>(w) + static_cast<size_t>(row_begin) * wb;
  const auto* a = static_cast<const uint8_t*>(acts);
  const auto* wend = static_cast<const uint8_t*>(w) + static_cast<size_t>(row_end) * wb;
  // Software prefetch kPrefetchBytes ahead of the row being dotted. A server core's own demand
  // misses and the L2 streamer alone leave its share of DRAM bandwidth unused while it computes;
  // asking for the lines early overlaps the two (measured on the 16-core Xeon, 1 token:
  // Q4_K 41 -> 49, Q8_0 54 -> 67, MXFP4 31 -> 37 GB/s).
  const uint8_t* pf = wrow;
  auto prefetch_to = [&](const uint8_t* until) {
    const uint8_t* const limit = until < wend ? until : wend;
    for (; pf < limit; pf += 64) prefetch_line(pf);
  };
  prefetch_to(wrow + kPrefetchBytes);
  int64_t r = row_begin;
  // Q4_K, Q8_0 and MXFP4 on the VNNI tier: register-blocked tiles of 4 rows x up to 4 tokens
  // (matvec_avx512.cpp) unpack each weight block once for all tokens and load each activation
  // block once for all four rows.
  using Rows4Fn = void (*)(int64_t, const void*, size_t, const void* const*, int, float*, int64_t);
  Rows4Fn rows4 = nullptr;
  if (fn == vec_dot_fn(type, CpuIsa::Avx512Vnni)) {
    if (type == TensorType::Q4_K) rows4 = avx512::q4_k_rows4;
    else if (type == TensorType::Q8_0) rows4 = avx512::q8_0_rows4;
    else if (type == TensorType::MXFP4) rows4 = avx512::mxfp4_rows4;
  }
  if (rows4) {
    // Tokens in chunks of kTokenChunk activation pointers; beyond one chunk (only without AMX,
    // or below amx_min_tokens()) the weight rows are re-read from L1/L2 per chunk, not from DRAM:
    // a 4-row group is at most a few KB.
    constexpr int kTokenChunk = 64;
    const void* act_ptr[kTokenChunk];
    auto fill_chunk = [&](int t0, int nt) {
      for (int t = 0; t < nt; ++t) {
        const size_t ti = tok ? static_cast<size_t>(tok[t0 + t]) : static_cast<size_t>(t0 + t);
        act_ptr[t] = a + ti * act_row_bytes;
      }
    };
    const bool one_chunk = n_tok <= kTokenChunk;
    if (one_chunk) fill_chunk(0, n_tok);
    for (; r + 4 <= row_end; r += 4, wrow += 4 * wb) {
      prefetch_to(wrow + 4 * wb + kPrefetchBytes);
      for (int t0 = 0; t0 < n_tok; t0 += kTokenChunk) {
        const int nt = n_tok - t0 < kTokenChunk ? n_tok - t0 : kTokenChunk;
        if (!one_chunk) fill_chunk(t0, nt);
        rows4(n_cols, wrow, wb, act_ptr, nt, y + t0 * y_stride + r, y_stride);
      }
    }
  }
  for (; r < row_end; ++r, wrow += wb) {
    prefetch_to(wrow + wb + kPrefetchBytes);
    for (int t = 0; t < n_tok; ++t) {
      const size_t ti = tok ? static_cast<size_t>(tok[t]) : static_cast<size_t>(t);
      y[t * y_stride + r] = fn(n_cols, wrow, a + ti * act_row_bytes);
    }
  }
}

}  // namespace moraine::cpu
