#include "common/jinja/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

namespace moraine::jinja {

const Value* Dict::find(const std::string& key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &items_[it->second].second;
}

Value* Dict::find(const std::string& key) {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &items_[it->second].second;
}

void Dict::set(const std::string& key, Value v) {
  auto it = index_.find(key);
  if (it != index_.end()) {
    items_[it->second].second = std::move(v);
    return;
  }
  index_.emplace(key, items_.size());
  items_.emplace_back(key, std::move(v));
}

namespace {

// The index key of a non-string dict key: Python treats 1, 1.0 and True as one key.
std::string encode_key(const Value& k) {
  if (k.is_string()) return k.as_string();
  if (k.is_none()) return "\x01n";
  if (k.is_int() || k.is_bool()) return "\x01i" + std::to_string(k.as_int());
  if (k.is_float()) {
    const double d = k.as_number();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e18) return "\x01i" + std::to_string(static_cast<int64_t>(d));
    return "\x01f" + python_float_repr(d);
  }
  throw TemplateError("unhashable type: '" + k.type_name() + "'");
}

}  // namespace

const Value* Dict::find_key(const Value& key) const { return find(encode_key(key)); }

void Dict::set_key(const Value& key, Value v) {
  const std::string k = encode_key(key);
  const bool is_new = index_.find(k) == index_.end();
  set(k, std::move(v));
  if (is_new && !key.is_string()) other_keys_[items_.size() - 1] = std::make_shared<const Value>(key);
}

Value Dict::key_at(size_t i) const {
  auto it = other_keys_.find(i);
  return it == other_keys_.end() ? Value(items_[i].first) : *it->second;
}

Value Value::list(List items, bool tuple) {
  Value v;
  for (const Value& x : items) v.depth_ = std::max(v.depth_, x.depth_ + 1);
  if (v.depth_ > kMaxValueDepth) throw TemplateError("the value nests deeper than " + std::to_string(kMaxValueDepth) + " levels");
  v.kind_ = Kind::Array;
  v.tuple_ = tuple;
  v.list_ = std::make_shared<List>(std::move(items));
  return v;
}

Value Value::generator(List items) {
  Value v = list(std::move(items));
  v.generator_ = true;
  return v;
}

Value Value::dict(Dict d, bool is_namespace) {
  Value v;
  for (const auto& kv : d.items()) v.depth_ = std::max(v.depth_, kv.second.depth_ + 1);
  if (v.depth_ > kMaxValueDepth) throw TemplateError("the value nests deeper than " + std::to_string(kMaxValueDepth) + " levels");
  v.kind_ = Kind::Map;
  v.namespace_ = is_namespace;
  v.dict_ = std::make_shared<Dict>(std::move(d));
  return v;
}

Value Value::function(std::string name, std::function<Value(Renderer&, CallArgs&)> fn) {
  Value v;
  v.kind_ = Kind::Callable;
  v.fn_ = std::make_shared<const Function>(Function{std::move(name), std::move(fn)});
  return v;
}

Value Value::from_json(const nlohmann::ordered_json& j, int max_depth) {
  if (max_depth <= 0) throw TemplateError("the template's input nests deeper than the renderer's limit");
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return none();
    case nlohmann::ordered_json::value_t::boolean: return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value(static_cast<double>(u));
      return Value(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e, max_depth - 1));
      return list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      for (auto it = j.begin(); it != j.end(); ++it) d.set(it.key(), from_json(it.value(), max_depth - 1));
      return dict(std::move(d));
    }
    default: throw TemplateError("the template's input holds a JSON value of an unsupported type (binary)");
  }
}

const std::string& Value::undefined_hint() const {
  static const std::string empty;
  return str_ ? *str_ : empty;
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::Undefined:
    case Kind::None: return false;
    case Kind::Bool:
    case Kind::Int: return int_ != 0;
    case Kind::Float: return float_ != 0.0;
    case Kind::String: return !str_->empty();
    case Kind::Array: return generator_ || !list_->empty();
    case Kind::Map: return namespace_ || dict_->size() != 0;
    case Kind::Callable: return true;
  }
  return false;
}

std::string python_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  const size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  const int exp10 = std::stoi(sci.substr(e + 1));
  const bool neg = !mant.empty() && mant[0] == '-';
  if (neg) mant.erase(0, 1);
  std::string digits;
  for (char c : mant) if (c != '.') digits += c;
  const int decpt = exp10 + 1;  // value = 0.digits * 10^decpt
  std::string out = neg ? "-" : "";
  if (decpt > 16 || decpt < -3) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    return out + eb;
  }
  if (decpt <= 0) return out + "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
  if (static_cast<size_t>(decpt) >= digits.size())
    return out + digits + std::string(static_cast<size_t>(decpt) - digits.size(), '0') + ".0";
  return out + digits.substr(0, static_cast<size_t>(decpt)) + "." + digits.substr(static_cast<size_t>(decpt));
}

std::string python_string_repr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  const char q = has_single && !has_double ? '"' : '\'';
  std::string out(1, q);
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    char hex[8];
    if (c == '\\') out += "\\\\";
    else if (c == static_cast<unsigned char>(q)) { out += '\\'; out += q; }
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7f) { std::snprintf(hex, sizeof hex, "\\x%02x", c); out += hex; }
    else if (c == 0xc2 && i + 1 < s.size() && static_cast<unsigned char>(s[i + 1]) <= 0xa0) {
      // U+0080..U+00A0 are not printable in Python: repr writes them as \x escapes.
      std::snprintf(hex, sizeof hex, "\\x%02x", static_cast<unsigned char>(s[i + 1]));
      out += hex;
      ++i;
    } else out += static_cast<char>(c);
  }
  return out + q;
}

std::string Value::str() const {
  switch (kind_) {
    case Kind::Undefined: return "";
    case Kind::String: return *str_;
    default: return repr();
  }
}

std::string Value::repr() const { return repr_at(0); }

std::string Value::repr_at(int depth) const {
  // A namespace may hold itself; Python writes "..." there, we refuse.
  if (depth > static_cast<int>(kMaxValueDepth)) throw TemplateError("the value nests deeper than " + std::to_string(kMaxValueDepth) + " levels");
  switch (kind_) {
    case Kind::Undefined: return "Undefined";
    case Kind::None: return "None";
    case Kind::Bool: return int_ ? "True" : "False";
    case Kind::Int: return std::to_string(int_);
    case Kind::Float: return python_float_repr(float_);
    case Kind::String: return python_string_repr(*str_);
    case Kind::Array: {
      if (generator_) return "<generator object>";
      std::string out = tuple_ ? "(" : "[";
      for (size_t i = 0; i < list_->size(); ++i) out += (i ? ", " : "") + (*list_)[i].repr_at(depth + 1);
      if (tuple_ && list_->size() == 1) out += ",";
      return out + (tuple_ ? ")" : "]");
    }
    case Kind::Map: {
      std::string out = namespace_ ? "<Namespace {" : "{";
      for (size_t i = 0; i < dict_->size(); ++i)
        out += (i ? ", " : "") + dict_->key_at(i).repr() + ": " + dict_->items()[i].second.repr_at(depth + 1);
      return out + (namespace_ ? "}>" : "}");
    }
    case Kind::Callable: return "<function " + fn_->name + ">";
  }
  return "";
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::Undefined: return "Undefined";
    case Kind::None: return "NoneType";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::String: return "str";
    case Kind::Array: return generator_ ? "generator" : tuple_ ? "tuple" : "list";
    case Kind::Map: return namespace_ ? "Namespace" : "dict";
    case Kind::Callable: return "function";
  }
  return "?";
}

namespace {

void json_string(const std::string& s, std::string& out) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char hex[8];
          std::snprintf(hex, sizeof hex, "\\u%04x", c);
          out += hex;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

struct JsonWriter {
  int indent;
  std::string_view item_sep, key_sep;
  bool sort_keys;
  std::string out;

  void newline(int level) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent) * static_cast<size_t>(level), ' ');
  }

  void write(const Value& v, int level) {
    if (level > static_cast<int>(kMaxValueDepth)) throw TemplateError("tojson: the value nests deeper than " + std::to_string(kMaxValueDepth) + " levels");
    switch (v.kind()) {
      case Value::Kind::None: out += "null"; return;
      case Value::Kind::Bool: out += v.as_bool() ? "true" : "false"; return;
      case Value::Kind::Int: out += std::to_string(v.as_int()); return;
      case Value::Kind::Float: {
        const double d = v.as_number();
        if (std::isnan(d)) out += "NaN";
        else if (std::isinf(d)) out += d < 0 ? "-Infinity" : "Infinity";
        else out += python_float_repr(d);
        return;
      }
      case Value::Kind::String: json_string(v.as_string(), out); return;
      case Value::Kind::Array: {
        if (v.is_generator()) break;
        const List& l = v.as_list();
        if (l.empty()) { out += "[]"; return; }
        out += '[';
        for (size_t i = 0; i < l.size(); ++i) {
          if (i) out += item_sep;
          newline(level + 1);
          write(l[i], level + 1);
        }
        newline(level);
        out += ']';
        return;
      }
      case Value::Kind::Map: {
        if (v.is_namespace()) break;
        // json.dumps writes a non-string key as its JSON text in quotes (1 -> "1", True -> "true").
        std::vector<std::pair<std::string, const Value*>> storage;
        for (size_t i = 0; i < v.as_dict().size(); ++i) {
          const Value k = v.as_dict().key_at(i);
          storage.emplace_back(k.is_string() ? k.as_string() : k.is_bool() ? (k.as_bool() ? "true" : "false")
                                                : k.is_none() ? "null" : k.repr(),
                               &v.as_dict().items()[i].second);
        }
        std::vector<std::pair<std::string, const Value*>*> items;
        for (auto& kv : storage) items.push_back(&kv);
        if (items.empty()) { out += "{}"; return; }
        if (sort_keys) std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
        out += '{';
        for (size_t i = 0; i < items.size(); ++i) {
          if (i) out += item_sep;
          newline(level + 1);
          json_string(items[i]->first, out);
          out += key_sep;
          write(*items[i]->second, level + 1);
        }
        newline(level);
        out += '}';
        return;
      }
      default: break;
    }
    throw TemplateError("tojson: Object of type " + v.type_name() + " is not JSON serializable");
  }
};

}  // namespace

std::string Value::to_json(int indent, std::string_view item_sep, std::string_view key_sep, bool sort_keys) const {
  JsonWriter w{indent, item_sep, key_sep, sort_keys, {}};
  if (w.item_sep.empty()) w.item_sep = indent < 0 ? ", " : ",";
  if (w.key_sep.empty()) w.key_sep = ": ";
  w.write(*this, 0);
  return std::move(w.out);
}

nlohmann::ordered_json Value::to_nlohmann() const {
  return nlohmann::ordered_json::parse(to_json(-1, ",", ":"));
}

bool Value::operator==(const Value& o) const {
  if (is_number() && o.is_number()) {
    if (kind_ != Kind::Float && o.kind_ != Kind::Float) return int_ == o.int_;
    return as_number() == o.as_number();
  }
  if (kind_ != o.kind_) return false;
  switch (kind_) {
    case Kind::Undefined:
    case Kind::None: return true;
    case Kind::String: return *str_ == *o.str_;
    case Kind::Array: return generator_ || o.generator_ ? list_ == o.list_ : tuple_ == o.tuple_ && *list_ == *o.list_;
    case Kind::Map: {
      if (namespace_ || o.namespace_) return dict_ == o.dict_;
      if (dict_->size() != o.dict_->size()) return false;
      for (const auto& [k, v] : dict_->items()) {
        const Value* ov = o.dict_->find(k);
        if (!ov || !(*ov == v)) return false;
      }
      return true;
    }
    case Kind::Callable: return fn_ == o.fn_;
    default: return false;
  }
}

bool Value::less(const Value& o) const {
  if (is_number() && o.is_number()) {
    if (kind_ != Kind::Float && o.kind_ != Kind::Float) return int_ < o.int_;
    return as_number() < o.as_number();
  }
  if (is_string() && o.is_string()) return *str_ < *o.str_;
  if (is_list() && o.is_list() && tuple_ == o.tuple_) {
    const List &a = *list_, &b = *o.list_;
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
      if (a[i].less(b[i])) return true;
      if (b[i].less(a[i])) return false;
    }
    return a.size() < b.size();
  }
  throw TemplateError("'<' not supported between instances of '" + type_name() + "' and '" + o.type_name() + "'");
}

Value CallArgs::take(size_t i, const std::string& name) {
  if (taken_keyword.size() != keyword.size()) taken_keyword.assign(keyword.size(), false);
  if (i < positional.size()) {
    taken_positional = std::max(taken_positional, i + 1);
    return positional[i];
  }
  for (size_t k = 0; k < keyword.size(); ++k) {
    if (keyword[k].first == name) {
      taken_keyword[k] = true;
      return keyword[k].second;
    }
  }
  return Value();
}

void CallArgs::expect_consumed(const std::string& callee) const {
  if (positional.size() > taken_positional)
    throw TemplateError(callee + "() takes " + std::to_string(taken_positional) + " positional arguments but " +
                        std::to_string(positional.size()) + " were given");
  for (size_t k = 0; k < keyword.size(); ++k) {
    if (k >= taken_keyword.size() || !taken_keyword[k])
      throw TemplateError(callee + "() got an unexpected keyword argument '" + keyword[k].first + "'");
  }
}

}  // namespace moraine::jinja
