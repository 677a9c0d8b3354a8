// The bytes of a cached sequence (the conversation cache: gpu_worker's state store, Backend::
// save_state): a header (magic, positions, layers) and each layer's parts (K and V rows of the
// cached positions, or the recurrent states) in order, every part preceded by its size so that
// a load checks what it reads against what the backend holds. The layout is the backend's own:
// the bytes never leave the process that wrote them.
#pragma once
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace moraine::model {

inline constexpr uint64_t kSequenceStateMagic = 0x31515345524f4d;   // "MORESQ1"

// The bytes a state of these parts takes (the header, and each part with its size before it).
inline size_t sequence_state_bytes(size_t n_parts, size_t part_bytes_sum) {
  return 3 * sizeof(uint64_t) + n_parts * sizeof(uint64_t) + part_bytes_sum;
}

// Writes into memory the caller sized with sequence_state_bytes (pinned host memory, so that a
// device's copies into the parts run at the bus rate). Throws std::length_error past its end.
class SequenceStateWriter {
 public:
  SequenceStateWriter(std::span<uint8_t> out, int64_t n_past, int64_t n_layer) : out_(out) {
    put(kSequenceStateMagic);
    put(static_cast<uint64_t>(n_past));
    put(static_cast<uint64_t>(n_layer));
  }
  // Room for a part of `bytes` bytes, to be filled by the caller (a device copy writes there).
  uint8_t* part(size_t bytes) {
    put(static_cast<uint64_t>(bytes));
    return take(bytes);
  }
  void part(const void* src, size_t bytes) {
    uint8_t* p = part(bytes);
    if (bytes > 0) std::memcpy(p, src, bytes);
  }
  size_t written() const { return at_; }

 private:
  uint8_t* take(size_t bytes) {
    if (out_.size() - at_ < bytes) throw std::length_error("sequence state: more than the " + std::to_string(out_.size()) + " bytes sized for it");
    uint8_t* p = out_.data() + at_;
    at_ += bytes;
    return p;
  }
  void put(uint64_t v) { std::memcpy(take(sizeof v), &v, sizeof v); }
  std::span<uint8_t> out_;
  size_t at_ = 0;
};

class SequenceStateReader {
 public:
  // Throws std::invalid_argument when the bytes are not a state of a model with n_layer layers.
  SequenceStateReader(std::span<const uint8_t> in, int64_t n_layer) : in_(in) {
    if (get() != kSequenceStateMagic) throw std::invalid_argument("sequence state: not a saved sequence (bad magic)");
    n_past_ = static_cast<int64_t>(get());
    const uint64_t layers = get();
    if (layers != static_cast<uint64_t>(n_layer))
      throw std::invalid_argument("sequence state: saved for " + std::to_string(layers) + " layers, the model has " +
                                  std::to_string(n_layer));
  }
  int64_t n_past() const { return n_past_; }
  // The next part, which must be `bytes` long.
  const uint8_t* part(size_t bytes) {
    const uint64_t saved = get();
    if (saved != bytes)
      throw std::invalid_argument("sequence state: a part of " + std::to_string(saved) + " bytes where " +
                                  std::to_string(bytes) + " were expected");
    need(bytes);
    const uint8_t* p = in_.data() + at_;
    at_ += bytes;
    return p;
  }
  void part(void* dst, size_t bytes) {
    const uint8_t* p = part(bytes);
    if (bytes > 0) std::memcpy(dst, p, bytes);
  }
  // Throws unless every byte was read.
  void finish() const {
    if (at_ != in_.size())
      throw std::invalid_argument("sequence state: " + std::to_string(in_.size() - at_) + " bytes left after the last layer");
  }

 private:
  void need(size_t bytes) const {
    if (in_.size() - at_ < bytes) throw std::invalid_argument("sequence state: truncated");
  }
  uint64_t get() {
    need(sizeof(uint64_t));
    uint64_t v;
    std::memcpy(&v, in_.data() + at_, sizeof v);
    at_ += sizeof v;
    return v;
  }
  std::span<const uint8_t> in_;
  size_t at_ = 0;
  int64_t n_past_ = 0;
};

}  // namespace moraine::model
