// A plain streaming read over a buffer: the DRAM bandwidth the expert kernels are measured
// against (moraine-kernel-bench cpu), with the same threads.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/cpu/thread_pool.h"

namespace moraine::cpu {

// Reads every byte of [p, p + bytes) once with the widest loads the CPU has (whatever tier the
// kernels are capped at: this measures memory) and returns a value depending on all of them, so
// the reads cannot be optimized away. bytes must be a multiple of 64.
uint64_t stream_read(const void* p, size_t bytes);

// Bytes per second of `passes` full reads of [p, p + bytes) split evenly over the pool's
// workers (chunk_bytes chunks from the shared job counter, rounded up to 64 B). The best pass
// counts. Chunks of an expert job's size (tens of KB, each thread's next chunk elsewhere) tell
// what the kernels' short streams can get against long ones.
double measure_read_bandwidth(ThreadPool& pool, const void* p, size_t bytes, int passes, size_t chunk_bytes = size_t{1} << 20);

}  // namespace moraine::cpu
