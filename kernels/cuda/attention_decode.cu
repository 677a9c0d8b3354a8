#include "kernels/cuda/attention_decode.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"

namespace moraine::cuda {
namespace {

constexpr int kTile = 32;   // positions staged at once: one per lane
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

// DPL: head_dim / 32, the output floats each lane keeps. Record per (row, head, chunk):
// [max, sum, out[head_dim]] at part + ((r * n_head + h) * max_chunks + c) * (hd + 2).
template <int DPL>
__global__ void decode_chunk_kernel(const float* __restrict__ q, const float* __restrict__ kc,
                                    const float* __restrict__ vc, int n, const int32_t* __restrict__ pos_dev,
                                    int64_t row_offset, int64_t max_ctx, int n_head, int group, int64_t kv_stride,
                                    float scale, int64_t max_chunks, float* __restrict__ part) {
  constexpr int hd = DPL * 32;
  constexpr int kRowK = hd + 1;   // padded K row: lane p reading row p hits bank (p + d) % 32
  extern __shared__ float smem[];
  float* ks = smem;                    // [kTile][kRowK]
  float* vs = ks + kTile * kRowK;      // [kTile][hd]
  float* qs = vs + kTile * hd;         // [group][hd]
  const int kvh = blockIdx.y;
  const int64_t c = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int h = kvh * group + warp;
  const int64_t p0 = first_position(pos_dev, row_offset, n, max_ctx);
  const int64_t j0 = c * kDecodeChunk;
  for (int r = 0; r < n; ++r) {
    const int64_t seen = p0 < 0 ? 0 : p0 + r + 1;   // positions this row sees
    if (j0 >= seen) continue;                        // this row does not reach the chunk (later rows may)
    const int64_t j1 = j0 + kDecodeChunk < seen ? j0 + kDecodeChunk : seen;
    __syncthreads();   // qs / tiles of the previous row may still be read
    for (int i = threadIdx.x; i < group * hd; i += blockDim.x)
      qs[i] = q[(static_cast<int64_t>(r) * n_head + kvh * group) * hd + i];
    float m = -INFINITY, l = 0.0f, acc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[i] = 0.0f;
    for (int64_t t0 = j0; t0 < j1; t0 += kTile) {
      const int live = static_cast<int>(j1 - t0 < kTile ? j1 - t0 : kTile);
      __syncthreads();
      // Stage K and V of positions t0 .. t0 + live - 1 (float4 loads along head_dim).
      for (int i = threadIdx.x; i < live * (hd / 4); i += blockDim.x) {
        const int p = i / (hd / 4), d4 = i % (hd / 4);
        const int64_t src = (t0 + p) * kv_stride + static_cast<int64_t>(kvh) * hd + d4 * 4;
        const float4 kv = *reinterpret_cast<const float4*>(kc + src);
        const float4 vv = *reinterpret_cast<const float4*>(vc + src);
        float* kd = ks + p * kRowK + d4 * 4;
        kd[0] = kv.x, kd[1] = kv.y, kd[2] = kv.z, kd[3] = kv.w;
        *reinterpret_cast<float4*>(vs + p * hd + d4 * 4) = vv;
      }
      __syncthreads();
      if (warp < group) {
        float s = -INFINITY;
        if (lane < live) {
          const float* qh = qs + warp * hd;
          const float* kr = ks + lane * kRowK;
          float dot = 0.0f;
          for (int d = 0; d < hd; ++d) dot = fmaf(qh[d], kr[d], dot);
          s = dot * scale;
        }
        const float m_new = fmaxf(m, warp_max(s));
        const float corr = m == -INFINITY ? 0.0f : expf(m - m_new);
        const float w = lane < live ? expf(s - m_new) : 0.0f;
        l = l * corr + warp_sum(w);
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[i] *= corr;
        for (int p = 0; p < live; ++p) {
          const float wp = __shfl_sync(kFull, w, p);
          const float* vr = vs + p * hd;
#pragma unroll
          for (int i = 0; i < DPL; ++i) acc[i] = fmaf(wp, vr[lane + 32 * i], acc[i]);
        }
        m = m_new;
      }
    }
    if (warp < group) {
      float* rec = part + ((static_cast<int64_t>(r) * n_head + h) * max_chunks + c) * (hd + 2);
      if (lane == 0) {
        rec[0] = m;
        rec[1] = l;
      }
#pragma unroll
      for (int i = 0; i < DPL; ++i) rec[2 + lane + 32 * i] = acc[i];
    }
  }
}

__global__ void decode_merge_kernel(const float* __restrict__ part, int n_head, int hd, const int32_t* pos_dev,
                                    int64_t row_offset, int n, int64_t max_ctx, int64_t max_chunks,
                                    const float* __restrict__ gate, int64_t gate_row_stride,
                                    int64_t gate_head_stride, float* __restrict__ out) {
  const int r = blockIdx.x, h = blockIdx.y;
  const int64_t p0 = first_position(pos_dev, row_offset, n, max_ctx);
  float* o = out + (static_cast<int64_t>(r) * n_head + h) * hd;
  if (p0 < 0) {
    for (int d = threadIdx.x; d < hd; d += blockDim.x) o[d] = __int_as_float(0x7fc00000);
    return;
  }
  const int64_t chunks = (p0 + r + 1 + kDecodeChunk - 1) / kDecodeChunk;
  const float* base = part + (static_cast<int64_t>(r) * n_head + h) * max_chunks * (hd + 2);
  float mx = -INFINITY;
  for (int64_t c = 0; c < chunks; ++c) mx = fmaxf(mx, base[c * (hd + 2)]);
  float l = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) l += base[c * (hd + 2) + 1] * expf(base[c * (hd + 2)] - mx);
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float v = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) v += base[c * (hd + 2) + 2 + d] * expf(base[c * (hd + 2)] - mx);
    v /= l;
    if (gate != nullptr) v *= 1.0f / (1.0f + expf(-gate[r * gate_row_stride + h * gate_head_stride + d]));
    o[d] = v;
  }
}

template <int DPL>
void launch_chunks(const AttentionShape& s, const float* q, const float* k, const float* v, int n, const int32_t* pos,
                   int64_t row_offset, int64_t max_ctx, int64_t max_chunks, float* part, cudaStream_t stream) {
  const int group = static_cast<int>(s.n_head / s.n_head_kv);
  const size_t smem = static_cast<size_t>(kTile * (DPL * 32 + 1) + kTile * DPL * 32 + group * DPL * 32) * sizeof(float);
  static bool opted_in = false;   // above 48 KB needs an opt-in, once per kernel instance
  if (!opted_in && smem > 48 * 1024) {
    CUDA_CHECK(cudaFuncSetAttribute(decode_chunk_kernel<DPL>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
    opted_in = true;
  }
  const dim3 grid(static_cast<unsigned>(max_chunks), static_cast<unsigned>(s.n_head_kv));
  decode_chunk_kernel<DPL><<<grid, 32 * group, smem, stream>>>(q, k, v, n, pos, row_offset, max_ctx,
                                                                 static_cast<int>(s.n_head), group, s.kv_stride,
                                                                 s.scale, max_chunks, part);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool attention_decode_supported(const AttentionShape& s) {
  return s.n_head_kv > 0 && s.n_head % s.n_head_kv == 0 && s.n_head / s.n_head_kv <= 32 && s.head_dim % 32 == 0 &&
         (s.head_dim == 64 || s.head_dim == 128 || s.head_dim == 256) && s.kv_stride % 4 == 0;
}

int64_t attention_decode_scratch_floats(const AttentionShape& s, int64_t n, int64_t max_ctx) {
  const int64_t chunks = (max_ctx + kDecodeChunk - 1) / kDecodeChunk;
  return n * s.n_head * chunks * (s.head_dim + 2);
}

void attention_decode(const AttentionShape& s, const float* q, const float* k_cache, const float* v_cache, int64_t n,
                      const int32_t* pos_dev, int64_t row_offset, int64_t max_ctx, const float* gate,
                      int64_t gate_row_stride, int64_t gate_head_stride, float* out, float* scratch,
                      int64_t scratch_floats, cudaStream_t stream) {
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
  const int64_t max_chunks = (max_ctx + kDecodeChunk - 1) / kDecodeChunk;
  const int rows = static_cast<int>(n);
  switch (s.head_dim) {
    case 64:
      launch_chunks<2>(s, q, k_cache, v_cache, rows, pos_dev, row_offset, max_ctx, max_chunks, scratch, stream);
      break;
    case 128:
      launch_chunks<4>(s, q, k_cache, v_cache, rows, pos_dev, row_offset, max_ctx, max_chunks, scratch, stream);
      break;
    default:
      launch_chunks<8>(s, q, k_cache, v_cache, rows, pos_dev, row_offset, max_ctx, max_chunks, scratch, stream);
      break;
  }
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(s.n_head));
  decode_merge_kernel<<<grid, 128, 0, stream>>>(scratch, static_cast<int>(s.n_head), static_cast<int>(s.head_dim),
                                                pos_dev, row_offset, rows, max_ctx, max_chunks, gate, gate_row_stride,
                                                gate_head_stride, out);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moraine::cuda
