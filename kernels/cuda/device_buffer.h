// Owning handle to device memory (cudaMalloc / cudaFree), move-only, with checked copies.
// The allocation is rounded up to a multiple of 16 bytes: the matrix-vector kernels read whole
// aligned 16-byte words, so a buffer must stay readable up to the next multiple of 16 past its
// last byte (kernels/cuda/matvec.h states that contract).
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_check.h"

namespace moraine::cuda {

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count == 0) return;
    const size_t bytes = (count * sizeof(T) + 15) / 16 * 16;
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, bytes));
    ptr_ = static_cast<T*>(p);
  }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      ptr_ = std::exchange(o.ptr_, nullptr);
      count_ = std::exchange(o.count_, 0);
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
    if (ptr_ != nullptr) cudaFree(ptr_);  // no throw from a destructor; errors surface later
    ptr_ = nullptr;
  }
  T* ptr_ = nullptr;
  size_t count_ = 0;
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
