#include "kernels/cuda/attention_decode.h"

#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/formats/block_layouts.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"

namespace moraine::cuda {
namespace {

constexpr int kTile = static_cast<int>(kDecodeTile);   // positions staged at once: one per lane
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float warp_max(float v) {
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(kFull, v, off));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(kFull, v, off);
  return v;
}

// Position of the call's first row, or -1 when the device value cannot serve the call.
__device__ __forceinline__ int64_t first_position(const int32_t* pos_dev, int64_t row_offset, int64_t n,
                                                  int64_t max_ctx) {
  const int64_t p = *pos_dev;
  return p < 0 || p + row_offset + n > max_ctx ? -1 : p + row_offset;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// The merge keeps split c's max and sum in lane c % 32, register c / 32.
constexpr int kSplitsPerLane = static_cast<int>((kDecodeMaxSplits + 31) / 32);

// KV is the cache element type (float or __half); the scores and sums are float either way (a
// half element becomes its exact float on the load from shared memory).
template <class KV>
struct DecodeArgs {
  const float* q;
  const KV* k;
  const KV* v;
  const int32_t* pos;
  int64_t row_offset, max_ctx, kv_stride;
  int n, n_head, group, slots;
  float scale;
  float* part;
  const float* gate;
  int64_t gate_row_stride, gate_head_stride;
  float* out;
  BlockQ8_0* act;   // null, or out's rows quantized as Q8_0 with llama.cpp's rule (by the merge)
  // attention_decode_fused_qk (one row): q, k, v are the raw projections, normalised and rotated
  // here with qk_norm_rope_store's arithmetic; k and v of the new position also go to the cache.
  const float* q_raw;
  int64_t q_head_stride;
  const float* k_raw;
  const float* v_raw;
  const float* q_norm;
  const float* k_norm;
  int n_rot;
  double freq_base;
  float eps;
  KV* k_store;   // the caches, writable (k / v above are the same memory)
  KV* v_store;
  const float* sinks;   // AttentionShape::sinks (nullable) and ::window (0: full attention)
  int64_t window;
};

// The first position a row sees: the one at position p sees p - window + 1 .. p (window > 0).
__device__ __forceinline__ int64_t window_first(int64_t window, int64_t seen) {
  return window > 0 && seen > window ? seen - window : 0;
}

// Two stages of the cp.async ring: a third gave nothing (H200, 2026-11-30: 21.4 vs 20.5 us at 4096
// positions, 71.6 vs 70.8 at 32768) and fits fewer CTAs per SM (2 instead of 3 for 8 query heads
// of 128 per kv head).
constexpr int kStages = 2;

// Lane `lane` of a warp owns NV groups of VEC consecutive output floats: dims (j * 32 + lane) * VEC
// + e (float4 loads of V rows and records, conflict-free).
template <int DPL>
struct LaneDims {
  static constexpr int kVec = DPL >= 4 ? 4 : DPL;
  static constexpr int kGroups = DPL / kVec;
  __device__ static void load(const float* row, int lane, float* x, bool l2_only) {
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      const float* p = row + (j * 32 + lane) * kVec;
      if constexpr (kVec == 4) {
        const float4 f = l2_only ? __ldcg(reinterpret_cast<const float4*>(p)) : *reinterpret_cast<const float4*>(p);
        x[j * 4] = f.x, x[j * 4 + 1] = f.y, x[j * 4 + 2] = f.z, x[j * 4 + 3] = f.w;
      } else {
        const float2 f = l2_only ? __ldcg(reinterpret_cast<const float2*>(p)) : *reinterpret_cast<const float2*>(p);
        x[j * 2] = f.x, x[j * 2 + 1] = f.y;
      }
    }
  }
  // The same floats from a row of halves in shared memory (kVec halves per group: 8 or 4 bytes).
  __device__ static void load(const __half* row, int lane, float* x) {
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      const __half* p = row + (j * 32 + lane) * kVec;
      if constexpr (kVec == 4) {
        const uint2 u = *reinterpret_cast<const uint2*>(p);
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
        const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
        x[j * 4] = a.x, x[j * 4 + 1] = a.y, x[j * 4 + 2] = b.x, x[j * 4 + 3] = b.y;
      } else {
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(p));
        x[j * 2] = a.x, x[j * 2 + 1] = a.y;
      }
    }
  }
  __device__ static int dim(int i, int lane) { return ((i / kVec) * 32 + lane) * kVec + i % kVec; }
};

// The cache element's layout in the shared-memory ring. K rows are padded by 16 bytes (4 floats,
// 8 halves): lane p's 16-byte reads of row p then fall in distinct banks, and every row start
// stays 16-byte aligned for cp.async. A 16-byte copy moves kPerCopy elements.
template <class KV>
struct KvSmem {
  static constexpr int kPad = 16 / static_cast<int>(sizeof(KV));
  static constexpr int kPerCopy = 16 / static_cast<int>(sizeof(KV));
};

// Four consecutive K elements of a row in shared memory as floats, for the i-th group of four
// of the score's dot product: a float4 read, or (halves) one 16-byte read for groups 2m and 2m + 1.
__device__ __forceinline__ float4 k_quad(const float* row, int i) { return reinterpret_cast<const float4*>(row)[i]; }
__device__ __forceinline__ void k_octet(const __half* row, int m, float4& lo, float4& hi) {
  const uint4 u = reinterpret_cast<const uint4*>(row)[m];
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  const float2 c = __half22float2(*reinterpret_cast<const __half2*>(&u.z));
  const float2 d = __half22float2(*reinterpret_cast<const __half2*>(&u.w));
  lo = make_float4(a.x, a.y, b.x, b.y);
  hi = make_float4(c.x, c.y, d.x, d.y);
}

// The head's output floats of this lane (LaneDims' layout, v[i] at dims LaneDims::dim(i, lane))
// into act's Q8_0 blocks with quantize_activations_llama's rule and bits (quantize_block.cuh's
// quantize_q8_0_llama_warp): a 32-element block is 32 / kVec lanes of one group, so its amax is
// an xor tree over those lanes (fmaxf: the order does not matter), then each lane rounds its own.
template <int DPL>
__device__ void quantize_head_q8_0(const float* v, BlockQ8_0* blocks, int lane) {
  using D = LaneDims<DPL>;
  constexpr int kLanesPerBlock = 32 / D::kVec;
#pragma unroll
  for (int j = 0; j < D::kGroups; ++j) {
    float amax = fabsf(v[j * D::kVec]);   // as the unfused kernel's first step (NaN stays NaN)
#pragma unroll
    for (int e = 1; e < D::kVec; ++e) amax = fmaxf(amax, fabsf(v[j * D::kVec + e]));
    for (int off = kLanesPerBlock / 2; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, off));
    const int first = (j * 32 + lane) * D::kVec;   // the head's dim of v[j * kVec]
    BlockQ8_0& b = blocks[first / 32];
    const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
#pragma unroll
    for (int e = 0; e < D::kVec; ++e) {
      const float r = rintf(__fmul_rn(v[j * D::kVec + e], id));
      int q = -128;
      if (!isnan(r) && r < 2147483648.0f && r >= -2147483648.0f) q = max(-128, min(127, static_cast<int>(r)));
      b.qs[first % 32 + e] = static_cast<int8_t>(q);
    }
    if (first % 32 == 0) b.d = __half_as_ushort(__float2half_rn(__fdiv_rn(amax, 127.0f)));
  }
}

template <int DPL, class KV>
__device__ void write_nan_head(const DecodeArgs<KV>& a, int r, int h, int hd, int lane) {
  float* o = a.out + (static_cast<int64_t>(r) * a.n_head + h) * hd;
  for (int d = lane; d < hd; d += 32) o[d] = __int_as_float(0x7fc00000);
  if (a.act != nullptr) {   // the NaN rows quantized as quantize_activations_llama would
    float v[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) v[i] = __int_as_float(0x7fc00000);
    quantize_head_q8_0<DPL>(v, a.act + (static_cast<int64_t>(r) * a.n_head + h) * hd / 32, lane);
  }
}

// Combines the S split records of (row r, head h) in split order (one warp). Records:
// [out[hd], max, sum, pad, pad] at part + ((r * n_head + h) * slots + split) * (hd + 4).
// kOss (gpt-oss, a separate instantiation: the others' code is unchanged): the head's sink logit.
template <int DPL, class KV, bool kOss>
__device__ void merge_head(const DecodeArgs<KV>& a, int r, int h, int64_t S, int lane) {
  constexpr int hd = DPL * 32, kRec = hd + 4, kPerLane = kSplitsPerLane;
  const float* base = a.part + (static_cast<int64_t>(r) * a.n_head + h) * a.slots * kRec;
  float mc[kPerLane], lc[kPerLane], fc[kPerLane];
  float mx = -INFINITY;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int64_t c = lane + 32 * k;
    mc[k] = c < S ? __ldcg(base + c * kRec + hd) : -INFINITY;
    lc[k] = c < S ? __ldcg(base + c * kRec + hd + 1) : 0.0f;
    mx = fmaxf(mx, mc[k]);
  }
  mx = warp_max(mx);
  float ls = 0.0f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    fc[k] = lane + 32 * k < S ? expf(mc[k] - mx) : 0.0f;
    ls += lc[k] * fc[k];
  }
  const float l = warp_sum(ls);
  // Records in batches of kBatch loaded before any is used: the merge is L2-latency bound.
  constexpr int kBatch = 8;
  float acc[DPL], x[kBatch][DPL];
#pragma unroll
  for (int i = 0; i < DPL; ++i) acc[i] = 0.0f;
  for (int c0 = 0; c0 < S; c0 += kBatch) {
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (c0 + b < S) LaneDims<DPL>::load(base + (c0 + b) * kRec, lane, x[b], true);
    float fk = fc[0];   // the factors of splits c0 .. c0 + kBatch - 1 (one register slot: kBatch divides 32)
#pragma unroll
    for (int k = 1; k < kPerLane; ++k)
      if (c0 >= 32 * k) fk = fc[k];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (c0 + b >= S) break;
      const float f = __shfl_sync(kFull, fk, (c0 + b) % 32);
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[i] = fmaf(f, x[b][i], acc[i]);
    }
  }
  // A sink (gpt-oss): one more logit in the softmax, its exp in the denominator only. m_s is the
  // max of the splits and the sink; without a sink m_s = mx and the factor is exactly 1.
  [[maybe_unused]] float inv_l = 1.0f, rescale = 1.0f;
  if constexpr (kOss) {
    inv_l = 1.0f / l;
    if (a.sinks != nullptr) {
      const float sink = a.sinks[h], m_s = fmaxf(mx, sink);
      rescale = expf(mx - m_s);
      inv_l = 1.0f / (l * rescale + expf(sink - m_s));
    }
  }
  float* o = a.out + (static_cast<int64_t>(r) * a.n_head + h) * hd;
  const float* g = a.gate != nullptr ? a.gate + r * a.gate_row_stride + h * a.gate_head_stride : nullptr;
  float v[DPL];
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    const int d = LaneDims<DPL>::dim(i, lane);
    if constexpr (kOss) v[i] = a.sinks != nullptr ? acc[i] * rescale * inv_l : acc[i] * inv_l;
    else v[i] = acc[i] / l;
    if (g != nullptr) v[i] *= 1.0f / (1.0f + expf(-g[d]));
    o[d] = v[i];
  }
  if (a.act != nullptr) quantize_head_q8_0<DPL>(v, a.act + (static_cast<int64_t>(r) * a.n_head + h) * hd / 32, lane);
}

// ---- attention_decode_fused_qk: qk_norm_rope_store's work inside the split kernel ----
// The same float and double operations as qk_norm_rope_store.cu (head_rms_norm's lane-strided
// double sum of squares and xor tree, its rounded scale; rope.cu's table expression and rotation),
// so q, and k and v as stored in the cache, get its bits (tests/cuda/attention_decode_test.cpp
// compares the cache and the output with the unfused pair).

__device__ __forceinline__ void put_kv(float* p, float x) { *p = x; }
__device__ __forceinline__ void put_kv(__half* p, float x) { *p = __float2half_rn(x); }

// RoPE: entry k of the table (k < n_rot; cos of pair k for k < half, sin of pair k - half above)
// is entry k / blockDim.x of thread k % blockDim.x: at most kRopePerThread (n_rot <= 256, at
// least 128 threads). The frequencies do not depend on the position: computed before the wait.
constexpr int kRopePerThread = 2;

__device__ __forceinline__ void rope_freqs(double* freq, int n_rot, double freq_base) {
  const int half = n_rot / 2;
#pragma unroll
  for (int j = 0; j < kRopePerThread; ++j) {
    const int k = threadIdx.x + j * blockDim.x;
    const int i = k < half ? k : k - half;
    freq[j] = k < 2 * half ? pow(freq_base, -2.0 * static_cast<double>(i) / static_cast<double>(n_rot)) : 0.0;
  }
}

__device__ __forceinline__ void rope_table(float* table, const double* freq, int n_rot, int64_t pos) {
  const int half = n_rot / 2;
#pragma unroll
  for (int j = 0; j < kRopePerThread; ++j) {
    const int k = threadIdx.x + j * blockDim.x;
    if (k < 2 * half) {
      const double theta = static_cast<double>(pos) * freq[j];
      table[k] = static_cast<float>(k < half ? cos(theta) : sin(theta));
    }
  }
}

// One warp: head xh (hd floats) normalised with weight w and rotated; element i goes to put(i, v).
// put may write xh itself: lane l reads only elements it writes after the xor tree (which every
// lane reaches after its last read of the sum).
template <class Put>
__device__ __forceinline__ void norm_rope_head(const float* xh, const float* w, const float* table, int hd, int n_rot,
                                               float eps, int lane, Put put) {
  double ss = 0.0;
  for (int i = lane; i < hd; i += 32) {
    const double x = xh[i];
    ss += x * x;
  }
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(kFull, ss, off);
  const float mean = __double2float_rn(__ddiv_rn(ss, static_cast<double>(hd)));
  const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
  const int half = n_rot / 2;
  for (int i = lane; i < half; i += 32) {
    const float n0 = __fmul_rn(__fmul_rn(xh[i], inv), w[i]);
    const float n1 = __fmul_rn(__fmul_rn(xh[i + half], inv), w[i + half]);
    const float cs = table[i], sn = table[half + i];
    put(i, __fsub_rn(__fmul_rn(n0, cs), __fmul_rn(n1, sn)));
    put(i + half, __fadd_rn(__fmul_rn(n0, sn), __fmul_rn(n1, cs)));
  }
  for (int i = n_rot + lane; i < hd; i += 32) put(i, __fmul_rn(__fmul_rn(xh[i], inv), w[i]));
}

// decode_split_kernel's fused q/k work (kFusedQk), after the RoPE table and the raw q, k, v are in
// shared memory: the launch gives a fused CTA a warp more than the group's heads (up to 16
// warps): warp j normalises and rotates q head j in place in qs (and j + warps, ...), the last
// warp of the CTA holding the new position makes its k and v (into the cache, into k_new / v_new
// and into the ring rows of p0 when its tile was already issued). Everything written here is read
// after the tile loop's first barrier.
template <int DPL, class KV>
__device__ __forceinline__ void fused_new_kv_and_q(const DecodeArgs<KV> a, float* qs, const float* qn_s,
                                                   const float* kn_s, const float* kraw_s, const float* vraw_s,
                                                   const float* table, KV* k_new, KV* v_new, KV* new_k_row,
                                                   KV* new_v_row, int64_t p0, int kvh, bool holds_new, int warp,
                                                   int lane) {
  constexpr int hd = DPL * 32;
  const int warps = static_cast<int>(blockDim.x / 32);
  if (holds_new && warp == warps - 1) {
    KV* kc = a.k_store + p0 * a.kv_stride + static_cast<int64_t>(kvh) * hd;
    KV* vc = a.v_store + p0 * a.kv_stride + static_cast<int64_t>(kvh) * hd;
    norm_rope_head(kraw_s, kn_s, table, hd, a.n_rot, a.eps, lane, [&](int i, float x) {
      put_kv(kc + i, x);
      put_kv(k_new + i, x);
      if (new_k_row != nullptr) put_kv(new_k_row + i, x);
    });
    for (int i = lane; i < hd; i += 32) {
      const float x = vraw_s[i];
      put_kv(vc + i, x);
      put_kv(v_new + i, x);
      if (new_v_row != nullptr) put_kv(new_v_row + i, x);
    }
  }
  for (int j = warp; j < a.group; j += warps) {
    float* qj = qs + j * hd;
    norm_rope_head(qj, qn_s, table, hd, a.n_rot, a.eps, lane, [&](int i, float x) { qj[i] = x; });
  }
}

// One tile of a split for a warp's HPW heads (decode_split_kernel): lane p scores position p
// against each head's q (4 interleaved fma chains over head_dim), the online softmax takes the
// tile's max and sum, and every lane adds its output dims of the live positions' V rows.
template <int DPL, int HPW, class KV>
__device__ __forceinline__ void decode_tile(const float* qs, const KV* ks, const KV* vs, int live, float scale,
                                            int warp, int lane, float (&m)[HPW], float (&l)[HPW],
                                            float (&acc)[HPW][DPL]) {
  constexpr int hd = DPL * 32, kRowK = hd + KvSmem<KV>::kPad;
  float vx[DPL];
  float sc[HPW];
#pragma unroll
  for (int j = 0; j < HPW; ++j) sc[j] = -INFINITY;
  if (lane < live) {
    const KV* kr = ks + lane * kRowK;
    float d[HPW][4];
#pragma unroll
    for (int j = 0; j < HPW; ++j) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.0f;
    // Group i of four dims: the four chains take q's and K's dims 4i .. 4i + 3.
    auto step = [&](int i, const float4 y) {
#pragma unroll
      for (int j = 0; j < HPW; ++j) {
        const float4 x = reinterpret_cast<const float4*>(qs + (warp * HPW + j) * hd)[i];
        d[j][0] = fmaf(x.x, y.x, d[j][0]);
        d[j][1] = fmaf(x.y, y.y, d[j][1]);
        d[j][2] = fmaf(x.z, y.z, d[j][2]);
        d[j][3] = fmaf(x.w, y.w, d[j][3]);
      }
    };
    if constexpr (sizeof(KV) == 4) {
#pragma unroll
      for (int i = 0; i < hd / 4; ++i) step(i, k_quad(kr, i));
    } else {
#pragma unroll
      for (int m8 = 0; m8 < hd / 8; ++m8) {
        float4 lo, hi;
        k_octet(kr, m8, lo, hi);
        step(2 * m8, lo);
        step(2 * m8 + 1, hi);
      }
    }
#pragma unroll
    for (int j = 0; j < HPW; ++j) sc[j] = ((d[j][0] + d[j][1]) + (d[j][2] + d[j][3])) * scale;
  }
  float w[HPW];
#pragma unroll
  for (int j = 0; j < HPW; ++j) {
    const float m_new = fmaxf(m[j], warp_max(sc[j]));
    const float corr = m[j] == -INFINITY ? 0.0f : expf(m[j] - m_new);
    w[j] = lane < live ? expf(sc[j] - m_new) : 0.0f;
    l[j] = l[j] * corr + warp_sum(w[j]);
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[j][i] *= corr;
    m[j] = m_new;
  }
#pragma unroll 4
  for (int p = 0; p < live; ++p) {
    if constexpr (sizeof(KV) == 4) {
      LaneDims<DPL>::load(vs + p * hd, lane, vx, false);
    } else {
      LaneDims<DPL>::load(vs + p * hd, lane, vx);
    }
#pragma unroll
    for (int j = 0; j < HPW; ++j) {
      const float wp = __shfl_sync(kFull, w[j], p);
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[j][i] = fmaf(wp, vx[i], acc[j][i]);
    }
  }
}

// One CTA per (row, split slot, kv head), row fastest so the rows of a step reading the same
// positions run side by side (the second row finds the K/V tiles in L2). Warp w serves query heads
// w * HPW .. w * HPW + HPW - 1 of the kv head's group (HPW = 2: each K and V float read from
// shared memory serves two heads; extra warps, up to 4, only load). Tiles of 32 positions go
// through a kStages-deep cp.async ring in shared memory (K rows padded by 16 bytes: lane p's
// 16-byte reads of row p are conflict-free), one __syncthreads per tile; lane p scores position p
// (4 interleaved fma chains over head_dim), the warp keeps an online softmax per head and
// accumulates its lane's output floats, then writes the split's record. A half cache goes through
// the same ring as halves (half the bytes) and is widened on the shared-memory reads; the float
// arithmetic and its order are those of the float cache, so a half cache gives the float cache's
// bits for the same (half-representable) values.
// kOss (gpt-oss, a separate instantiation): the row's tiles start at its sliding window's first position.
template <int DPL, int HPW, class KV, bool kFusedQk, bool kOss = false>
__global__ void __launch_bounds__(HPW == 1 ? 1024 : 512) decode_split_kernel(const DecodeArgs<KV> a) {
  constexpr int STAGES = kStages;
  constexpr int hd = DPL * 32, kRowK = hd + KvSmem<KV>::kPad, kRec = hd + 4;
  constexpr int kStage = kTile * kRowK + kTile * hd;   // elements of KV
  constexpr int kCopies = hd / KvSmem<KV>::kPerCopy;   // 16-byte copies per row
  extern __shared__ float4 smem_f4[];
  float* qs = reinterpret_cast<float*>(smem_f4);             // [group][hd]
  KV* ring = reinterpret_cast<KV*>(qs + a.group * hd);       // STAGES x ([kTile][kRowK] K, [kTile][hd] V)
  // kFusedQk: the q and k norm weights, the raw k and v of the new position, the RoPE table
  // [hd] floats each, then the new position's k and v as stored [hd] KV each.
  float* qn_s = reinterpret_cast<float*>(ring + STAGES * kStage);
  float* kn_s = qn_s + hd;
  float* kraw_s = kn_s + hd;
  float* vraw_s = kraw_s + hd;
  float* table = vraw_s + hd;
  KV* k_new = reinterpret_cast<KV*>(table + hd);
  KV* v_new = k_new + hd;
  const int r = blockIdx.x, slot = blockIdx.y, kvh = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int compute_warps = a.group / HPW;
  const int h0 = kvh * a.group + warp * HPW;   // first head of this warp
  // kFusedQk: everything that no kernel of the step writes goes in flight before the wait on the
  // previous kernel (PDL, launch.h), overlapping its tail: the norm weights, the RoPE
  // frequencies, the position (copied in before the step's first kernel, which every later
  // kernel's launch follows) and the K / V tiles below p0 (written by earlier steps; p0 itself is
  // made here). Only the projections (q, k, v) wait.
  [[maybe_unused]] double freq[kRopePerThread];
  if constexpr (kFusedQk) {
    for (int i = threadIdx.x; i < hd / 4; i += blockDim.x) {
      cp_async16(qn_s + 4 * i, a.q_norm + 4 * i);
      cp_async16(kn_s + 4 * i, a.k_norm + 4 * i);
    }
    rope_freqs(freq, a.n_rot, a.freq_base);
  } else {
    wait_for_prior_grids();
    allow_dependent_grids();
    // q does not depend on the position: its load overlaps the position's.
    const float* qg = a.q + (static_cast<int64_t>(r) * a.n_head + static_cast<int64_t>(kvh) * a.group) * hd;
    for (int i = threadIdx.x; i < a.group * hd / 4; i += blockDim.x) cp_async16(qs + 4 * i, qg + 4 * i);
  }
  const int64_t p0 = first_position(a.pos, a.row_offset, a.n, a.max_ctx);
  // The row sees positions lo .. p0 + r (lo > 0 only in a sliding window); tiles count from lo.
  const int64_t lo = kOss ? window_first(a.window, p0 + r + 1) : 0;
  const int64_t seen = p0 + r + 1 - lo, tiles = (seen + kTile - 1) / kTile;
  const int64_t S = p0 < 0 ? 0 : attention_decode_splits(seen);
  if (p0 < 0 || slot >= S) {
    if constexpr (kFusedQk) wait_for_prior_grids();   // completion stays transitive (launch.h)
    cp_async_wait<0>();   // no copy outlives the CTA (the merge kernel writes the NaN rows)
    return;
  }
  const int64_t tb = slot * tiles / S, te = (slot + 1) * tiles / S;
  // kFusedQk (one row, r = 0): the last split holds the new position p0, whose k and v this CTA
  // makes (kv head kvh): into the cache, and into the ring row of p0 (the cache's bytes, which
  // cp.async cannot be relied on to see yet) directly when its tile is already issued, else
  // through k_new / v_new when issue() gets to that tile. The tiles go in flight first, then the
  // RoPE table, k and v, and q (the position's math overlaps the loads).
  const bool holds_new = kFusedQk && slot == S - 1;
  bool new_made = false;                        // k_new / v_new hold p0's row
  KV* new_k_row = nullptr;                      // p0's ring rows, issued before they were made
  KV* new_v_row = nullptr;
  auto issue = [&](int64_t t, int buf) {
    KV* ks = ring + buf * kStage;
    KV* vs = ks + kTile * kRowK;
    const int live = static_cast<int>(seen - t * kTile < kTile ? seen - t * kTile : kTile);
    const bool has_new = holds_new && t * kTile + live == seen;   // p0 is this tile's last row
    const int from_global = has_new ? live - 1 : live;
    for (int i = threadIdx.x; i < from_global * kCopies; i += blockDim.x) {
      const int p = i / kCopies, e = (i % kCopies) * KvSmem<KV>::kPerCopy;
      const int64_t src = (lo + t * kTile + p) * a.kv_stride + static_cast<int64_t>(kvh) * hd + e;
      cp_async16(ks + p * kRowK + e, a.k + src);
      cp_async16(vs + p * hd + e, a.v + src);
    }
    if (!has_new) return;
    if (new_made) {   // visible to the warps after the barrier before the tile is used
      for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        ks[from_global * kRowK + i] = k_new[i];
        vs[from_global * hd + i] = v_new[i];
      }
    } else {
      new_k_row = ks + from_global * kRowK;
      new_v_row = vs + from_global * hd;
    }
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (tb + s < te) issue(tb + s, s);
    cp_async_commit();
  }
  if constexpr (kFusedQk) {
    wait_for_prior_grids();
    allow_dependent_grids();
    // The raw q heads into qs (normalised in place below), and the new position's raw k and v.
    for (int i = threadIdx.x; i < a.group * hd / 4; i += blockDim.x) {
      const int j = i / (hd / 4), e = 4 * (i % (hd / 4));
      cp_async16(qs + j * hd + e, a.q_raw + static_cast<int64_t>(kvh * a.group + j) * a.q_head_stride + e);
    }
    if (holds_new) {
      for (int i = threadIdx.x; i < hd / 4; i += blockDim.x) {
        cp_async16(kraw_s + 4 * i, a.k_raw + static_cast<int64_t>(kvh) * hd + 4 * i);
        cp_async16(vraw_s + 4 * i, a.v_raw + static_cast<int64_t>(kvh) * hd + 4 * i);
      }
    }
    cp_async_commit();
    rope_table(table, freq, a.n_rot, p0);
    cp_async_wait<0>();   // with the first tiles, issued before the wait (landed by now, mostly)
    __syncthreads();      // the table and every thread's copies
    fused_new_kv_and_q<DPL>(a, qs, qn_s, kn_s, kraw_s, vraw_s, table, k_new, v_new, new_k_row, new_v_row, p0, kvh,
                            holds_new, warp, lane);
    new_made = holds_new;
  }
  float m[HPW], l[HPW], acc[HPW][DPL];
#pragma unroll
  for (int j = 0; j < HPW; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[j][i] = 0.0f;
  }
  for (int64_t t = tb; t < te; ++t) {
    const int k = static_cast<int>(t - tb);
    cp_async_wait<STAGES - 2>();
    __syncthreads();   // tile t landed for every thread; every warp is done with the buffer refilled next
    if (t + STAGES - 1 < te) issue(t + STAGES - 1, (k + STAGES - 1) % STAGES);
    cp_async_commit();
    if (warp >= compute_warps) continue;
    const KV* ks = ring + (k % STAGES) * kStage;
    const KV* vs = ks + kTile * kRowK;
    const int live = static_cast<int>(seen - t * kTile < kTile ? seen - t * kTile : kTile);
    decode_tile<DPL, HPW>(qs, ks, vs, live, a.scale, warp, lane, m, l, acc);
  }
  if (warp < compute_warps) {
#pragma unroll
    for (int j = 0; j < HPW; ++j) {
      float* rec = a.part + ((static_cast<int64_t>(r) * a.n_head + h0 + j) * a.slots + slot) * kRec;
#pragma unroll
      for (int i = 0; i < DPL; ++i) rec[LaneDims<DPL>::dim(i, lane)] = acc[j][i];
      if (lane == 0) {
        rec[hd] = m[j];
        rec[hd + 1] = l[j];
      }
    }
  }
}

// One warp per (row, head): the merges of a step spread over n * n_head CTAs.
template <int DPL, class KV, bool kOss = false>
__global__ void decode_merge_kernel(const DecodeArgs<KV> a) {
  const int r = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
  wait_for_prior_grids();
  allow_dependent_grids();
  const int64_t p0 = first_position(a.pos, a.row_offset, a.n, a.max_ctx);
  if (p0 < 0) {
    write_nan_head<DPL>(a, r, h, DPL * 32, lane);
    return;
  }
  const int64_t seen = p0 + r + 1 - (kOss ? window_first(a.window, p0 + r + 1) : 0);
  merge_head<DPL, KV, kOss>(a, r, h, attention_decode_splits(seen), lane);
}

// fused: room for the norm weights, the raw and stored new k and v, and the RoPE table.
template <class KV>
size_t split_smem_bytes(int hd, int group, bool fused) {
  return static_cast<size_t>(group * hd) * sizeof(float) +
         static_cast<size_t>(kStages * (kTile * (hd + KvSmem<KV>::kPad) + kTile * hd)) * sizeof(KV) +
         (fused ? static_cast<size_t>(hd) * (5 * sizeof(float) + 2 * sizeof(KV)) : 0);
}

// Above 48 KB of shared memory a kernel needs an opt-in (per device): given once, for the largest
// group (32 query heads per kv head), it serves every shape.
template <int DPL, int HPW, class KV, bool kFusedQk, bool kOss>
void opt_in_shared_memory() {
  static std::atomic<uint64_t> devices_done{0};
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (devices_done.load(std::memory_order_relaxed) & bit) != 0) return;
  CUDA_CHECK(cudaFuncSetAttribute(decode_split_kernel<DPL, HPW, KV, kFusedQk, kOss>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(split_smem_bytes<KV>(DPL * 32, 32, kFusedQk))));
  devices_done.fetch_or(bit);
}

// Both kernels go out with programmatic stream serialization (launch.h): the split kernel lets the
// merge kernel launch at once (its CTAs wait in wait_for_prior_grids for the split kernel's
// completion and memory), and waits itself for whatever ran before it before reading q, K/V or
// the position.
template <int DPL, int HPW, class KV, bool kFusedQk, bool kOss = false>
void launch_split(const DecodeArgs<KV>& a, int n_kv, cudaStream_t stream) {
  const size_t smem = split_smem_bytes<KV>(DPL * 32, a.group, kFusedQk);
  if (smem > 48 * 1024) opt_in_shared_memory<DPL, HPW, KV, kFusedQk, kOss>();
  const dim3 grid(static_cast<unsigned>(a.n), static_cast<unsigned>(a.slots), static_cast<unsigned>(n_kv));
  // Warps: the group's heads / HPW compute, at least 4 load; fused, one per q head and one for the
  // new k and v where that stays within 16 (the kernel's q pass; H200 decode chain at 600
  // positions: 8 heads on 4 warps, two norms each in a row and k before them, -0.12 us per
  // layer against the unfused pair; this way, with the tiles loaded before the wait, -0.54).
  int warps = std::max(a.group / HPW, 4);
  if (kFusedQk) warps = std::max(warps, std::min(a.group + 1, 16));
  launch_kernel(decode_split_kernel<DPL, HPW, KV, kFusedQk, kOss>, grid, dim3(32 * warps), smem, stream, a);
}

template <int DPL, class KV>
void launch(const DecodeArgs<KV>& a, int n_kv, cudaStream_t stream) {
  const bool fused = a.q_raw != nullptr;
  if (a.sinks != nullptr || a.window > 0) {   // gpt-oss's instantiations (never fused: no q / k norm)
    if (fused) throw std::invalid_argument("attention_decode_fused_qk: no sinks or sliding window");
    if (a.group % 2 == 0) launch_split<DPL, 2, KV, false, true>(a, n_kv, stream);
    else launch_split<DPL, 1, KV, false, true>(a, n_kv, stream);
    launch_kernel(decode_merge_kernel<DPL, KV, true>, dim3(static_cast<unsigned>(a.n), static_cast<unsigned>(a.n_head)),
                  dim3(32), 0, stream, a);
    return;
  }
  if (a.group % 2 == 0) {
    if (fused) launch_split<DPL, 2, KV, true>(a, n_kv, stream);
    else launch_split<DPL, 2, KV, false>(a, n_kv, stream);
  } else {
    if (fused) launch_split<DPL, 1, KV, true>(a, n_kv, stream);
    else launch_split<DPL, 1, KV, false>(a, n_kv, stream);
  }
  launch_kernel(decode_merge_kernel<DPL, KV>, dim3(static_cast<unsigned>(a.n), static_cast<unsigned>(a.n_head)), dim3(32), 0,
                stream, a);
}

// Split slots of the grid: enough for the longest row max_ctx allows (splits grow with length).
int64_t split_slots(int64_t max_ctx) { return attention_decode_splits(max_ctx); }

}  // namespace

bool attention_decode_supported(const AttentionShape& s) {
  return s.n_head_kv > 0 && s.n_head % s.n_head_kv == 0 && s.n_head / s.n_head_kv <= 32 && s.head_dim % 32 == 0 &&
         (s.head_dim == 64 || s.head_dim == 128 || s.head_dim == 256) && s.kv_stride % 4 == 0;
}

namespace {
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
}  // namespace

bool attention_decode_fused_qk_supported(const QkNormRopeStoreArgs& qk, const AttentionShape& s) {
  return attention_decode_supported(s) && qk.rows == 1 && qk.n_head == s.n_head && qk.n_head_kv == s.n_head_kv &&
         qk.head_dim == s.head_dim && qk.n_rot >= 2 && qk.n_rot % 2 == 0 && qk.n_rot <= qk.head_dim &&
         qk.q_head_stride >= qk.head_dim && qk.k_row_stride >= qk.n_head_kv * qk.head_dim &&
         qk.v_row_stride >= qk.n_head_kv * qk.head_dim && qk.max_pos >= 1 && qk.q_head_stride % 4 == 0 &&
         aligned16(qk.q) && aligned16(qk.k) && aligned16(qk.v) && aligned16(qk.q_norm) && aligned16(qk.k_norm) &&
         qk.q_bias == nullptr && qk.k_bias == nullptr && qk.v_bias == nullptr && !qk.yarn.on && s.sinks == nullptr &&
         s.window == 0;   // not gpt-oss's options (qk_norm_rope_store's plain kernel, then attention_decode)
}

namespace {

// qk: null, or attention_decode_fused_qk's projections (q and the caches are then its own).
template <class KV>
void attention_decode_impl(const AttentionShape& s, const float* q, const KV* k_cache, const KV* v_cache, int64_t n,
                           const int32_t* pos_dev, int64_t row_offset, int64_t max_ctx, const float* gate,
                           int64_t gate_row_stride, int64_t gate_head_stride, float* out, void* out_q8_0,
                           float* scratch, int64_t scratch_floats, cudaStream_t stream,
                           const QkNormRopeStoreArgs* qk = nullptr) {
  if (!attention_decode_supported(s))
    throw std::invalid_argument("attention_decode: head_dim " + std::to_string(s.head_dim) + ", " +
                                std::to_string(s.n_head) + " / " + std::to_string(s.n_head_kv) +
                                " heads (needs head_dim 64, 128 or 256, at most 32 query heads per kv head)");
  if (n < 1 || n > kAttentionDecodeMaxRows || row_offset < 0 || max_ctx < 1)
    throw std::invalid_argument("attention_decode: n=" + std::to_string(n) + " (1.." +
                                std::to_string(kAttentionDecodeMaxRows) + "), row_offset=" + std::to_string(row_offset) +
                                ", max_ctx=" + std::to_string(max_ctx));
  if (scratch_floats < attention_decode_scratch_floats(s, n, max_ctx))
    throw std::invalid_argument("attention_decode: scratch of " + std::to_string(scratch_floats) + " floats, needs " +
                                std::to_string(attention_decode_scratch_floats(s, n, max_ctx)));
  auto misaligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 != 0; };
  if ((qk == nullptr && misaligned(q)) || misaligned(k_cache) || misaligned(v_cache) || misaligned(scratch))
    throw std::invalid_argument("attention_decode: q, k_cache, v_cache and scratch need 16-byte alignment (float4 loads)");
  if (s.kv_stride % KvSmem<KV>::kPerCopy != 0)   // a cached row must start on 16 bytes (cp.async)
    throw std::invalid_argument("attention_decode: kv_stride " + std::to_string(s.kv_stride) + " is not a multiple of " +
                                std::to_string(KvSmem<KV>::kPerCopy) + " cache elements");
  DecodeArgs<KV> a{};
  a.q = q;
  a.k = k_cache;
  a.v = v_cache;
  a.pos = pos_dev;
  a.row_offset = row_offset;
  a.max_ctx = max_ctx;
  a.kv_stride = s.kv_stride;
  a.n = static_cast<int>(n);
  a.n_head = static_cast<int>(s.n_head);
  a.group = static_cast<int>(s.n_head / s.n_head_kv);
  a.slots = static_cast<int>(split_slots(max_ctx));
  a.scale = s.scale;
  a.part = scratch;
  a.gate = gate;
  a.gate_row_stride = gate_row_stride;
  a.gate_head_stride = gate_head_stride;
  a.out = out;
  a.act = static_cast<BlockQ8_0*>(out_q8_0);
  if (s.window < 0) throw std::invalid_argument("attention_decode: negative sliding window");
  a.sinks = s.sinks;
  a.window = s.window;
  if (qk != nullptr) {
    a.q_raw = qk->q;
    a.q_head_stride = qk->q_head_stride;
    a.k_raw = qk->k;
    a.v_raw = qk->v;
    a.q_norm = qk->q_norm;
    a.k_norm = qk->k_norm;
    a.n_rot = static_cast<int>(qk->n_rot);
    a.freq_base = qk->freq_base;
    a.eps = qk->eps;
    a.k_store = const_cast<KV*>(k_cache);
    a.v_store = const_cast<KV*>(v_cache);
  }
  const int n_kv = static_cast<int>(s.n_head_kv);
  switch (s.head_dim) {
    case 64: launch<2, KV>(a, n_kv, stream); break;
    case 128: launch<4, KV>(a, n_kv, stream); break;
    default: launch<8, KV>(a, n_kv, stream); break;
  }
}

}  // namespace

void attention_decode(const AttentionShape& s, const float* q, const float* k_cache, const float* v_cache, int64_t n,
                      const int32_t* pos_dev, int64_t row_offset, int64_t max_ctx, const float* gate,
                      int64_t gate_row_stride, int64_t gate_head_stride, float* out, float* scratch,
                      int64_t scratch_floats, cudaStream_t stream) {
  attention_decode_impl(s, q, k_cache, v_cache, n, pos_dev, row_offset, max_ctx, gate, gate_row_stride,
                        gate_head_stride, out, nullptr, scratch, scratch_floats, stream);
}

void attention_decode(const AttentionShape& s, const float* q, const __half* k_cache, const __half* v_cache, int64_t n,
                      const int32_t* pos_dev, int64_t row_offset, int64_t max_ctx, const float* gate,
                      int64_t gate_row_stride, int64_t gate_head_stride, float* out, float* scratch,
                      int64_t scratch_floats, cudaStream_t stream) {
  attention_decode_impl(s, q, k_cache, v_cache, n, pos_dev, row_offset, max_ctx, gate, gate_row_stride,
                        gate_head_stride, out, nullptr, scratch, scratch_floats, stream);
}

void attention_decode_fused_qk(const QkNormRopeStoreArgs& qk, const AttentionShape& s, const float* gate,
                               int64_t gate_row_stride, int64_t gate_head_stride, float* out, void* out_q8_0,
                               float* scratch, int64_t scratch_floats, cudaStream_t stream) {
  const std::string what = "attention_decode_fused_qk: rows=" + std::to_string(qk.rows) + ", n_head=" +
                           std::to_string(qk.n_head) + "/" + std::to_string(qk.n_head_kv) + ", head_dim=" +
                           std::to_string(qk.head_dim) + ", n_rot=" + std::to_string(qk.n_rot);
  if (!attention_decode_fused_qk_supported(qk, s))
    throw std::invalid_argument(what + " (needs one row, attention_decode's shape with the same heads, an even "
                                "n_rot in 2..head_dim, q head stride >= head_dim and a multiple of 4, k/v row "
                                "stride >= n_head_kv * head_dim, q/k/v/q_norm/k_norm 16-byte aligned, max_pos >= 1)");
  const bool f32_cache = qk.k_cache != nullptr && qk.v_cache != nullptr;
  const bool f16_cache = qk.k_cache_f16 != nullptr && qk.v_cache_f16 != nullptr;
  if (qk.q == nullptr || qk.k == nullptr || qk.v == nullptr || qk.q_norm == nullptr || qk.k_norm == nullptr ||
      qk.pos0_dev == nullptr || f32_cache == f16_cache)
    throw std::invalid_argument(what + ": a null pointer among q, k, v, q_norm, k_norm, pos0_dev, or not exactly one "
                                "of (k_cache, v_cache) and (k_cache_f16, v_cache_f16) set");
  if (f32_cache)
    attention_decode_impl<float>(s, nullptr, qk.k_cache, qk.v_cache, 1, qk.pos0_dev, 0, qk.max_pos, gate,
                                 gate_row_stride, gate_head_stride, out, out_q8_0, scratch, scratch_floats, stream, &qk);
  else
    attention_decode_impl<__half>(s, nullptr, qk.k_cache_f16, qk.v_cache_f16, 1, qk.pos0_dev, 0, qk.max_pos, gate,
                                  gate_row_stride, gate_head_stride, out, out_q8_0, scratch, scratch_floats, stream,
                                  &qk);
}

void attention_decode_quantized(const AttentionShape& s, const float* q, const float* k_cache, const float* v_cache,
                                int64_t n, const int32_t* pos_dev, int64_t row_offset, int64_t max_ctx,
                                const float* gate, int64_t gate_row_stride, int64_t gate_head_stride, float* out,
                                void* out_q8_0, float* scratch, int64_t scratch_floats, cudaStream_t stream) {
  if (out_q8_0 == nullptr) throw std::invalid_argument("attention_decode_quantized: null out_q8_0");
  attention_decode_impl(s, q, k_cache, v_cache, n, pos_dev, row_offset, max_ctx, gate, gate_row_stride,
                        gate_head_stride, out, out_q8_0, scratch, scratch_floats, stream);
}

void attention_decode_quantized(const AttentionShape& s, const float* q, const __half* k_cache,
                                const __half* v_cache, int64_t n, const int32_t* pos_dev, int64_t row_offset,
                                int64_t max_ctx, const float* gate, int64_t gate_row_stride, int64_t gate_head_stride,
                                float* out, void* out_q8_0, float* scratch, int64_t scratch_floats,
                                cudaStream_t stream) {
  if (out_q8_0 == nullptr) throw std::invalid_argument("attention_decode_quantized: null out_q8_0");
  attention_decode_impl(s, q, k_cache, v_cache, n, pos_dev, row_offset, max_ctx, gate, gate_row_stride,
                        gate_head_stride, out, out_q8_0, scratch, scratch_floats, stream);
}

}  // namespace moraine::cuda
