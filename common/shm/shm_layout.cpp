#include "common/shm/shm_layout.h"

#include <cstdint>

#include "common/shm/doorbell.h"
#include "common/shm/shm_error.h"

namespace moraine::shm {

namespace {
constexpr std::size_t kMaxAlign = std::size_t{1} << 30;
}

ShmLayout& ShmLayout::add(std::string name, std::size_t bytes, std::size_t align) {
  if (name.empty()) throw ShmError("shared-memory layout: region name is empty");
  if (find(name) != nullptr) throw ShmError("shared-memory layout: region '" + name + "' added twice");
  if (align == 0 || (align & (align - 1)) != 0 || align > kMaxAlign) {
    throw ShmError("shared-memory layout: region '" + name + "' alignment " + std::to_string(align) +
                   " is not a power of two up to 1 GiB");
  }
  if (end_ > SIZE_MAX - (align - 1)) throw ShmError("shared-memory layout: region '" + name + "' overflows");
  const std::size_t offset = (end_ + align - 1) & ~(align - 1);
  if (bytes > SIZE_MAX - offset) {
    throw ShmError("shared-memory layout: region '" + name + "' of " + std::to_string(bytes) +
                   " bytes overflows the segment size");
  }
  regions_.push_back(Region{std::move(name), offset, bytes, align});
  end_ = offset + bytes;
  if (align > max_align_) max_align_ = align;
  return *this;
}

ShmLayout& ShmLayout::add_doorbells(std::string name, std::size_t count) {
  if (count > SIZE_MAX / sizeof(Doorbell)) throw ShmError("shared-memory layout: too many doorbells in '" + name + "'");
  return add(std::move(name), count * sizeof(Doorbell), alignof(Doorbell));
}

const Region* ShmLayout::find(std::string_view name) const {
  for (const Region& r : regions_) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

const Region& ShmLayout::region(std::string_view name) const {
  if (const Region* r = find(name)) return *r;
  throw ShmError("shared-memory layout has no region '" + std::string(name) + "'");
}

std::size_t ShmLayout::total_bytes() const {
  if (end_ > SIZE_MAX - (max_align_ - 1)) throw ShmError("shared-memory layout: total size overflows");
  return (end_ + max_align_ - 1) & ~(max_align_ - 1);
}

}  // namespace moraine::shm
