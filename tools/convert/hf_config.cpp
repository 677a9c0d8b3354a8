#include "tools/convert/hf_config.h"

#include "tools/convert/safetensors.h"  // ConvertError

namespace moraine::convert {

using nlohmann::json;

HfConfig::HfConfig(const json& j, std::string path) : j_(j), path_(std::move(path)) {}

const json* HfConfig::find(const std::string& key) const {
  if (!j_.is_object()) return nullptr;
  auto it = j_.find(key);
  return it == j_.end() || it->is_null() ? nullptr : &*it;
}

void HfConfig::fail(const std::string& key, const std::string& why) const {
  throw ConvertError("config.json: '" + key_name(key) + "' " + why);
}

int64_t HfConfig::integer(const std::string& key) const {
  const json* v = find(key);
  if (!v) throw ConvertError("config.json: missing '" + key_name(key) + "'");
  if (!v->is_number_integer() || v->get<int64_t>() < 0) fail(key, "must be a non-negative integer, not " + v->dump());
  return v->get<int64_t>();
}

std::optional<int64_t> HfConfig::opt_integer(std::initializer_list<const char*> keys) const {
  for (const char* k : keys) {
    if (has(k)) return integer(k);
  }
  return std::nullopt;
}

double HfConfig::number(const std::string& key) const {
  const json* v = find(key);
  if (!v) throw ConvertError("config.json: missing '" + key_name(key) + "'");
  if (!v->is_number()) fail(key, "must be a number, not " + v->dump());
  return v->get<double>();
}

std::optional<double> HfConfig::opt_number(const std::string& key) const {
  if (!has(key)) return std::nullopt;
  return number(key);
}

bool HfConfig::flag(const std::string& key, bool dflt) const {
  const json* v = find(key);
  if (!v) return dflt;
  if (!v->is_boolean()) fail(key, "must be true or false, not " + v->dump());
  return v->get<bool>();
}

std::optional<std::string> HfConfig::opt_text(const std::string& key) const {
  const json* v = find(key);
  if (!v) return std::nullopt;
  if (!v->is_string()) fail(key, "must be a string, not " + v->dump());
  return v->get<std::string>();
}

HfConfig HfConfig::rope() const {
  static const json empty = json::object();
  if (const json* r = find("rope_parameters"); r && r->is_object()) return HfConfig(*r, path_ + "rope_parameters.");
  if (const json* r = find("rope_scaling"); r && r->is_object()) return HfConfig(*r, path_ + "rope_scaling.");
  return HfConfig(empty, path_);
}

double HfConfig::rope_theta() const {
  const HfConfig r = rope();
  if (r.has("rope_theta")) return r.number("rope_theta");
  if (has("rope_theta")) return number("rope_theta");
  throw ConvertError("config.json: missing 'rope_theta' (at top level or in rope_parameters)");
}

}  // namespace moraine::convert
