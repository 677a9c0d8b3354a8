// Owning handle to device memory (cudaMalloc / cudaFree), move-only, with checked copies.
// The allocation is rounded up to a multiple of 16 bytes: the matrix-vector kernels read whole
// aligned 16-byte words, so a buffer must stay readable up to the next multiple of 16 past its
// last byte (kernels/cuda/matvec.h states that contract).
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_check.h"

namespace moraine::cuda {

// Bytes held by live DeviceBuffers and DeviceArena chunks of this process (after the 16-byte rounding): set beside the
// driver's device-memory figure, it separates what the program asked for from the allocator's
// and the context's overhead (gpu_worker logs both per setup stage).
inline std::atomic<uint64_t>& device_buffer_live_bytes() {
  static std::atomic<uint64_t> bytes{0};
  return bytes;
}

// Device memory for many long-lived buffers with less waste than one cudaMalloc each: the
// driver backs every cudaMalloc with whole 2 MiB pages, so a model's ~600 weight tensors
// (norm vectors of a few KB among them) cost ~0.5 GiB more than their bytes (30B-A3B on the
// H200: 10948 MiB of buffers held 11446 MiB). Requests below own_from are placed first-fit in
// chunks of chunk_bytes, larger ones get their own allocation; nothing is freed before the
// arena. Move-only; the buffers it hands out (DeviceBuffer's arena constructor) must not
// outlive it.
class DeviceArena {
 public:
  explicit DeviceArena(size_t chunk_bytes = size_t{64} << 20, size_t own_from = size_t{16} << 20)
      : chunk_bytes_(chunk_bytes), own_from_(own_from) {}
  ~DeviceArena() {
    for (const Chunk& c : chunks_) {
      cudaFree(c.base);
      device_buffer_live_bytes() -= c.size;
    }
  }
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // 256-byte aligned (cudaMalloc's own alignment), bytes rounded up to 16 as DeviceBuffer does.
  void* allocate(size_t bytes) {
    bytes = (bytes + 15) / 16 * 16;
    if (bytes < own_from_) {
      for (Chunk& c : chunks_) {
        const size_t at = (c.used + 255) / 256 * 256;
        if (c.shared && at + bytes <= c.size) {
          c.used = at + bytes;
          return c.base + at;
        }
      }
    }
    const bool shared = bytes < own_from_;
    const size_t size = shared ? chunk_bytes_ : bytes;
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, size));
    chunks_.push_back({static_cast<char*>(p), size, shared ? bytes : size, shared});
    device_buffer_live_bytes() += size;
    return p;
  }

 private:
  struct Chunk {
    char* base;
    size_t size, used;
    bool shared;
  };
  size_t chunk_bytes_, own_from_;
  std::vector<Chunk> chunks_;
};

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // count elements placed in `arena` (not freed by this buffer: the arena owns the memory).
  DeviceBuffer(size_t count, DeviceArena& arena) : count_(count), owned_(false) {
    if (count != 0) ptr_ = static_cast<T*>(arena.allocate(count * sizeof(T)));
  }
  // count elements at p, owned elsewhere (a part of a larger buffer that outlives this one).
  static DeviceBuffer view(T* p, size_t count) {
    DeviceBuffer b;
    b.ptr_ = p;
    b.count_ = count;
    b.owned_ = false;
    return b;
  }
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count == 0) return;
    const size_t bytes = (count * sizeof(T) + 15) / 16 * 16;
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, bytes));
    ptr_ = static_cast<T*>(p);
    device_buffer_live_bytes() += bytes;
  }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)), owned_(std::exchange(o.owned_, true)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      ptr_ = std::exchange(o.ptr_, nullptr);
      count_ = std::exchange(o.count_, 0);
      owned_ = std::exchange(o.owned_, true);
    }
    return *this;
  }

  T* get() const { return ptr_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

  void upload(const T* host, size_t count) {
    check_count(count);
    CUDA_CHECK(cudaMemcpy(ptr_, host, count * sizeof(T), cudaMemcpyHostToDevice));
  }
  void download(T* host, size_t count) const {
    check_count(count);
    CUDA_CHECK(cudaMemcpy(host, ptr_, count * sizeof(T), cudaMemcpyDeviceToHost));
  }
  // Every byte set to `byte` (0xff poisons float outputs with NaN).
  void fill_bytes(int byte) {
    if (count_ != 0) CUDA_CHECK(cudaMemset(ptr_, byte, bytes()));
  }

 private:
  void check_count(size_t count) const {
    if (count > count_)
      throw std::out_of_range("DeviceBuffer: copy of " + std::to_string(count) +
                              " elements into a buffer of " + std::to_string(count_));
  }
  void release() noexcept {
    if (ptr_ != nullptr && owned_) {
      cudaFree(ptr_);  // no throw from a destructor; errors surface later
      device_buffer_live_bytes() -= (count_ * sizeof(T) + 15) / 16 * 16;
    }
    ptr_ = nullptr;
  }
  T* ptr_ = nullptr;
  size_t count_ = 0;
  bool owned_ = true;
};

// Page-locked host memory (cudaMallocHost): the staging of asynchronous copies, which are
// synchronous (and slow) from pageable memory. Move-only, freed on destruction.
template <typename T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t count) : count_(count) {
    if (count != 0) CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&ptr_), count * sizeof(T)));
  }
  ~PinnedBuffer() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      if (ptr_ != nullptr) cudaFreeHost(ptr_);
      ptr_ = std::exchange(o.ptr_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }
  T* get() const { return ptr_; }
  size_t size() const { return count_; }
  T& operator[](size_t i) const { return ptr_[i]; }

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

// A device copy of v (synchronous upload).
template <typename T>
DeviceBuffer<T> uploaded(const std::vector<T>& v) {
  DeviceBuffer<T> b(v.size());
  b.upload(v.data(), v.size());
  return b;
}

}  // namespace moraine::cuda
