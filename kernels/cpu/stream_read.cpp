// Streaming read bandwidth.
#include "kernels/cpu/stream_read.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <vector>

#include "kernels/cpu/vec_dot.h"

namespace moraine::cpu {
namespace {

// Four independent accumulators keep enough loads in flight to saturate a core's share of DRAM.
__attribute__((target("avx512f"))) uint64_t read_avx512(const uint8_t* p, size_t bytes) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 256 <= bytes; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
  }
  for (; i < bytes; i += 64) a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
  const __m512i x = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, x);
  uint64_t r = 0;
  for (uint64_t v : lanes) r ^= v;
  return r;
}

__attribute__((target("avx2"))) uint64_t read_avx2(const uint8_t* p, size_t bytes) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  for (; i < bytes; i += 32) a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
  const __m256i x = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), x);
  return lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
}

uint64_t read_scalar(const uint8_t* p, size_t bytes) {
  uint64_t r = 0;
  for (size_t i = 0; i < bytes; i += 8) {
    uint64_t v;
    __builtin_memcpy(&v, p + i, 8);
    r ^= v;
  }
  return r;
}

}  // namespace

uint64_t stream_read(const void* p, size_t bytes) {
  const auto* b = static_cast<const uint8_t*>(p);
  const CpuIsa hw = hardware_cpu_isa();
  if (hw >= CpuIsa::Avx512) return read_avx512(b, bytes);
  if (hw >= CpuIsa::Avx2) return read_avx2(b, bytes);
  return read_scalar(b, bytes);
}

double measure_read_bandwidth(ThreadPool& pool, const void* p, size_t bytes, int passes, size_t chunk_bytes) {
  const size_t kChunk = std::max<size_t>(64, (chunk_bytes + 63) & ~size_t{63});
  const auto* base = static_cast<const uint8_t*>(p);
  const int64_t chunks = static_cast<int64_t>((bytes + kChunk - 1) / kChunk);
  std::vector<uint64_t> sink(static_cast<size_t>(pool.size()) * 8, 0);  // a cache line per worker
  double best = 0.0;
  for (int pass = 0; pass < passes; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.run(chunks, [&](int64_t c, int w) {
      const size_t off = static_cast<size_t>(c) * kChunk;
      sink[static_cast<size_t>(w) * 8] ^= stream_read(base + off, std::min(kChunk, bytes - off) & ~size_t{63});
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(bytes) / s);
  }
  uint64_t all = 0;
  for (uint64_t v : sink) all ^= v;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  asm volatile("" : : "r"(all));
  return best;
}

}  // namespace moraine::cpu
