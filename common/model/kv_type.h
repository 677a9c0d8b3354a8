// The element type of a KV cache, chosen per process group (--kv-type): F32 keeps the floats the
// attention block computed; F16 rounds each K and V element to IEEE half (to nearest, ties to even)
// when it is stored, and attention reads it back as that half's exact float. F16 halves the cache
// (llama.cpp's default cache type; on the 30B-A3B shape at 8257 positions 0.8 instead of 1.6 GiB,
// VRAM that then holds experts) and the K/V bytes decode attention reads.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace moraine::model {

enum class KvType : std::uint8_t { F32, F16 };

inline std::size_t kv_type_bytes(KvType t) { return t == KvType::F16 ? 2 : 4; }
inline const char* kv_type_name(KvType t) { return t == KvType::F16 ? "f16" : "f32"; }

// "f32" or "f16"; anything else throws std::invalid_argument naming `what` (the option or field).
inline KvType parse_kv_type(const std::string& s, const std::string& what) {
  if (s == "f32") return KvType::F32;
  if (s == "f16") return KvType::F16;
  throw std::invalid_argument(what + ": unknown KV cache type '" + s + "' (f32 or f16)");
}

}  // namespace moraine::model
