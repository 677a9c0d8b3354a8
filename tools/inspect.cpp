// moraine-inspect: what a GGUF file (or split model) holds - header, metadata, architecture,
// and its tensors by type and by layer - as text or as one JSON object.
#include <CLI/CLI.hpp>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "common/gguf/gguf.h"

namespace {

using moraine::gguf::Array;
using moraine::gguf::GgufFile;
using moraine::gguf::TensorInfo;
using moraine::gguf::Value;
using moraine::gguf::ValueType;
// ordered_json keeps metadata in file order, as the text form prints it.
using json = nlohmann::ordered_json;

constexpr size_t kSummaryItems = 8;  // array items shown unless --all-keys

struct Options {
  std::string path;
  bool json = false;
  bool all_keys = false;
  bool tensors = false;
};

struct Tally {
  uint64_t count = 0;
  uint64_t bytes = 0;
  uint64_t elements = 0;
  void add(const TensorInfo& t) {
    ++count;
    bytes += t.n_bytes;
    elements += static_cast<uint64_t>(t.n_elements());
  }
  double bits_per_weight() const { return elements ? 8.0 * static_cast<double>(bytes) / static_cast<double>(elements) : 0.0; }
};

struct Summary {
  std::map<std::string, Tally> by_type;  // type name -> tally
  std::map<int64_t, Tally> by_layer;     // N of "blk.N." -> tally
  Tally non_layer;                       // embeddings, output, norms outside blocks
  Tally total;
};

// "blk.17.ffn_up_exps.weight" -> 17; -1 for tensors outside the repeated blocks.
int64_t layer_of(const std::string& name) {
  static constexpr std::string_view kPrefix = "blk.";
  if (name.compare(0, kPrefix.size(), kPrefix) != 0) return -1;
  int64_t n = 0;
  size_t i = kPrefix.size();
  if (i >= name.size() || !std::isdigit(static_cast<unsigned char>(name[i]))) return -1;
  for (; i < name.size() && std::isdigit(static_cast<unsigned char>(name[i])); ++i) {
    n = n * 10 + (name[i] - '0');
    if (n > 1'000'000) return -1;
  }
  return i < name.size() && name[i] == '.' ? n : -1;
}

Summary summarise(const GgufFile& f) {
  Summary s;
  for (const TensorInfo& t : f.tensors()) {
    s.by_type[std::string(moraine::type_name(t.type))].add(t);
    const int64_t layer = layer_of(t.name);
    (layer >= 0 ? s.by_layer[layer] : s.non_layer).add(t);
    s.total.add(t);
  }
  return s;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string human_bytes(uint64_t b) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.2f %s" : "%.0f %s", v, kUnits[u]);
  return buf;
}

json value_json(const Value& v, bool full) {
  switch (v.type()) {
    case ValueType::STRING: return *v.as_string();
    case ValueType::BOOL: return *v.as_bool();
    case ValueType::FLOAT32:
    case ValueType::FLOAT64: return *v.as_f64();
    case ValueType::ARRAY: {
      const Array& a = *v.as_array();
      json items = json::array();
      const size_t shown = full ? a.items.size() : std::min(kSummaryItems, a.items.size());
      for (size_t i = 0; i < shown; ++i) items.push_back(value_json(a.items[i], full));
      json out = {{"elem_type", std::string(moraine::gguf::value_type_name(a.elem_type))},
                  {"count", a.items.size()}};
      out[full ? "items" : "first"] = std::move(items);
      return out;
    }
    default:
      if (auto u = v.as_u64()) return *u;
      return *v.as_i64();
  }
}

// Architecture keys are named "<arch>.<field>"; these are the ones worth a summary line.
constexpr const char* kArchFields[] = {
    "block_count", "context_length", "embedding_length", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "expert_count", "expert_used_count", "expert_shared_count",
    "expert_feed_forward_length", "rope.freq_base", "vocab_size"};

json architecture_json(const GgufFile& f) {
  json arch = json::object();
  const std::optional<std::string> name = f.get_string("general.architecture");
  if (!name) return arch;
  arch["architecture"] = *name;
  if (auto n = f.get_string("general.name")) arch["name"] = *n;
  for (const char* field : kArchFields) {
    if (const Value* v = f.find(*name + "." + field)) arch[field] = value_json(*v, false);
  }
  if (const Array* tokens = f.get_array("tokenizer.ggml.tokens")) arch["vocab_tokens"] = tokens->items.size();
  if (auto m = f.get_string("tokenizer.ggml.model")) arch["tokenizer"] = *m;
  return arch;
}

json tally_json(const Tally& t) {
  return {{"count", t.count}, {"bytes", t.bytes}, {"elements", t.elements},
          {"bits_per_weight", t.bits_per_weight()}};
}

json to_json(const GgufFile& f, const Options& opt) {
  const Summary s = summarise(f);
  json j;
  j["file"] = opt.path;
  j["version"] = f.version();
  j["alignment"] = f.alignment();
  j["shards"] = f.paths();
  j["file_bytes"] = f.file_bytes();
  j["data_offset"] = f.data_offset();
  j["metadata_count"] = f.metadata().size();
  j["tensor_count"] = f.tensors().size();
  json meta = json::object();
  json types = json::object();
  for (const auto& [key, value] : f.metadata()) {
    meta[key] = value_json(value, opt.all_keys);
    types[key] = std::string(moraine::gguf::value_type_name(value.type()));
  }
  j["metadata"] = std::move(meta);
  j["metadata_types"] = std::move(types);
  j["architecture"] = architecture_json(f);
  json by_type = json::object();
  for (const auto& [type, t] : s.by_type) by_type[type] = tally_json(t);
  j["tensors_by_type"] = std::move(by_type);
  json layers = json::array();
  for (const auto& [layer, t] : s.by_layer) {
    json l = tally_json(t);
    l["layer"] = layer;
    layers.push_back(std::move(l));
  }
  j["layers"] = std::move(layers);
  j["non_layer"] = tally_json(s.non_layer);
  j["total"] = tally_json(s.total);
  if (opt.tensors) {
    json list = json::array();
    for (const TensorInfo& t : f.tensors()) {
      list.push_back({{"name", t.name}, {"shape", t.shape}, {"type", std::string(moraine::type_name(t.type))},
                      {"bytes", t.n_bytes}, {"offset", t.offset}, {"shard", t.shard}});
    }
    j["tensors"] = std::move(list);
  }
  return j;
}

void print_tally_row(const std::string& label, const Tally& t) {
  std::printf("  %-12s %8llu tensors %12s %16llu elements %7.3f bpw\n", label.c_str(),
              static_cast<unsigned long long>(t.count), human_bytes(t.bytes).c_str(),
              static_cast<unsigned long long>(t.elements), t.bits_per_weight());
}

void print_text(const GgufFile& f, const Options& opt) {
  std::printf("file:        %s\n", opt.path.c_str());
  std::printf("version:     %u\n", f.version());
  std::printf("alignment:   %llu\n", static_cast<unsigned long long>(f.alignment()));
  std::printf("shards:      %zu\n", f.paths().size());
  if (f.paths().size() > 1) {
    for (const std::string& p : f.paths()) std::printf("  %s\n", p.c_str());
  }
  std::printf("file size:   %s (%llu bytes)\n", human_bytes(f.file_bytes()).c_str(),
              static_cast<unsigned long long>(f.file_bytes()));
  std::printf("data offset: %llu\n", static_cast<unsigned long long>(f.data_offset()));

  std::printf("\nmetadata: %zu keys\n", f.metadata().size());
  for (const auto& [key, value] : f.metadata()) {
    const size_t items = opt.all_keys ? SIZE_MAX : kSummaryItems;
    std::printf("  %-44s %-7s %s\n", key.c_str(), std::string(moraine::gguf::value_type_name(value.type())).c_str(),
                value.to_display(items).c_str());
  }

  const json arch = architecture_json(f);
  if (!arch.empty()) {
    std::printf("\narchitecture:\n");
    for (const auto& [k, v] : arch.items()) std::printf("  %-28s %s\n", k.c_str(), v.dump().c_str());
  }

  const Summary s = summarise(f);
  std::printf("\ntensors: %zu\n", f.tensors().size());
  if (f.tensors().empty()) return;
  std::printf("by type:\n");
  for (const auto& [type, t] : s.by_type) print_tally_row(type, t);
  std::printf("by layer:\n");
  if (s.non_layer.count) print_tally_row("non-layer", s.non_layer);
  for (const auto& [layer, t] : s.by_layer) print_tally_row("blk." + std::to_string(layer), t);
  std::printf("total:\n");
  print_tally_row("all", s.total);
  if (opt.tensors) {
    std::printf("\n%-48s %-24s %-8s %12s %6s\n", "name", "shape", "type", "bytes", "shard");
    for (const TensorInfo& t : f.tensors()) {
      std::printf("%-48s %-24s %-8s %12llu %6u\n", t.name.c_str(), shape_string(t.shape).c_str(),
                  std::string(moraine::type_name(t.type)).c_str(),
                  static_cast<unsigned long long>(t.n_bytes), t.shard);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  CLI::App app{"moraine-inspect: show what a GGUF file (or every shard of a split model) holds"};
  app.add_option("file", opt.path, "GGUF file; NAME-0000k-of-0000n.gguf opens all n shards")->required();
  app.add_flag("--json", opt.json, "print one JSON object instead of text");
  app.add_flag("--all-keys", opt.all_keys, "print metadata values in full (every array item) instead of summaries");
  app.add_flag("--tensors", opt.tensors, "list every tensor with shape, type and bytes");
  CLI11_PARSE(app, argc, argv);
  try {
    const GgufFile f = GgufFile::open(opt.path);
    if (opt.json) {
      // Token strings need not be valid UTF-8 (byte-level vocabularies); replace, don't throw.
      std::cout << to_json(f, opt).dump(2, ' ', false, json::error_handler_t::replace) << "\n";
    } else {
      print_text(f, opt);
    }
  } catch (const std::exception& e) {
    std::cerr << "moraine-inspect: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
