// config.json access for the converter: every miss or bad value names the key (nested keys by
// their path, "rope_parameters.factor"), so a refusal says which setting to look at.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace moraine::convert {

// One JSON object of config.json (the whole file, or a nested one such as its rope settings).
class HfConfig {
 public:
  // `path` prefixes the key names in messages ("" for the top level, "rope_parameters.").
  explicit HfConfig(const nlohmann::json& j, std::string path = "");

  const nlohmann::json& obj() const { return j_; }
  std::string key_name(const std::string& key) const { return path_ + key; }
  const nlohmann::json* find(const std::string& key) const;  // nullptr when absent or null
  bool has(const std::string& key) const { return find(key) != nullptr; }

  int64_t integer(const std::string& key) const;  // required, non-negative
  std::optional<int64_t> opt_integer(std::initializer_list<const char*> keys) const;  // the first present
  double number(const std::string& key) const;     // required
  std::optional<double> opt_number(const std::string& key) const;
  bool flag(const std::string& key, bool dflt) const;
  std::optional<std::string> opt_text(const std::string& key) const;

  // The RoPE settings: "rope_parameters" (transformers v5), else "rope_scaling", else empty.
  HfConfig rope() const;
  // rope_theta from the RoPE settings or the top level; required.
  double rope_theta() const;

  [[noreturn]] void fail(const std::string& key, const std::string& why) const;

 private:
  const nlohmann::json& j_;
  std::string path_;
};

}  // namespace moraine::convert
