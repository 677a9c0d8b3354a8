// Row-outer, token-inner matrix-vector products over the per-row dot kernels.
#include "kernels/cpu/matvec.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/amx_kernels.h"
#include "kernels/cpu/avx512_kernels.h"
#include "kernels/cpu/iq_kernels.h"
#include "kernels/cpu/vec_dot.h"

namespace moraine::cpu {
namespace {

bool cpu_has_avx512_vbmi() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi") != 0;
  }();
  return has;
#else
  return false;
#endif
}

bool cpu_has_gfni() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("gfni") != 0;
  }();
  return has;
#else
  return false;
#endif
}

// Issues prefetches for the lines from `next` up to `until` (capped at `end`), moving `next`.
template <int kLocality>
inline void prefetch_lines(const uint8_t*& next, const uint8_t* until, const uint8_t* end) {
  const uint8_t* const limit = until < end ? until : end;
  for (; next < limit; next += 64) __builtin_prefetch(next, 0, kLocality);
}

// The packed-activation tiles (MXFP4 and Q8_0 with VBMI, Q4_K with GFNI) for one call of
// n_tok <= kTokenChunk tokens on the VNNI tier: the activation rows repacked once per call (a
// few hundred instructions per row, against thousands for the weight rows of even one job),
// then tiles that read them (matvec_avx512_groups4.cpp, matvec_avx512_q4k.cpp).
constexpr int kTokenChunk = 64;
using PackFn = void (*)(int64_t, const void*, void*);
using PackedRows4Fn = void (*)(int64_t, const void*, size_t, const void* const*, int, float*, int64_t, const void*, size_t);
struct PackedTile {
  PackFn pack = nullptr;
  PackedRows4Fn rows4 = nullptr;
  size_t packed_bytes = 0;  // per activation row
};
PackedTile packed_tile_for(TensorType type, int64_t n_cols, int n_tok, const MatvecTiles& tiles) {
  if (n_tok > kTokenChunk) return {};
  if (type == TensorType::MXFP4 && cpu_has_avx512_vbmi() && tiles.mxfp4_vbmi) {
    return {avx512::pack_mxfp4_acts, avx512::mxfp4_rows4_packed, avx512::groups4_packed_act_bytes(n_cols)};
  }
  if (type == TensorType::Q8_0 && cpu_has_avx512_vbmi() && tiles.q8_0_vbmi) {
    return {avx512::pack_q8_0_acts, avx512::q8_0_rows4_packed, avx512::groups4_packed_act_bytes(n_cols)};
  }
  if (type == TensorType::Q4_K && cpu_has_gfni() && tiles.q4_k_gfni) {
    return {avx512::pack_q4_k_acts, avx512::q4_k_rows4_packed, avx512::q4_k_packed_act_bytes(n_cols)};
  }
  return {};
}

// The older register tiles of 4 rows x up to 4 tokens (matvec_avx512.cpp), VNNI tier.
using Rows4Fn = void (*)(int64_t, const void*, size_t, const void* const*, int, float*, int64_t);
Rows4Fn rows4_for(TensorType type) {
  switch (type) {
    case TensorType::Q4_K: return avx512::q4_k_rows4;
    case TensorType::Q5_K: return avx512::q5_k_rows4;
    case TensorType::Q6_K: return avx512::q6_k_rows4;
    case TensorType::Q2_K: return avx512::q2_k_rows4;
    case TensorType::Q3_K: return avx512::q3_k_rows4;
    case TensorType::Q8_0: return avx512::q8_0_rows4;
    case TensorType::MXFP4: return avx512::mxfp4_rows4;
    default: return iq_rows4_fn(type);  // the IQ grid types (vec_dot_avx512_iq.cpp)
  }
}

// Packs the n_tok activation rows (tok / act_row_bytes as matvec_tokens takes them) into a
// thread-local buffer; packed_ptr[t] points at token t's packed row.
void pack_acts(const PackedTile& tile, int64_t n_cols, const uint8_t* a, size_t act_row_bytes, const int32_t* tok, int n_tok,
               const void** packed_ptr) {
  thread_local std::vector<uint8_t> packed_buf;  // grows to the largest call, then reused
  const size_t pb = tile.packed_bytes;
  if (packed_buf.size() < pb * static_cast<size_t>(n_tok) + 64) packed_buf.resize(pb * static_cast<size_t>(n_tok) + 64);
  auto* packed = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(packed_buf.data()) + 63) & ~uintptr_t{63});
  for (int t = 0; t < n_tok; ++t) {
    const size_t ti = tok ? static_cast<size_t>(tok[t]) : static_cast<size_t>(t);
    packed_ptr[t] = packed + static_cast<size_t>(t) * pb;
    tile.pack(n_cols, a + ti * act_row_bytes, packed + static_cast<size_t>(t) * pb);
  }
}

}  // namespace

bool matvec_uses_amx(TensorType type, int n_tok, const MatvecTuning& tuning) {
  return n_tok >= std::max(1, tuning.amx_min_tokens) && capped_isa(tuning.max_isa) == CpuIsa::Amx && amx::supports(type);
}

void matvec_tokens(TensorType type, int64_t n_cols, const void* w, int64_t row_begin, int64_t row_end, const void* acts,
                   size_t act_row_bytes, const int32_t* tok, int n_tok, float* y, int64_t y_stride, const MatvecTuning& tuning) {
  const VecDotFn fn = best_vec_dot_fn(type, tuning.max_isa);
  if (!fn) throw std::invalid_argument("matvec_tokens: no kernel for weight type " + std::string(type_name(type)));
  if (row_end <= row_begin || n_tok <= 0) return;
  if (matvec_uses_amx(type, n_tok, tuning)) {
    return amx::matmul_tokens(type, n_cols, w, row_begin, row_end, acts, act_row_bytes, tok, n_tok, y, y_stride);
  }
  const size_t wb = row_bytes(type, n_cols);
  const auto* wrow = static_cast<const uint8_t*>(w) + static_cast<size_t>(row_begin) * wb;
  const auto* a = static_cast<const uint8_t*>(acts);
  const auto* wend = static_cast<const uint8_t*>(w) + static_cast<size_t>(row_end) * wb;
  // Software prefetch ahead of the row being dotted (MatvecPrefetch): a server core's own demand
  // misses and the L2 streamer alone leave its share of DRAM bandwidth unused while it computes
  // (16-core Xeon, Q4_K at 1 token: none 48, 4 KB ahead 65 GB/s; other distances, an L2 stream,
  // running past a job's end and next-call hints gave nothing: docs/perf-log.md, "matvec prefetch distances").
  size_t pf_l1 = tuning.prefetch.l1_bytes;  // the spread path below moves it (prefetch_to reads it)
  const uint8_t* pf1 = wrow;
  auto prefetch_to = [&](const uint8_t* p) {
    if (pf_l1) prefetch_lines<3>(pf1, p + pf_l1, wend);
  };
  prefetch_to(wrow);
  int64_t r = row_begin;
  // Q2_K..Q6_K, Q8_0 and MXFP4 on the VNNI tier: register-blocked tiles of 4 rows x up to 4
  // tokens unpack each weight block once for all tokens and load each activation block once for
  // all four rows (every row through the per-row kernel instead: 65 vs ~100 GB/s Q4_K).
  const Rows4Fn rows4 = static_cast<int>(capped_isa(tuning.max_isa)) >= static_cast<int>(CpuIsa::Avx512Vnni) ? rows4_for(type) : nullptr;
  if (rows4) {
    // Tokens in chunks of kTokenChunk activation pointers; beyond one chunk (only without AMX,
    // or below amx_min_tokens) the weight rows are re-read from L1/L2 per chunk, not from DRAM:
    // a 4-row group is at most a few KB.
    const void* act_ptr[kTokenChunk];
    auto fill_chunk = [&](int t0, int nt) {
      for (int t = 0; t < nt; ++t) {
        const size_t ti = tok ? static_cast<size_t>(tok[t0 + t]) : static_cast<size_t>(t0 + t);
        act_ptr[t] = a + ti * act_row_bytes;
      }
    };
    const bool one_chunk = n_tok <= kTokenChunk;
    if (one_chunk) fill_chunk(0, n_tok);
    // Beyond one token chunk the older tiles (no repacked copy of every row).
    const PackedTile tile = packed_tile_for(type, n_cols, n_tok, tuning.tiles);
    if (tile.rows4 && r + 4 <= row_end) {
      const void* packed_ptr[kTokenChunk];
      pack_acts(tile, n_cols, a, act_row_bytes, tok, n_tok, packed_ptr);
      // Spread (MatvecPrefetch::spread_l1_bytes): a step's prefetcht0 lines go out with the
      // tile's blocks instead of in one burst before it, while a whole step's lines fit before
      // the end; the frontier starts at the spread distance.
      const bool spread = pf_l1 > 0;
      if (spread) {
        pf_l1 = std::max<size_t>(64, tuning.prefetch.spread_l1_bytes);
        prefetch_lines<3>(pf1, wrow + pf_l1, wend);
      }
      for (; r + 4 <= row_end; r += 4, wrow += 4 * wb) {
        if (spread && pf1 + 4 * wb <= wend) {
          const uint8_t* from = pf1;
          pf1 += 4 * wb;
          tile.rows4(n_cols, wrow, wb, packed_ptr, n_tok, y + r, y_stride, from, 4 * wb);
          continue;
        }
        prefetch_to(wrow + 4 * wb);
        tile.rows4(n_cols, wrow, wb, packed_ptr, n_tok, y + r, y_stride, nullptr, 0);
      }
    }
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

void matvec_tokens_runs(TensorType type, int64_t n_cols, const MatvecRun* runs, int n_runs, const void* acts, size_t act_row_bytes,
                        const int32_t* tok, int n_tok, int64_t y_stride, const MatvecTuning& tuning) {
  const VecDotFn fn = best_vec_dot_fn(type, tuning.max_isa);
  if (!fn) throw std::invalid_argument("matvec_tokens_runs: no kernel for weight type " + std::string(type_name(type)));
  constexpr int kMaxRuns = 16;
  if (n_runs > kMaxRuns) throw std::invalid_argument("matvec_tokens_runs: " + std::to_string(n_runs) + " runs (at most 16)");
  if (n_runs <= 0 || n_tok <= 0) return;
  const bool vnni = static_cast<int>(capped_isa(tuning.max_isa)) >= static_cast<int>(CpuIsa::Avx512Vnni);
  const PackedTile tile = vnni && !matvec_uses_amx(type, n_tok, tuning) ? packed_tile_for(type, n_cols, n_tok, tuning.tiles) : PackedTile{};
  if (!tile.rows4 || tuning.prefetch.l1_bytes == 0) {
    // One run after the other.
    for (int i = 0; i < n_runs; ++i) {
      matvec_tokens(type, n_cols, runs[i].w, runs[i].row_begin, runs[i].row_end, acts, act_row_bytes, tok, n_tok, runs[i].y, y_stride, tuning);
    }
    return;
  }
  const size_t wb = row_bytes(type, n_cols);
  const size_t step = 4 * wb;
  const size_t dist = std::max<size_t>(2048, tuning.prefetch.spread_l1_bytes / static_cast<size_t>(n_runs));
  const void* packed_ptr[kTokenChunk];
  pack_acts(tile, n_cols, static_cast<const uint8_t*>(acts), act_row_bytes, tok, n_tok, packed_ptr);
  struct Stream {
    const uint8_t *w, *end, *pf;
    int64_t r, r_end;
    float* y;
  };
  Stream st[kMaxRuns];
  for (int i = 0; i < n_runs; ++i) {
    const MatvecRun& run = runs[i];
    const auto* base = static_cast<const uint8_t*>(run.w);
    Stream& s = st[i];
    s.r = run.row_begin;
    s.r_end = std::max(run.row_begin, run.row_end);
    s.w = base + static_cast<size_t>(s.r) * wb;
    s.end = base + static_cast<size_t>(s.r_end) * wb;
    s.pf = s.w;
    s.y = run.y;
    prefetch_lines<3>(s.pf, s.w + dist, s.end);  // each stream's frontier out to its distance
  }
  // 4-row steps in turn; a stream's prefetcht0 lines go out spread over its step's blocks.
  for (bool any = true; any;) {
    any = false;
    for (int i = 0; i < n_runs; ++i) {
      Stream& s = st[i];
      if (s.r + 4 > s.r_end) continue;
      any = true;
      if (s.pf + step <= s.end) {
        const uint8_t* from = s.pf;
        s.pf += step;
        tile.rows4(n_cols, s.w, wb, packed_ptr, n_tok, s.y + s.r, y_stride, from, step);
      } else {
        prefetch_lines<3>(s.pf, s.end, s.end);
        tile.rows4(n_cols, s.w, wb, packed_ptr, n_tok, s.y + s.r, y_stride, nullptr, 0);
      }
      s.r += 4;
      s.w += step;
    }
  }
  // Tail rows (fewer than 4 left in a run) through the per-row kernel, as matvec_tokens does.
  const auto* a = static_cast<const uint8_t*>(acts);
  for (int i = 0; i < n_runs; ++i) {
    Stream& s = st[i];
    for (; s.r < s.r_end; ++s.r, s.w += wb) {
      for (int t = 0; t < n_tok; ++t) {
        const size_t ti = tok ? static_cast<size_t>(tok[t]) : static_cast<size_t>(t);
        s.y[t * y_stride + s.r] = fn(n_cols, s.w, a + ti * act_row_bytes);
      }
    }
  }
}

}  // namespace moraine::cpu
