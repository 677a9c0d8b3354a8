#pragma once
// Carves one segment into named, aligned regions (activations, routing, expert outputs, hand-off
// doorbells), all sized at session start: the coordinator builds the layout once from the model
// shapes and the step limits, creates a segment of total_bytes(), and every process derives the
// same offsets from the same layout. Nothing is allocated per token.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moraine::shm {

struct Region {
  std::string name;
  std::size_t offset = 0;   // from the segment's data() pointer
  std::size_t bytes = 0;
  std::size_t align = 1;

  // Whether [offset, offset + length) relative to the segment lies inside this region.
  // Overflow-safe: hostile offsets come from messages.
  bool contains(std::uint64_t at, std::uint64_t length) const {
    return at >= offset && length <= bytes && at - offset <= bytes - length;
  }
  template <typename T>
  T* at(std::byte* data) const { return reinterpret_cast<T*>(data + offset); }
};

class ShmLayout {
 public:
  // Appends a region. align must be a power of two (at most 1 GiB); names must be unique.
  // Throws ShmError naming the region on a bad request or a size overflow.
  ShmLayout& add(std::string name, std::size_t bytes, std::size_t align = 64);
  // count cache-line doorbells (common/shm/doorbell.h), one per hand-off channel.
  ShmLayout& add_doorbells(std::string name, std::size_t count);

  const Region& region(std::string_view name) const;  // throws ShmError when absent
  const Region* find(std::string_view name) const;
  const std::vector<Region>& regions() const { return regions_; }
  // Bytes a segment needs for this layout: the end of the last region rounded to max_align().
  std::size_t total_bytes() const;
  std::size_t max_align() const { return max_align_; }

 private:
  std::vector<Region> regions_;
  std::size_t end_ = 0;
  std::size_t max_align_ = 1;
};

}  // namespace moraine::shm
