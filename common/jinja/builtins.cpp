// Attribute and item access, operators, tests, globals and the methods of str/dict/list, as
// jinja2's ImmutableSandboxedEnvironment exposes them (methods that mutate are refused).
#include <algorithm>
#include <cmath>
#include <ctime>

#include "common/jinja/py_string.h"
#include "common/jinja/renderer.h"

namespace moraine::jinja {
namespace {

Value unsafe(const std::string& name, const Value& obj) {
  return Value::undefined("access to attribute '" + name + "' of '" + obj.type_name() + "' object is unsafe.");
}

Value no_attr(const Value& obj, const std::string& name) {
  if (obj.is_none()) return Value::undefined("'None' has no attribute '" + name + "'");
  return Value::undefined("'" + obj.type_name() + " object' has no attribute '" + name + "'");
}

int64_t int_arg(const Value& v, int64_t dflt, const char* what) {
  if (v.is_undefined() || v.is_none()) return dflt;
  if (!v.is_int() && !v.is_bool()) throw TemplateError(std::string(what) + ": an integer is required, not " + v.type_name());
  return v.as_int();
}

Value method(const std::string& name, std::function<Value(CallArgs&)> fn) {
  return Value::function(name, [name, fn = std::move(fn)](Renderer&, CallArgs& a) {
    Value v = fn(a);
    a.expect_consumed(name);
    return v;
  });
}

bool prefix_test(const std::string& s, const Value& p, bool suffix) {
  auto one = [&](const Value& x) {
    if (!x.is_string()) throw TemplateError(std::string(suffix ? "endswith" : "startswith") + " first arg must be str or a tuple of str, not " + x.type_name());
    const std::string& t = x.as_string();
    if (t.size() > s.size()) return false;
    return suffix ? s.compare(s.size() - t.size(), t.size(), t) == 0 : s.compare(0, t.size(), t) == 0;
  };
  if (p.is_tuple()) return std::any_of(p.as_list().begin(), p.as_list().end(), one);
  return one(p);
}

int64_t cp_index(const std::string& s, size_t byte_pos) {
  return byte_pos == std::string::npos ? -1 : static_cast<int64_t>(code_point_count(s.substr(0, byte_pos)));
}

Value dict_method(const Value& obj, const std::string& name) {
  if (name == "items" || name == "keys" || name == "values") {
    return method(name, [obj, name](CallArgs&) {
      List out;
      const Dict& d = obj.as_dict();
      for (size_t i = 0; i < d.size(); ++i) {
        if (name == "items") out.push_back(Value::list({d.key_at(i), d.items()[i].second}, true));
        else out.push_back(name == "keys" ? d.key_at(i) : d.items()[i].second);
      }
      return Value::list(std::move(out));
    });
  }
  if (name == "get") {
    return method(name, [obj](CallArgs& a) {
      Value k = a.take(0, "key"), d = a.take(1, "default");
      if (d.is_undefined()) d = Value::none();
      if (k.is_undefined() || k.is_list() || k.is_dict() || k.is_function()) return d;
      const Value* v = obj.as_dict().find_key(k);
      return v ? *v : d;
    });
  }
  if (name == "copy") return method(name, [obj](CallArgs&) { return Value::dict(obj.as_dict()); });
  static const char* mutating[] = {"pop", "popitem", "update", "setdefault", "clear"};
  for (const char* m : mutating) if (name == m) return unsafe(name, obj);
  return Value();
}

Value list_method(const Value& obj, const std::string& name) {
  if (name == "index" || name == "count") {
    return method(name, [obj, name](CallArgs& a) {
      Value x = a.take(0, "value");
      int64_t n = 0;
      for (size_t i = 0; i < obj.as_list().size(); ++i) {
        if (obj.as_list()[i] == x) {
          if (name == "index") return Value(static_cast<int64_t>(i));
          ++n;
        }
      }
      if (name == "index") throw TemplateError(x.repr() + " is not in list");
      return Value(n);
    });
  }
  static const char* mutating[] = {"append", "pop", "extend", "insert", "remove", "sort", "reverse", "clear"};
  for (const char* m : mutating) if (name == m && !obj.is_tuple()) return unsafe(name, obj);
  return Value();
}

}  // namespace

std::string html_escape(const Value& v) {
  if (v.is_markup()) return v.as_string();
  std::string out;
  for (char c : v.str()) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

[[noreturn]] void fail_undefined(const Value& v) {
  throw TemplateError(v.undefined_hint().empty() ? std::string("a value is undefined") : v.undefined_hint());
}

Value string_method(const std::string& s, const std::string& name) {
  if (name == "upper") return method(name, [s](CallArgs&) { return Value(py_upper(s)); });
  if (name == "lower") return method(name, [s](CallArgs&) { return Value(py_lower(s)); });
  if (name == "title") return method(name, [s](CallArgs&) { return Value(py_title(s)); });
  if (name == "capitalize") return method(name, [s](CallArgs&) { return Value(py_capitalize(s)); });
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    return method(name, [s, name](CallArgs& a) {
      return Value(py_strip(s, a.take(0, "chars"), name != "rstrip", name != "lstrip"));
    });
  }
  if (name == "split" || name == "rsplit") {
    return method(name, [s, name](CallArgs& a) {
      Value sep = a.take(0, "sep");
      return Value::list(py_split(s, sep, int_arg(a.take(1, "maxsplit"), -1, "maxsplit"), name == "rsplit"));
    });
  }
  if (name == "splitlines") {
    return method(name, [s](CallArgs& a) { return Value::list(py_splitlines(s, a.take(0, "keepends").truthy())); });
  }
  if (name == "startswith" || name == "endswith") {
    return method(name, [s, name](CallArgs& a) { return Value(prefix_test(s, a.take(0, "prefix"), name == "endswith")); });
  }
  if (name == "replace") {
    return method(name, [s](CallArgs& a) {
      Value o = a.take(0, "old"), n = a.take(1, "new");
      if (!o.is_string() || !n.is_string()) throw TemplateError("replace() arguments must be str");
      return Value(py_replace(s, o.as_string(), n.as_string(), int_arg(a.take(2, "count"), -1, "count")));
    });
  }
  if (name == "find" || name == "rfind" || name == "count" || name == "index") {
    return method(name, [s, name](CallArgs& a) {
      Value sub = a.take(0, "sub");
      if (!sub.is_string()) throw TemplateError("must be str, not " + sub.type_name());
      const std::string& t = sub.as_string();
      if (name == "count") {
        if (t.empty()) return Value(static_cast<int64_t>(code_point_count(s) + 1));
        int64_t n = 0;
        for (size_t p = s.find(t); p != std::string::npos; p = s.find(t, p + t.size())) ++n;
        return Value(n);
      }
      const int64_t i = cp_index(s, name == "rfind" ? s.rfind(t) : s.find(t));
      if (name == "index" && i < 0) throw TemplateError("substring not found");
      return Value(i);
    });
  }
  if (name == "join") {
    return method(name, [s](CallArgs& a) {
      std::string out;
      bool first = true;
      for (const Value& v : iterate(a.take(0, "iterable"))) {
        if (!v.is_string()) throw TemplateError("sequence item: expected str instance, " + v.type_name() + " found");
        if (!first) out += s;
        out += v.as_string();
        first = false;
      }
      return Value(std::move(out));
    });
  }
  if (name == "format") {
    return Value::function(name, [s](Renderer&, CallArgs& a) { return Value(py_format(s, a)); });
  }
  if (name == "removeprefix" || name == "removesuffix") {
    return method(name, [s, name](CallArgs& a) {
      Value p = a.take(0, "prefix");
      if (!p.is_string()) throw TemplateError(name + "() argument must be str, not " + p.type_name());
      const bool suffix = name == "removesuffix";
      if (!prefix_test(s, p, suffix)) return Value(s);
      const size_t n = p.as_string().size();
      return Value(suffix ? s.substr(0, s.size() - n) : s.substr(n));
    });
  }
  static const char* predicates[] = {"isdigit", "isalpha", "isalnum", "isspace", "islower", "isupper"};
  for (const char* p : predicates) {
    if (name != p) continue;
    return method(name, [s, name](CallArgs&) {
      if (s.empty()) return Value(false);
      if (name == "isspace") {
        for (const std::string& cp : code_points(s)) if (!is_py_space(cp)) return Value(false);
        return Value(true);
      }
      bool cased = false;
      for (unsigned char c : s) {
        const bool lo = c >= 'a' && c <= 'z', up = c >= 'A' && c <= 'Z', dg = c >= '0' && c <= '9';
        if (name == "isdigit" && !dg) return Value(false);
        if (name == "isalpha" && !(lo || up)) return Value(false);
        if (name == "isalnum" && !(lo || up || dg)) return Value(false);
        if (name == "islower" && up) return Value(false);
        if (name == "isupper" && lo) return Value(false);
        cased = cased || lo || up;
      }
      return Value(name == "islower" || name == "isupper" ? cased : true);
    });
  }
  return Value();
}

Value get_attr(const Value& obj, const std::string& name) {
  Value m;
  switch (obj.kind()) {
    case Value::Kind::Undefined: fail_undefined(obj);
    case Value::Kind::String: m = string_method(obj.as_string(), name); break;
    case Value::Kind::Array: m = list_method(obj, name); break;
    case Value::Kind::Map: {
      if (obj.is_namespace()) {
        const Value* v = obj.as_dict().find(name);
        return v ? *v : no_attr(obj, name);
      }
      m = dict_method(obj, name);
      if (!m.is_undefined() || !m.undefined_hint().empty()) return m;
      const Value* v = obj.as_dict().find(name);
      return v ? *v : no_attr(obj, name);
    }
    default: break;
  }
  if (!m.is_undefined() || !m.undefined_hint().empty()) return m;
  return no_attr(obj, name);
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.is_undefined()) fail_undefined(obj);
  if (obj.is_generator()) throw TemplateError("'generator' object is not subscriptable");
  if ((obj.is_dict() || obj.is_namespace()) && key.is_string()) {
    const Value* v = obj.as_dict().find(key.as_string());
    if (v) return *v;
    return obj.is_dict() ? get_attr(obj, key.as_string()) : no_attr(obj, key.as_string());
  }
  if (obj.is_dict() && (key.is_number() || key.is_none())) {
    const Value* v = obj.as_dict().find_key(key);
    return v ? *v : Value::undefined("'dict object' has no attribute " + key.repr());
  }
  if ((obj.is_list() || obj.is_string()) && (key.is_int() || key.is_bool())) {
    int64_t i = key.as_int();
    if (obj.is_list()) {
      const int64_t n = static_cast<int64_t>(obj.as_list().size());
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value::undefined("list object has no element " + std::to_string(key.as_int()));
      return obj.as_list()[static_cast<size_t>(i)];
    }
    std::vector<std::string> cps = code_points(obj.as_string());
    const int64_t n = static_cast<int64_t>(cps.size());
    if (i < 0) i += n;
    if (i < 0 || i >= n) return Value::undefined("str object has no element " + std::to_string(key.as_int()));
    return Value(cps[static_cast<size_t>(i)]);
  }
  if (key.is_string()) return get_attr(obj, key.as_string());
  return Value::undefined("'" + obj.type_name() + " object' has no attribute " + key.repr());
}

Value slice_of(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  if (obj.is_undefined()) fail_undefined(obj);
  std::vector<std::string> cps;
  const bool is_str = obj.is_string();
  if (is_str) cps = code_points(obj.as_string());
  else if (!obj.is_list() || obj.is_generator()) throw TemplateError("'" + obj.type_name() + "' object is not subscriptable");
  const int64_t n = static_cast<int64_t>(is_str ? cps.size() : obj.as_list().size());
  const int64_t st = int_arg(step, 1, "slice step");
  if (st == 0) throw TemplateError("slice step cannot be zero");
  auto norm = [&](const Value& v, int64_t dflt) {
    if (v.is_none() || v.is_undefined()) return dflt;
    int64_t i = int_arg(v, 0, "slice index");
    if (i < 0) i += n;
    if (st > 0) return std::clamp<int64_t>(i, 0, n);
    return std::clamp<int64_t>(i, -1, n - 1);
  };
  const int64_t b = norm(start, st > 0 ? 0 : n - 1), e = norm(stop, st > 0 ? n : -1);
  std::string s;
  List l;
  for (int64_t i = b; st > 0 ? i < e : i > e; i += st) {
    if (is_str) s += cps[static_cast<size_t>(i)];
    else l.push_back(obj.as_list()[static_cast<size_t>(i)]);
  }
  return is_str ? Value(std::move(s)) : Value::list(std::move(l), obj.is_tuple());
}

List iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined: return {};
    case Value::Kind::Array: return v.as_list();
    case Value::Kind::Map: {
      if (v.is_namespace()) break;
      List keys;
      for (size_t i = 0; i < v.as_dict().size(); ++i) keys.push_back(v.as_dict().key_at(i));
      return keys;
    }
    case Value::Kind::String: {
      List out;
      for (std::string& cp : code_points(v.as_string())) out.push_back(Value(std::move(cp)));
      return out;
    }
    default: break;
  }
  throw TemplateError("'" + v.type_name() + "' object is not iterable");
}

bool contains(const Value& c, const Value& item) {
  if (c.is_string()) {
    if (!item.is_string()) throw TemplateError("'in <string>' requires string as left operand, not " + item.type_name());
    return c.as_string().find(item.as_string()) != std::string::npos;
  }
  if (c.is_dict()) {
    if (!item.is_string() && !item.is_number() && !item.is_none()) return false;
    return c.as_dict().find_key(item) != nullptr;
  }
  if (c.is_list()) return std::any_of(c.as_list().begin(), c.as_list().end(), [&](const Value& x) { return x == item; });
  if (c.is_undefined()) return false;
  throw TemplateError("argument of type '" + c.type_name() + "' is not iterable");
}

namespace {

[[noreturn]] void bad_operands(const std::string& op, const Value& a, const Value& b) {
  throw TemplateError("unsupported operand type(s) for " + op + ": '" + a.type_name() + "' and '" + b.type_name() + "'");
}

Value repeat(const Value& seq, int64_t n) {
  // Bounded like range(): a template asking for more is refused rather than allowed to exhaust memory.
  const size_t unit = seq.is_string() ? seq.as_string().size() : seq.as_list().size();
  const size_t limit = seq.is_string() ? kMaxSequenceSize : kMaxListItems;
  if (n > 0 && unit > 0 && static_cast<uint64_t>(n) > limit / unit)
    throw TemplateError(seq.is_string() ? "string repetition of more than 2^28 bytes" : "list repetition of more than 1,000,000 items");
  if (seq.is_string()) {
    std::string out;
    for (int64_t i = 0; i < n; ++i) out += seq.as_string();
    return Value(std::move(out));
  }
  List out;
  for (int64_t i = 0; i < n; ++i) out.insert(out.end(), seq.as_list().begin(), seq.as_list().end());
  return Value::list(std::move(out), seq.is_tuple());
}

Value arithmetic(const std::string& op, const Value& a, const Value& b) {
  const bool ints = !a.is_float() && !b.is_float();
  const int64_t x = a.as_int(), y = b.as_int();
  const double fx = a.as_number(), fy = b.as_number();
  int64_t r = 0;
  if (op == "+") return ints && !__builtin_add_overflow(x, y, &r) ? Value(r) : Value(fx + fy);
  if (op == "-") return ints && !__builtin_sub_overflow(x, y, &r) ? Value(r) : Value(fx - fy);
  if (op == "*") return ints && !__builtin_mul_overflow(x, y, &r) ? Value(r) : Value(fx * fy);
  if ((op == "/" || op == "//" || op == "%") && (ints ? y == 0 : fy == 0.0))
    throw TemplateError(ints && op != "/" ? "integer division or modulo by zero" : "division by zero");
  if (op == "/") return Value(fx / fy);
  if (op == "//") {
    if (ints) return Value(x / y - ((x % y != 0) && ((x < 0) != (y < 0))));
    return Value(std::floor(fx / fy));
  }
  if (op == "%") {
    if (ints) {
      const int64_t m = x % y;
      return Value(m != 0 && ((m < 0) != (y < 0)) ? m + y : m);
    }
    const double m = std::fmod(fx, fy);
    return Value(m != 0 && ((m < 0) != (fy < 0)) ? m + fy : m);
  }
  if (op == "**") {
    if (ints && y >= 0) {
      int64_t p = 1;
      for (int64_t i = 0; i < y; ++i) {
        if (__builtin_mul_overflow(p, x, &p)) return Value(std::pow(fx, fy));
      }
      return Value(p);
    }
    return Value(std::pow(fx, fy));
  }
  bad_operands(op, a, b);
}

void check_concat(size_t a, size_t b) {
  if (a + b > kMaxSequenceSize) throw TemplateError("string concatenation of more than 2^28 bytes");
}
void check_list_concat(size_t a, size_t b) {
  if (a + b > kMaxListItems) throw TemplateError("list concatenation of more than 1,000,000 items");
}

}  // namespace

Value binary_op(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") {
    std::string s = a.str();
    const std::string t = b.str();
    check_concat(s.size(), t.size());
    return Value(s += t);
  }
  if (op == "==") return Value(a == b);
  if (op == "!=") return Value(!(a == b));
  if (op == "in") return Value(contains(b, a));
  if (op == "not in") return Value(!contains(b, a));
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  if (op == "<") return Value(a.less(b));
  if (op == ">") return Value(b.less(a));
  if (op == "<=") return Value(!b.less(a));
  if (op == ">=") return Value(!a.less(b));
  if (a.is_number() && b.is_number()) return arithmetic(op, a, b);
  if (op == "+") {
    if (a.is_string() && b.is_string()) check_concat(a.as_string().size(), b.as_string().size());
    if (a.is_markup() || b.is_markup()) {
      if (a.is_string() && b.is_string()) return Value::markup(html_escape(a) + html_escape(b));
    }
    if (a.is_string() && b.is_string()) return Value(a.as_string() + b.as_string());
    if (a.is_list() && b.is_list() && a.is_tuple() == b.is_tuple() && !a.is_generator() && !b.is_generator()) {
      check_list_concat(a.as_list().size(), b.as_list().size());
      List out = a.as_list();
      out.insert(out.end(), b.as_list().begin(), b.as_list().end());
      return Value::list(std::move(out), a.is_tuple());
    }
  }
  if (op == "*") {
    if ((a.is_string() || a.is_list()) && (b.is_int() || b.is_bool())) return repeat(a, b.as_int());
    if ((b.is_string() || b.is_list()) && (a.is_int() || a.is_bool())) return repeat(b, a.as_int());
  }
  if (op == "%" && a.is_string()) {
    // printf-style formatting: %s only, which is all the templates here use.
    CallArgs args;
    if (b.is_tuple()) args.positional = b.as_list();
    else args.positional.push_back(b);
    std::string out;
    size_t k = 0;
    const std::string& f = a.as_string();
    for (size_t i = 0; i < f.size(); ++i) {
      if (f[i] != '%' || i + 1 >= f.size()) { out += f[i]; continue; }
      const char c = f[++i];
      if (c == '%') { out += '%'; continue; }
      if (c != 's' && c != 'd' && c != 'r') throw TemplateError(std::string("unsupported format character '") + c + "'");
      if (k >= args.positional.size()) throw TemplateError("not enough arguments for format string");
      const Value& v = args.positional[k++];
      out += c == 'r' ? v.repr() : c == 'd' ? std::to_string(static_cast<int64_t>(v.as_number())) : v.str();
    }
    if (k < args.positional.size()) throw TemplateError("not all arguments converted during string formatting");
    return Value(std::move(out));
  }
  bad_operands(op, a, b);
}

}  // namespace moraine::jinja
