// Integers read from the group's JSON files (placement plan, group manifest, census), checked for
// type and range: nlohmann's get<int>() converts a float outside the target's range (undefined
// behaviour: config_fuzz found "vram_budget": 1.9e19) and silently wraps an integer that does
// not fit. Errors name the key and the value; the readers add the file.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

namespace moraine::group {

template <class T>
T json_integer(const nlohmann::json& j, const char* key) {
  const nlohmann::json& v = j.at(key);
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (std::in_range<T>(u)) return static_cast<T>(u);
  } else if (v.is_number_integer()) {
    const auto i = v.get<std::int64_t>();
    if (std::in_range<T>(i)) return static_cast<T>(i);
  } else {
    throw std::runtime_error(std::string(key) + " = " + v.dump() + " is not an integer");
  }
  throw std::runtime_error(std::string(key) + " = " + v.dump() + " is out of range");
}

template <class T>
T json_integer_or(const nlohmann::json& j, const char* key, T fallback) {
  return j.contains(key) ? json_integer<T>(j, key) : fallback;
}

}  // namespace moraine::group
