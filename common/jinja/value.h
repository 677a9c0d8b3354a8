// The value type of the Jinja engine: Python's data model as far as chat templates use it
// (None, bool, int, float, str, list/tuple, dict, callables, namespace) plus jinja2's default
// Undefined. Lists, dicts and namespaces are shared by reference, as in Python.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace moraine::jinja {

// Any failure while parsing or rendering; what() names the template line where one is known.
class TemplateError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Value;
struct CallArgs;

// Lists and dicts nest at most this deep (deeper ones are refused when built), so that writing,
// comparing and freeing them stays within the stack.
inline constexpr uint32_t kMaxValueDepth = 1000;
// Strings and the rendered output a template builds hold at most this many bytes, lists this
// many items (range()'s bound; a Value is 80 bytes): doubling a string with `~` in a loop
// reached 2.4 GB in a few ms (chat_template_fuzz), a list of 2^28 items would take 21 GB.
inline constexpr size_t kMaxSequenceSize = size_t{1} << 28;
inline constexpr size_t kMaxListItems = 1000000;
class Renderer;

using List = std::vector<Value>;

// An insertion-ordered str -> Value map (Python dicts keep insertion order).
// Keys are strings; another key (an int, say) is stored under an encoded string beginning with
// "\x01", and key_at() gives it back as the Value it was.
class Dict {
 public:
  const Value* find(const std::string& key) const;
  Value* find(const std::string& key);
  void set(const std::string& key, Value v);
  const Value* find_key(const Value& key) const;
  void set_key(const Value& key, Value v);
  Value key_at(size_t i) const;
  size_t size() const;   // defined below Value: clang (14) needs Value complete to size the pairs
  const std::vector<std::pair<std::string, Value>>& items() const { return items_; }

 private:
  std::vector<std::pair<std::string, Value>> items_;
  std::unordered_map<std::string, size_t> index_;
  std::unordered_map<size_t, std::shared_ptr<const Value>> other_keys_;  // item index -> non-string key
};

struct Function {
  std::string name;
  std::function<Value(Renderer&, CallArgs&)> call;
};

class Value {
 public:
  enum class Kind { Undefined, None, Bool, Int, Float, String, Array, Map, Callable };

  Value() = default;  // Undefined
  static Value undefined(std::string hint) {
    Value v;
    v.str_ = std::make_shared<const std::string>(std::move(hint));
    return v;
  }
  static Value none() { Value v; v.kind_ = Kind::None; return v; }
  Value(bool b) : kind_(Kind::Bool), int_(b) {}
  Value(int64_t i) : kind_(Kind::Int), int_(i) {}
  Value(int i) : kind_(Kind::Int), int_(i) {}
  Value(double d) : kind_(Kind::Float), float_(d) {}
  Value(std::string s) : kind_(Kind::String), str_(std::make_shared<const std::string>(std::move(s))) {}
  Value(const char* s) : Value(std::string(s)) {}
  // A str that jinja2 treats as safe (Markup, from |safe or |escape): `+` with a plain str
  // HTML-escapes the plain one.
  static Value markup(std::string s) {
    Value v(std::move(s));
    v.markup_ = true;
    return v;
  }
  bool is_markup() const { return kind_ == Kind::String && markup_; }
  static Value list(List items, bool tuple = false);
  // What map/select/reject return in jinja2: iterable, always true, no len(), no JSON.
  static Value generator(List items);
  static Value dict(Dict d = {}, bool is_namespace = false);
  static Value function(std::string name, std::function<Value(Renderer&, CallArgs&)> fn);
  // JSON -> Value; throws TemplateError past max_depth levels of nesting.
  static Value from_json(const nlohmann::ordered_json& j, int max_depth = 256);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::Undefined; }
  bool is_none() const { return kind_ == Kind::None; }
  bool is_bool() const { return kind_ == Kind::Bool; }
  bool is_int() const { return kind_ == Kind::Int; }
  bool is_float() const { return kind_ == Kind::Float; }
  bool is_number() const { return kind_ == Kind::Int || kind_ == Kind::Float || kind_ == Kind::Bool; }
  bool is_string() const { return kind_ == Kind::String; }
  bool is_list() const { return kind_ == Kind::Array; }
  bool is_tuple() const { return kind_ == Kind::Array && tuple_; }
  bool is_generator() const { return kind_ == Kind::Array && generator_; }
  bool is_dict() const { return kind_ == Kind::Map && !namespace_; }  // a Mapping
  bool is_namespace() const { return kind_ == Kind::Map && namespace_; }
  bool is_function() const { return kind_ == Kind::Callable; }

  bool as_bool() const { return int_ != 0; }
  int64_t as_int() const { return int_; }
  double as_number() const { return kind_ == Kind::Float ? float_ : static_cast<double>(int_); }
  const std::string& as_string() const { return *str_; }
  const std::string& undefined_hint() const;
  List& as_list() const { return *list_; }
  Dict& as_dict() const { return *dict_; }
  const Function& as_function() const { return *fn_; }

  bool truthy() const;
  // Python's str(): what {{ value }} prints ("" for Undefined, "None", "True", repr for items).
  std::string str() const;
  // Python's repr().
  std::string repr() const;
  std::string repr_at(int depth) const;
  // Python's json.dumps(value, ensure_ascii=False, indent=indent, separators=..., sort_keys=...),
  // as Hugging Face's tojson filter calls it; indent < 0 means None.
  std::string to_json(int indent = -1, std::string_view item_sep = {}, std::string_view key_sep = {},
                      bool sort_keys = false) const;
  nlohmann::ordered_json to_nlohmann() const;
  std::string type_name() const;  // Python's type name, for error messages

  bool operator==(const Value& o) const;
  // Python's <; throws TemplateError for unorderable types.
  bool less(const Value& o) const;

 private:
  Kind kind_ = Kind::Undefined;
  bool tuple_ = false, namespace_ = false, generator_ = false, markup_ = false;
  uint32_t depth_ = 0;  // containers: levels of nesting below, bounded by kMaxValueDepth
  int64_t int_ = 0;
  double float_ = 0;
  std::shared_ptr<const std::string> str_;  // String, or an Undefined's name
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<const Function> fn_;
};

inline size_t Dict::size() const { return items_.size(); }

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
  // The argument at position i or named `name`, removed from the set; Undefined when absent.
  Value take(size_t i, const std::string& name);
  // Throws when an argument is left that no parameter took (call after the takes).
  void expect_consumed(const std::string& callee) const;
  size_t taken_positional = 0;
  std::vector<bool> taken_keyword;
};

// Python's repr() of a float ("1.0", "1e-05", "1e+20", "inf", "nan").
std::string python_float_repr(double d);
// Python's repr() of a str.
std::string python_string_repr(const std::string& s);

}  // namespace moraine::jinja
