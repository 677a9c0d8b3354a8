#include "tools/convert/hf_tokenizer.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "tools/convert/safetensors.h"  // ConvertError

namespace moraine::convert {

namespace fs = std::filesystem;
using gguf::Value;
using gguf::ValueType;
using nlohmann::json;

namespace {

// Qwen2/Qwen3's pre-tokenizer split pattern. llama.cpp identifies pre-tokenizers by name, not
// by regex, so each pattern we accept is paired with the name llama.cpp gives it.
constexpr const char* kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// o200k (gpt-oss, GPT-4o): llama.cpp's "gpt-4o" pre-tokenizer (llama4's and others' too).
constexpr const char* kO200kRegex =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

json read_json(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw ConvertError(p.string() + ": cannot open");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw ConvertError(p.string() + ": invalid JSON: " + e.what());
  }
}

void collect_split_regexes(const json& pre, std::vector<std::string>& out) {
  if (!pre.is_object()) return;
  if (pre.value("type", "") == "Sequence" && pre.contains("pretokenizers")) {
    for (const json& p : pre["pretokenizers"]) collect_split_regexes(p, out);
  } else if (pre.value("type", "") == "Split" && pre.contains("pattern") && pre["pattern"].contains("Regex")) {
    out.push_back(pre["pattern"]["Regex"].get<std::string>());
  }
}

std::string pre_tokenizer_name(const json& tok, const std::string& where) {
  std::vector<std::string> regexes;
  if (tok.contains("pre_tokenizer")) collect_split_regexes(tok["pre_tokenizer"], regexes);
  if (regexes.size() == 1 && regexes[0] == kQwen2Regex) return "qwen2";
  if (regexes.size() == 1 && regexes[0] == kO200kRegex) return "gpt-4o";
  std::string got = regexes.empty() ? std::string("no Split regex") : "regex " + json(regexes).dump();
  throw ConvertError(where + ": pre_tokenizer has " + got + ", which is not one moraine-convert knows (qwen2, gpt-4o)");
}

// Byte-level BPE merges as "left right" strings. The newer pair form may hold spaces inside a
// piece; like llama.cpp, those are written as U+0120 so the string still splits on its one space.
std::vector<std::string> read_merges(const json& merges, const std::string& where) {
  std::vector<std::string> out;
  out.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& m = merges[i];
    if (m.is_string()) {
      out.push_back(m.get<std::string>());
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      std::string s;
      for (int k = 0; k < 2; ++k) {
        if (k) s += ' ';
        for (char c : m[k].get<std::string>()) {
          if (c == ' ') s += "\xC4\xA0";
          else s += c;
        }
      }
      out.push_back(std::move(s));
    } else {
      throw ConvertError(where + ": model.merges[" + std::to_string(i) + "] is neither \"a b\" nor [\"a\", \"b\"]");
    }
  }
  return out;
}

bool looks_special(const std::string& t) {
  return t.size() >= 4 && t.rfind("<|", 0) == 0 && t.ends_with("|>");
}

}  // namespace

std::vector<std::pair<std::string, Value>> import_hf_tokenizer(const std::string& dir, const json& config,
                                                               int64_t vocab_size, const std::string& arch) {
  const fs::path tok_path = fs::path(dir) / "tokenizer.json";
  const std::string where = tok_path.string();
  const json tok = read_json(tok_path);
  if (!tok.contains("model") || !tok["model"].is_object()) throw ConvertError(where + ": has no model object");
  const json& model = tok["model"];
  if (model.value("type", "") != "BPE") {
    throw ConvertError(where + ": model.type " + (model.contains("type") ? model["type"].dump() : "(missing)") +
                       " is not supported (BPE is)");
  }
  const std::string pre = pre_tokenizer_name(tok, where);

  std::vector<std::string> tokens(static_cast<size_t>(vocab_size));
  std::vector<int32_t> types(static_cast<size_t>(vocab_size), static_cast<int32_t>(TokenType::Unused));
  std::vector<bool> have(static_cast<size_t>(vocab_size), false);
  const auto place = [&](const std::string& text, const json& id_json, const std::string& field) {
    if (!id_json.is_number_integer() || id_json.get<int64_t>() < 0 || id_json.get<int64_t>() >= vocab_size) {
      throw ConvertError(where + ": " + field + " token " + json(text).dump() + " has id " + id_json.dump() +
                         ", outside config.json's vocab_size " + std::to_string(vocab_size));
    }
    const auto id = static_cast<size_t>(id_json.get<int64_t>());
    tokens[id] = text;
    have[id] = true;
    return id;
  };
  if (!model.contains("vocab") || !model["vocab"].is_object()) throw ConvertError(where + ": model.vocab is not an object");
  for (auto it = model["vocab"].begin(); it != model["vocab"].end(); ++it) {
    const size_t id = place(it.key(), it.value(), "model.vocab");
    types[id] = static_cast<int32_t>(TokenType::Normal);
  }
  std::map<std::string, int64_t> added_ids;  // content -> id, for the tokenizer_config lookups
  if (tok.contains("added_tokens")) {
    for (const json& a : tok["added_tokens"]) {
      if (!a.is_object() || !a.contains("content") || !a["content"].is_string() || !a.contains("id")) {
        throw ConvertError(where + ": an added_tokens entry lacks content or id: " + a.dump());
      }
      const std::string content = a["content"].get<std::string>();
      const size_t id = place(content, a["id"], "added_tokens");
      const bool special = a.value("special", false) || looks_special(content);
      types[id] = static_cast<int32_t>(special ? TokenType::Control : TokenType::UserDefined);
      added_ids.emplace(content, static_cast<int64_t>(id));
    }
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (!have[i]) tokens[i] = "[PAD" + std::to_string(i) + "]";
  }
  std::vector<std::string> merges;
  if (model.contains("merges") && model["merges"].is_array()) merges = read_merges(model["merges"], where);
  if (merges.empty()) throw ConvertError(where + ": model.merges is empty; a BPE vocabulary needs its merges");

  std::vector<std::pair<std::string, Value>> kv;
  kv.emplace_back("tokenizer.ggml.model", Value::string("gpt2"));
  kv.emplace_back("tokenizer.ggml.pre", Value::string(pre));
  kv.emplace_back("tokenizer.ggml.tokens", Value::string_array(tokens));
  std::vector<Value> tv;
  tv.reserve(types.size());
  for (int32_t t : types) tv.push_back(Value::i32(t));
  kv.emplace_back("tokenizer.ggml.token_type", Value::array(ValueType::INT32, std::move(tv)));
  kv.emplace_back("tokenizer.ggml.merges", Value::string_array(merges));

  // Special ids: tokenizer_config.json names them (looked up among the added tokens), then
  // config.json's *_token_id fill the rest; the first source to give a type wins.
  static const std::pair<const char*, const char*> kTypes[] = {
      {"bos", "tokenizer.ggml.bos_token_id"},       {"eos", "tokenizer.ggml.eos_token_id"},
      {"unk", "tokenizer.ggml.unknown_token_id"},   {"sep", "tokenizer.ggml.seperator_token_id"},
      {"pad", "tokenizer.ggml.padding_token_id"},   {"cls", "tokenizer.ggml.cls_token_id"},
      {"mask", "tokenizer.ggml.mask_token_id"},
  };
  std::vector<std::pair<std::string, int64_t>> special;  // (key, id) in discovery order
  const auto set_special = [&](const char* key, int64_t id) {
    if (id < 0 || id >= vocab_size) return;  // llama.cpp skips ids outside the vocabulary too
    for (const auto& s : special) {
      if (s.first == key) return;
    }
    special.emplace_back(key, id);
  };
  json tcfg;
  const fs::path tcfg_path = fs::path(dir) / "tokenizer_config.json";
  if (fs::exists(tcfg_path)) tcfg = read_json(tcfg_path);
  std::vector<std::pair<std::string, Value>> add_flags;
  if (tcfg.is_object()) {
    for (const auto& [typ, key] : kTypes) {
      const std::string field = std::string(typ) + "_token";
      if (!tcfg.contains(field)) continue;
      const json& e = tcfg[field];
      std::string content;
      if (e.is_string()) content = e.get<std::string>();
      else if (e.is_object() && e.contains("content") && e["content"].is_string()) content = e["content"].get<std::string>();
      else continue;
      if (auto it = added_ids.find(content); it != added_ids.end()) set_special(key, it->second);
    }
    for (const char* typ : {"bos", "eos"}) {
      const std::string field = std::string("add_") + typ + "_token";
      if (tcfg.contains(field) && tcfg[field].is_boolean()) {
        add_flags.emplace_back("tokenizer.ggml.add_" + std::string(typ) + "_token", Value::boolean(tcfg[field].get<bool>()));
      }
    }
  }
  for (const auto& [typ, key] : kTypes) {
    const std::string field = std::string(typ) + "_token_id";
    if (config.contains(field) && config[field].is_number_integer()) set_special(key, config[field].get<int64_t>());
  }
  // llama.cpp's GLM vocabulary (_set_vocab_glm): these after the files' own, where still unset.
  if (arch == "glm4moe") {
    for (const auto& [key, content] : std::initializer_list<std::pair<const char*, const char*>>{
             {"tokenizer.ggml.bos_token_id", "[gMASK]"}, {"tokenizer.ggml.eot_token_id", "<|user|>"},
             {"tokenizer.ggml.unknown_token_id", "<|endoftext|>"}, {"tokenizer.ggml.eom_token_id", "<|observation|>"}}) {
      if (auto it = added_ids.find(content); it != added_ids.end()) set_special(key, it->second);
    }
  }
  for (const auto& [key, id] : special) kv.emplace_back(key, Value::u32(static_cast<uint32_t>(id)));
  for (auto& f : add_flags) kv.push_back(std::move(f));

  std::string chat_template;
  if (tcfg.is_object() && tcfg.contains("chat_template") && tcfg["chat_template"].is_string()) {
    chat_template = tcfg["chat_template"].get<std::string>();
  } else if (fs::exists(fs::path(dir) / "chat_template.jinja")) {
    std::ifstream in(fs::path(dir) / "chat_template.jinja", std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    chat_template = s.str();
  }
  if (!chat_template.empty()) kv.emplace_back("tokenizer.chat_template", Value::string(chat_template));
  return kv;
}

}  // namespace moraine::convert
