// Counter-based random numbers: the values of a tensor row depend only on (seed, tensor name,
// row), so any thread may fill any row and the file is the same for every thread count.
#pragma once
#include <cstdint>
#include <string_view>

namespace moraine::synth {

inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline uint64_t hash_name(std::string_view s, uint64_t seed) {
  uint64_t h = 0xCBF29CE484222325ull ^ seed;  // FNV-1a, then mixed
  for (char c : s) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001B3ull;
  uint64_t st = h;
  return splitmix64(st);
}

// A stream of uniform numbers for one row.
class RowRandom {
 public:
  RowRandom(uint64_t tensor_key, uint64_t row) : state_(tensor_key ^ (row * 0xD1B54A32D192ED03ull)) {
    splitmix64(state_);
  }
  uint64_t next_u64() { return splitmix64(state_); }
  // Two uniforms in [-1, 1) from one draw (24 bits each: plenty for weights stored in <= 16 bits).
  void next_pair(float& a, float& b) {
    const uint64_t x = splitmix64(state_);
    constexpr float k = 1.0f / 8388608.0f;  // 2^-23
    a = static_cast<float>(static_cast<int32_t>(x & 0xFFFFFF) - 0x800000) * k;
    b = static_cast<float>(static_cast<int32_t>((x >> 24) & 0xFFFFFF) - 0x800000) * k;
  }
  double uniform01() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

}  // namespace moraine::synth
