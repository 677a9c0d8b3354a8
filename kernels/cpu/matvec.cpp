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

std::atomic<int> g_amx_min_tokens{kPrefillTokens};
std::atomic<size_t> g_prefetch_l1{MatvecPrefetch{}.l1_bytes};
std::atomic<size_t> g_prefetch_l2{MatvecPrefetch{}.l2_bytes};
std::atomic<bool> g_prefetch_past_end{MatvecPrefetch{}.past_end};

// Issues prefetches for the lines from `next` up to `until` (capped at `end`), moving `next`.
template <int kLocality>
inline void prefetch_lines(const uint8_t*& next, const uint8_t* until, const uint8_t* end) {
  const uint8_t* const limit = until < end ? until : end;
  for (; next < limit; next += 64) __builtin_prefetch(next, 0, kLocality);
}

}  // namespace

void set_amx_min_tokens(int n_tok) { g_amx_min_tokens.store(n_tok < 1 ? 1 : n_tok, std::memory_order_relaxed); }

int amx_min_tokens() { return g_amx_min_tokens.load(std::memory_order_relaxed); }

void set_matvec_prefetch(MatvecPrefetch p) {
  g_prefetch_l1.store(p.l1_bytes, std::memory_order_relaxed);
  g_prefetch_l2.store(p.l2_bytes, std::memory_order_relaxed);
  g_prefetch_past_end.store(p.past_end, std::memory_order_relaxed);
}

MatvecPrefetch matvec_prefetch() {
  return {g_prefetch_l1.load(std::memory_order_relaxed), g_prefetch_l2.load(std::memory_order_relaxed),
          g_prefetch_past_end.load(std::memory_order_relaxed)};
}

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
  // Software prefetch ahead of the row being dotted (matvec_prefetch()). A server core's own
  // demand misses and the L2 streamer alone leave its share of DRAM bandwidth unused while it
  // computes; asking for the lines early overlaps the two (measured on the 16-core Xeon, 1
  // token, prefetcht0 4 KB ahead: Q4_K 41 -> 49, Q8_0 54 -> 67, MXFP4 31 -> 37 GB/s).
  // A/B of the distances there later (GB/s Q4_K / Q8_0 / MXFP4, 1 token; runs differ by ~10%):
  // none 48 / 60 / 42; t0 4 KB 65 / 81 / 49; t0 8 KB 61 / 80 / 49; t0 2 KB + t1 8 KB 60 / 84 /
  // 51; t0 4 KB + t1 16 or 32 KB 61 / 78 / 50 and 59 / 81 / 48; t1 16 KB alone 50 / 45 / 43.
  // An L2 stream ahead of the L1 one adds nothing measurable, so the default stays t0 4 KB.
  // Session 4 on the H200 host (16 threads, caller joining, 2 ms spin; one run each, the DRAM
  // probe itself ranged 111-183 GB/s over the run): t0 4 KB 90-105 / 98-122 / 76-105; off 65 /
  // 49 / 43; t0 8 KB 95 / 74 / 81; t0 2 KB + t1 16 KB 119 / 116 / 77; the same prefetching past
  // a job's end 107 / 113 / 89; t0 4 KB past the end 104 / 120 / 85: nothing beats the default
  // beyond that machine's noise.
  const size_t pf_l1 = g_prefetch_l1.load(std::memory_order_relaxed), pf_l2 = g_prefetch_l2.load(std::memory_order_relaxed);
  const uint8_t *pf1 = wrow, *pf2 = wrow;
  // Prefetches never fault, so running past the matrix's end (into whatever follows) is safe.
  const bool past_end = g_prefetch_past_end.load(std::memory_order_relaxed);
  const uint8_t* const pf1_end = past_end ? wend + pf_l1 : wend;
  const uint8_t* const pf2_end = past_end ? wend + pf_l2 : wend;
  // Everything before `p` plus the prefetch distances is requested.
  auto prefetch_to = [&](const uint8_t* p) {
    if (pf_l1) prefetch_lines<3>(pf1, p + pf_l1, pf1_end);
    if (pf_l2) prefetch_lines<2>(pf2, p + pf_l2, pf2_end);
  };
  prefetch_to(wrow);
  int64_t r = row_begin;
  // Q4_K, Q8_0 and MXFP4 on the VNNI tier: register-blocked tiles of 4 rows x up to 4 tokens
  // (matvec_avx512.cpp) unpack each weight block once for all tokens and load each activation
  // block once for all four rows.
  using Rows4Fn = void (*)(int64_t, const void*, size_t, const void* const*, int, float*, int64_t);
  Rows4Fn rows4 = nullptr;
  if (fn == vec_dot_fn(type, CpuIsa::Avx512Vnni)) {
    if (type == TensorType::Q4_K) rows4 = avx512::q4_k_rows4;
    else if (type == TensorType::Q5_K) rows4 = avx512::q5_k_rows4;
    else if (type == TensorType::Q6_K) rows4 = avx512::q6_k_rows4;
    else if (type == TensorType::Q2_K) rows4 = avx512::q2_k_rows4;
    else if (type == TensorType::Q3_K) rows4 = avx512::q3_k_rows4;
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
      prefetch_to(wrow + 4 * wb);
      for (int t0 = 0; t0 < n_tok; t0 += kTokenChunk) {
        const int nt = n_tok - t0 < kTokenChunk ? n_tok - t0 : kTokenChunk;
        if (!one_chunk) fill_chunk(t0, nt);
        rows4(n_cols, wrow, wb, act_ptr, nt, y + t0 * y_stride + r, y_stride);
      }
    }
  }
  for (; r < row_end; ++r, wrow += wb) {
    prefetch_to(wrow + wb);
    for (int t = 0; t < n_tok; ++t) {
      const size_t ti = tok ? static_cast<size_t>(tok[t]) : static_cast<size_t>(t);
      y[t * y_stride + r] = fn(n_cols, wrow, a + ti * act_row_bytes);
    }
  }
}

}  // namespace moraine::cpu
