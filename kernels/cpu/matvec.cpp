// Row-outer, token-inner matrix-vector products over the per-row dot kernels.
#include "kernels/cpu/matvec.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/amx_kernels.h"
#include "kernels/cpu/avx512_kernels.h"
#include "kernels/cpu/matvec_read_only.h"
#include "kernels/cpu/vec_dot.h"

namespace moraine::cpu {
namespace {

std::atomic<int> g_amx_min_tokens{kPrefillTokens};
std::atomic<size_t> g_prefetch_l1{MatvecPrefetch{}.l1_bytes};
std::atomic<size_t> g_prefetch_l2{MatvecPrefetch{}.l2_bytes};
std::atomic<bool> g_prefetch_past_end{MatvecPrefetch{}.past_end};
std::atomic<int> g_prefetch_next_call{MatvecPrefetch{}.next_call};
std::atomic<bool> g_prefetch_spread{MatvecPrefetch{}.spread};
std::atomic<size_t> g_prefetch_spread_l1{MatvecPrefetch{}.spread_l1_bytes};
std::atomic<size_t> g_prefetch_runs_l1{MatvecPrefetch{}.runs_l1_bytes};
std::atomic<size_t> g_prefetch_runs_l2{MatvecPrefetch{}.runs_l2_bytes};
std::atomic<bool> g_tile_mxfp4_vbmi{MatvecTiles{}.mxfp4_vbmi};
std::atomic<bool> g_tile_q4_k_gfni{MatvecTiles{}.q4_k_gfni};
std::atomic<bool> g_tile_q8_0_vbmi{MatvecTiles{}.q8_0_vbmi};
std::atomic<bool> g_tile_rows4{MatvecTiles{}.rows4};
std::atomic<bool> g_tile_row_by_row{MatvecTiles{}.row_by_row};
std::atomic<MatvecMath> g_math{MatvecMath::Compute};

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
using PackedRows4Fn = void (*)(int64_t, const void*, size_t, const void* const*, int, float*, int64_t, bool, const void*, size_t);
struct PackedTile {
  PackFn pack = nullptr;
  PackedRows4Fn rows4 = nullptr;
  size_t packed_bytes = 0;  // per activation row
};
PackedTile packed_tile_for(TensorType type, int64_t n_cols, int n_tok) {
  if (n_tok > kTokenChunk) return {};
  if (type == TensorType::MXFP4 && cpu_has_avx512_vbmi() && g_tile_mxfp4_vbmi.load(std::memory_order_relaxed)) {
    return {avx512::pack_mxfp4_acts, avx512::mxfp4_rows4_packed, avx512::groups4_packed_act_bytes(n_cols)};
  }
  if (type == TensorType::Q8_0 && cpu_has_avx512_vbmi() && g_tile_q8_0_vbmi.load(std::memory_order_relaxed)) {
    return {avx512::pack_q8_0_acts, avx512::q8_0_rows4_packed, avx512::groups4_packed_act_bytes(n_cols)};
  }
  if (type == TensorType::Q4_K && cpu_has_gfni() && g_tile_q4_k_gfni.load(std::memory_order_relaxed)) {
    return {avx512::pack_q4_k_acts,
            [](int64_t n, const void* w4, size_t stride, const void* const* pk, int nt, float* y4, int64_t ys, bool, const void* pf, size_t pf_bytes) {
              avx512::q4_k_rows4_packed(n, w4, stride, pk, nt, y4, ys, pf, pf_bytes);
            },
            avx512::q4_k_packed_act_bytes(n_cols)};
  }
  return {};
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

void set_amx_min_tokens(int n_tok) { g_amx_min_tokens.store(n_tok < 1 ? 1 : n_tok, std::memory_order_relaxed); }

int amx_min_tokens() { return g_amx_min_tokens.load(std::memory_order_relaxed); }

void set_matvec_prefetch(MatvecPrefetch p) {
  g_prefetch_l1.store(p.l1_bytes, std::memory_order_relaxed);
  g_prefetch_l2.store(p.l2_bytes, std::memory_order_relaxed);
  g_prefetch_past_end.store(p.past_end, std::memory_order_relaxed);
  g_prefetch_next_call.store(p.next_call, std::memory_order_relaxed);
  g_prefetch_spread.store(p.spread, std::memory_order_relaxed);
  g_prefetch_spread_l1.store(p.spread_l1_bytes, std::memory_order_relaxed);
  g_prefetch_runs_l1.store(p.runs_l1_bytes, std::memory_order_relaxed);
  g_prefetch_runs_l2.store(p.runs_l2_bytes, std::memory_order_relaxed);
}

MatvecPrefetch matvec_prefetch() {
  return {g_prefetch_l1.load(std::memory_order_relaxed), g_prefetch_l2.load(std::memory_order_relaxed),
          g_prefetch_past_end.load(std::memory_order_relaxed), g_prefetch_next_call.load(std::memory_order_relaxed),
          g_prefetch_spread.load(std::memory_order_relaxed), g_prefetch_spread_l1.load(std::memory_order_relaxed),
          g_prefetch_runs_l1.load(std::memory_order_relaxed), g_prefetch_runs_l2.load(std::memory_order_relaxed)};
}

void set_matvec_tiles(MatvecTiles t) {
  g_tile_mxfp4_vbmi.store(t.mxfp4_vbmi, std::memory_order_relaxed);
  g_tile_q4_k_gfni.store(t.q4_k_gfni, std::memory_order_relaxed);
  g_tile_q8_0_vbmi.store(t.q8_0_vbmi, std::memory_order_relaxed);
  g_tile_rows4.store(t.rows4, std::memory_order_relaxed);
  g_tile_row_by_row.store(t.row_by_row, std::memory_order_relaxed);
}

MatvecTiles matvec_tiles() {
  return {g_tile_mxfp4_vbmi.load(std::memory_order_relaxed), g_tile_q4_k_gfni.load(std::memory_order_relaxed),
          g_tile_q8_0_vbmi.load(std::memory_order_relaxed), g_tile_rows4.load(std::memory_order_relaxed),
          g_tile_row_by_row.load(std::memory_order_relaxed)};
}

void set_matvec_math(MatvecMath m) { g_math.store(m, std::memory_order_relaxed); }

MatvecMath matvec_math() { return g_math.load(std::memory_order_relaxed); }

bool matvec_uses_amx(TensorType type, int n_tok) {
  return n_tok >= amx_min_tokens() && detect_cpu_isa() == CpuIsa::Amx && amx::supports(type);
}

void matvec_tokens(TensorType type, int64_t n_cols, const void* w, int64_t row_begin, int64_t row_end, const void* acts,
                   size_t act_row_bytes, const int32_t* tok, int n_tok, float* y, int64_t y_stride) {
  matvec_tokens(type, n_cols, w, row_begin, row_end, acts, act_row_bytes, tok, n_tok, y, y_stride, nullptr, 0);
}

void matvec_tokens(TensorType type, int64_t n_cols, const void* w, int64_t row_begin, int64_t row_end, const void* acts,
                   size_t act_row_bytes, const int32_t* tok, int n_tok, float* y, int64_t y_stride, const void* next, size_t next_bytes) {
  const VecDotFn fn = best_vec_dot_fn(type);
  if (!fn) throw std::invalid_argument("matvec_tokens: no kernel for weight type " + std::string(type_name(type)));
  if (row_end <= row_begin || n_tok <= 0) return;
  if (const MatvecMath m = g_math.load(std::memory_order_relaxed); m != MatvecMath::Compute) {
    return read_rows_only(m, w, row_bytes(type, n_cols), row_begin, row_end, n_tok, y, y_stride,
                          g_prefetch_spread_l1.load(std::memory_order_relaxed));
  }
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
  // Session 5 with the faster tiles (matvec_tiles; same host, 16 threads, 1 token, one run each
  // unless a range is given; the default's five runs: 94-109 / 97-112 / 86-99, probe 120-154):
  // t0 1 KB 92 / 100 / 81; t0 2 KB 101 / 109 / 95; t0 4 KB + t1 32 KB 98 / 101 / 82; past the
  // end 96 / 99 / 84; the next-call hint (next_call 1) 110 / 97 / 93, with t0 2 KB + t1 16 KB
  // 103 / 125 / 99; every row through the per-row kernels (one row's bytes after the other)
  // 65 / 110 / 50, the four-block tiles' rows one after the other 99 / 110 / 96. Every format
  // and variant lands near 100 GB/s: the limit is on the memory side, not in the tiles' compute
  // (all cores in L2 reach 220-340 GB/s). Q4_K's 21 MB layer against Q8_0's 40 MB at about the
  // same GB/s suggests ~30 us per layer that do not scale with the bytes (~32 calls per
  // thread, each starting on a cold stream, a join): next_call 2 starts the next call's
  // stream one call early.
  size_t pf_l1 = g_prefetch_l1.load(std::memory_order_relaxed);  // the spread path below moves it (prefetch_to reads it)
  const size_t pf_l2 = g_prefetch_l2.load(std::memory_order_relaxed);
  const uint8_t *pf1 = wrow, *pf2 = wrow;
  // Prefetches never fault, so running past the matrix's end (into whatever follows) is safe.
  // With a next-call hint (followed), the stream continues there instead of past the end.
  const auto* nx = static_cast<const uint8_t*>(next);
  const int next_mode = nx ? g_prefetch_next_call.load(std::memory_order_relaxed) : 0;
  if (next_mode == 2) {
    // The next call's first lines into L2 now; this call's own streams stop at its end.
    const uint8_t* early = nx;
    prefetch_lines<2>(early, nx + std::min(next_bytes, std::max(pf_l1, pf_l2)), nx + next_bytes);
  }
  if (next_mode != 1) nx = nullptr;
  const bool past_end = next_mode == 0 && g_prefetch_past_end.load(std::memory_order_relaxed);
  const uint8_t* const pf1_end = past_end ? wend + pf_l1 : wend;
  const uint8_t* const pf2_end = past_end ? wend + pf_l2 : wend;
  const uint8_t *nx1 = nx, *nx2 = nx;
  // Everything before `p` plus the prefetch distances is requested; what reaches beyond this
  // call's rows goes to the hinted region, up to the distance (the next call's own start).
  auto prefetch_to = [&](const uint8_t* p) {
    if (pf_l1) {
      prefetch_lines<3>(pf1, p + pf_l1, pf1_end);
      if (nx && p + pf_l1 > wend) prefetch_lines<3>(nx1, nx + static_cast<size_t>(p + pf_l1 - wend), nx + std::min(next_bytes, pf_l1));
    }
    if (pf_l2) {
      prefetch_lines<2>(pf2, p + pf_l2, pf2_end);
      if (nx && p + pf_l2 > wend) prefetch_lines<2>(nx2, nx + static_cast<size_t>(p + pf_l2 - wend), nx + std::min(next_bytes, pf_l2));
    }
  };
  prefetch_to(wrow);
  int64_t r = row_begin;
  // Q4_K, Q8_0 and MXFP4 on the VNNI tier: register-blocked tiles of 4 rows x up to 4 tokens
  // (matvec_avx512.cpp) unpack each weight block once for all tokens and load each activation
  // block once for all four rows.
  using Rows4Fn = void (*)(int64_t, const void*, size_t, const void* const*, int, float*, int64_t);
  Rows4Fn rows4 = nullptr;
  if (fn == vec_dot_fn(type, CpuIsa::Avx512Vnni) && g_tile_rows4.load(std::memory_order_relaxed)) {
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
    const PackedTile tile = packed_tile_for(type, n_cols, n_tok);
    const PackedRows4Fn packed_rows4 = tile.rows4;
    const bool row_by_row = g_tile_row_by_row.load(std::memory_order_relaxed);
    if (packed_rows4 && r + 4 <= row_end) {
      const void* packed_ptr[kTokenChunk];
      pack_acts(tile, n_cols, a, act_row_bytes, tok, n_tok, packed_ptr);
      // Spread (MatvecPrefetch::spread): a step's prefetcht0 lines go out with the tile's blocks
      // instead of in one burst before it (while a whole step's lines fit before the end).
      const bool spread = pf_l1 > 0 && !row_by_row && g_prefetch_spread.load(std::memory_order_relaxed);
      if (spread) {
        // The spread stream's own distance (MatvecPrefetch::spread_l1_bytes): the frontier out to it now.
        pf_l1 = std::max<size_t>(64, g_prefetch_spread_l1.load(std::memory_order_relaxed));
        prefetch_lines<3>(pf1, wrow + pf_l1, pf1_end);
      }
      for (; r + 4 <= row_end; r += 4, wrow += 4 * wb) {
        if (spread && pf1 + 4 * wb <= pf1_end) {
          const uint8_t* from = pf1;
          pf1 += 4 * wb;
          prefetch_to(wrow + 4 * wb);  // the L2 stream only: the L1 one is at its target already
          packed_rows4(n_cols, wrow, wb, packed_ptr, n_tok, y + r, y_stride, false, from, 4 * wb);
          continue;
        }
        prefetch_to(wrow + 4 * wb);
        packed_rows4(n_cols, wrow, wb, packed_ptr, n_tok, y + r, y_stride, row_by_row, nullptr, 0);
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

namespace {

// The background regions of matvec_tokens_runs as one sequence of lines, handed out in parts.
class BackgroundPrefetch {
 public:
  BackgroundPrefetch(const PrefetchRegion* r, int n) : regions_(r), n_(n) {
    for (int i = 0; i < n; ++i) total_ += r[i].bytes;
  }
  // Issues the lines up to part k + 1 of n (prefetcht1), from where the last call stopped.
  void part(int64_t k, int64_t n) {
    if (total_ == 0 || n <= 0) return;
    const size_t to = total_ * static_cast<size_t>(k + 1) / static_cast<size_t>(n);
    while (done_ < to && i_ < n_) {
      const PrefetchRegion& rg = regions_[i_];
      const auto* p = static_cast<const uint8_t*>(rg.p);
      const size_t stop = std::min(rg.bytes, off_ + (to - done_));
      for (size_t o = off_; o < stop; o += 64) __builtin_prefetch(p + o, 0, 2);
      done_ += stop - off_;
      off_ = stop;
      if (off_ >= rg.bytes) {
        ++i_;
        off_ = 0;
      }
    }
  }
  void all() { part(0, 1); }

 private:
  const PrefetchRegion* regions_;
  int n_;
  size_t total_ = 0, done_ = 0, off_ = 0;
  int i_ = 0;
};

}  // namespace

void matvec_tokens_runs(TensorType type, int64_t n_cols, const MatvecRun* runs, int n_runs, const void* acts, size_t act_row_bytes,
                        const int32_t* tok, int n_tok, int64_t y_stride, const RunsPrefetch& extra) {
  const VecDotFn fn = best_vec_dot_fn(type);
  if (!fn) throw std::invalid_argument("matvec_tokens_runs: no kernel for weight type " + std::string(type_name(type)));
  constexpr int kMaxRuns = 16;
  if (n_runs > kMaxRuns) throw std::invalid_argument("matvec_tokens_runs: " + std::to_string(n_runs) + " runs (at most 16)");
  BackgroundPrefetch bg(extra.background, extra.n_background);
  if (n_runs <= 0 || n_tok <= 0) return bg.all();
  if (const MatvecMath m = g_math.load(std::memory_order_relaxed); m != MatvecMath::Compute) {
    bg.all();
    return read_runs_only(m, row_bytes(type, n_cols), runs, n_runs, n_tok, y_stride, g_prefetch_spread_l1.load(std::memory_order_relaxed));
  }
  const size_t pf_l1 = g_prefetch_l1.load(std::memory_order_relaxed);
  const PackedTile tile = fn == vec_dot_fn(type, CpuIsa::Avx512Vnni) && g_tile_rows4.load(std::memory_order_relaxed) && !matvec_uses_amx(type, n_tok)
                              ? packed_tile_for(type, n_cols, n_tok)
                              : PackedTile{};
  const bool interleave = tile.rows4 && pf_l1 > 0 && g_prefetch_spread.load(std::memory_order_relaxed) &&
                          !g_tile_row_by_row.load(std::memory_order_relaxed);
  if (!interleave) {
    // One run after the other, the background lines spread over them.
    for (int i = 0; i < n_runs; ++i) {
      bg.part(i, n_runs);
      matvec_tokens(type, n_cols, runs[i].w, runs[i].row_begin, runs[i].row_end, acts, act_row_bytes, tok, n_tok, runs[i].y, y_stride);
    }
    return;
  }
  const size_t wb = row_bytes(type, n_cols);
  const size_t step = 4 * wb;
  size_t dist = g_prefetch_runs_l1.load(std::memory_order_relaxed);
  if (dist == 0) dist = std::max<size_t>(2048, g_prefetch_spread_l1.load(std::memory_order_relaxed) / static_cast<size_t>(n_runs));
  // The next-call hint (MatvecPrefetch::next_call): 2, its first bytes into L2 now; 1, its
  // prefetcht0 frontier `nx`, moved a step's lines at a time by the streams done with their own.
  const auto* nx = static_cast<const uint8_t*>(extra.next);
  const int next_mode = nx ? g_prefetch_next_call.load(std::memory_order_relaxed) : 0;
  const uint8_t* const nx_end = nx ? nx + std::min(extra.next_bytes, dist) : nullptr;
  if (next_mode == 2) {
    const uint8_t* early = nx;
    prefetch_lines<2>(early, nx_end, nx_end);
  }
  const void* packed_ptr[kTokenChunk];
  pack_acts(tile, n_cols, static_cast<const uint8_t*>(acts), act_row_bytes, tok, n_tok, packed_ptr);
  const size_t dist2 = g_prefetch_runs_l2.load(std::memory_order_relaxed);
  struct Stream {
    const uint8_t *w, *end, *pf, *pf2;
    int64_t r, r_end;
    float* y;
  };
  Stream st[kMaxRuns];
  int64_t steps = 0;
  for (int i = 0; i < n_runs; ++i) {
    const MatvecRun& run = runs[i];
    const auto* base = static_cast<const uint8_t*>(run.w);
    Stream& s = st[i];
    s.r = run.row_begin;
    s.r_end = std::max(run.row_begin, run.row_end);
    s.w = base + static_cast<size_t>(s.r) * wb;
    s.end = base + static_cast<size_t>(s.r_end) * wb;
    s.pf = s.w;
    s.pf2 = s.w + std::min(dist, static_cast<size_t>(s.end - s.w));  // the L2 stream starts where the L1 one ends
    s.y = run.y;
    steps += (s.r_end - s.r) / 4;
    prefetch_lines<3>(s.pf, s.w + dist, s.end);  // each stream's frontier out to its distance
  }
  // 4-row steps in turn; a stream's prefetcht0 lines go out spread over its step's blocks.
  int64_t k = 0;
  for (bool any = true; any;) {
    any = false;
    for (int i = 0; i < n_runs; ++i) {
      Stream& s = st[i];
      if (s.r + 4 > s.r_end) continue;
      any = true;
      bg.part(k++, steps);
      if (dist2 > 0) {
        const uint8_t* const target = s.w + step + dist2;
        prefetch_lines<2>(s.pf2, std::min(target, s.pf2 + 2 * step), s.end);
      }
      if (s.pf + step <= s.end) {
        const uint8_t* from = s.pf;
        s.pf += step;
        tile.rows4(n_cols, s.w, wb, packed_ptr, n_tok, s.y + s.r, y_stride, false, from, step);
      } else {
        prefetch_lines<3>(s.pf, s.end, s.end);
        if (next_mode == 1 && nx < nx_end) prefetch_lines<3>(nx, nx + step, nx_end);
        tile.rows4(n_cols, s.w, wb, packed_ptr, n_tok, s.y + s.r, y_stride, false, nullptr, 0);
      }
      s.r += 4;
      s.w += step;
    }
  }
  bg.all();
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
