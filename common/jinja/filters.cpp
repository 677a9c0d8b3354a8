// jinja2's built-in filters and tests that chat templates use, Hugging Face's tojson, and the
// globals (range, dict, namespace, raise_exception, strftime_now).
#include <algorithm>
#include <cmath>
#include <ctime>
#include <map>

#include "common/jinja/py_string.h"
#include "common/jinja/renderer.h"

namespace moraine::jinja {
namespace {

using FilterFn = Value (*)(Renderer&, const Value&, CallArgs&);
using TestFn = bool (*)(Renderer&, const Value&, CallArgs&);

Value attr_path(const Value& obj, const Value& attribute) {
  if (attribute.is_int()) return get_item(obj, attribute);
  Value cur = obj;
  for (const Value& part : py_split(attribute.str(), Value("."), -1, false)) {
    const std::string& p = part.as_string();
    const bool digits = !p.empty() && std::all_of(p.begin(), p.end(), [](char c) { return c >= '0' && c <= '9'; });
    cur = digits ? get_item(cur, Value(static_cast<int64_t>(std::stoll(p)))) : get_item(cur, part);
  }
  return cur;
}

// The sort key of jinja2's sort/dictsort/unique/min/max: lowercased strings unless case_sensitive.
Value sort_key(const Value& v, bool case_sensitive) {
  return !case_sensitive && v.is_string() ? Value(py_lower(v.as_string())) : v;
}

int64_t length_of(const Value& v) {
  if (v.is_generator()) throw TemplateError("object of type 'generator' has no len()");
  if (v.is_string()) return static_cast<int64_t>(code_point_count(v.as_string()));
  if (v.is_list()) return static_cast<int64_t>(v.as_list().size());
  if (v.is_dict()) return static_cast<int64_t>(v.as_dict().size());
  if (v.is_undefined()) return 0;
  throw TemplateError("object of type '" + v.type_name() + "' has no len()");
}

std::string ascii_escape_json(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) { out += static_cast<char>(c); ++i; continue; }
    const size_t n = (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
    uint32_t cp = c & (n == 2 ? 0x1f : n == 3 ? 0x0f : 0x07);
    for (size_t k = 1; k < n && i + k < s.size(); ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
    i += n;
    char buf[16];
    if (cp >= 0x10000) {
      cp -= 0x10000;
      std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xd800 + (cp >> 10), 0xdc00 + (cp & 0x3ff));
    } else {
      std::snprintf(buf, sizeof buf, "\\u%04x", cp);
    }
    out += buf;
  }
  return out;
}

Value f_tojson(Renderer&, const Value& v, CallArgs& a) {
  const Value ensure_ascii = a.take(0, "ensure_ascii"), indent = a.take(1, "indent"), seps = a.take(2, "separators"),
              sort_keys = a.take(3, "sort_keys");
  a.expect_consumed("tojson");
  int ind = -1;
  std::string ind_str;
  if (indent.is_int()) ind = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(indent.as_int(), 64)));
  else if (!indent.is_none() && !indent.is_undefined()) throw TemplateError("tojson: indent must be an integer");
  std::string item_sep, key_sep;
  if (seps.is_list()) {
    if (seps.as_list().size() != 2 || !seps.as_list()[0].is_string() || !seps.as_list()[1].is_string())
      throw TemplateError("tojson: separators must be a pair of strings");
    item_sep = seps.as_list()[0].as_string();
    key_sep = seps.as_list()[1].as_string();
  }
  std::string out = v.to_json(ind, item_sep, key_sep, sort_keys.truthy());
  return Value(ensure_ascii.truthy() ? ascii_escape_json(out) : out);
}

Value f_default(Renderer&, const Value& v, CallArgs& a) {
  Value d = a.take(0, "default_value"), boolean = a.take(1, "boolean");
  a.expect_consumed("default");
  if (d.is_undefined()) d = Value("");
  if (v.is_undefined() || (boolean.truthy() && !v.truthy())) return d;
  return v;
}

Value f_length(Renderer&, const Value& v, CallArgs& a) {
  a.expect_consumed("length");
  return Value(length_of(v));
}

Value f_string(Renderer&, const Value& v, CallArgs& a) {
  a.expect_consumed("string");
  return v.is_string() ? v : Value(v.str());
}

Value f_trim(Renderer&, const Value& v, CallArgs& a) {
  Value chars = a.take(0, "chars");
  a.expect_consumed("trim");
  return Value(py_strip(v.str(), chars, true, true));
}

Value f_upper(Renderer&, const Value& v, CallArgs& a) { a.expect_consumed("upper"); return Value(py_upper(v.str())); }
Value f_lower(Renderer&, const Value& v, CallArgs& a) { a.expect_consumed("lower"); return Value(py_lower(v.str())); }
Value f_capitalize(Renderer&, const Value& v, CallArgs& a) {
  a.expect_consumed("capitalize");
  return Value(py_capitalize(v.str()));
}

// jinja2's title: words start after '-', whitespace, '(', '{', '[' or '<'.
Value f_title(Renderer&, const Value& v, CallArgs& a) {
  a.expect_consumed("title");
  std::string s = v.str();
  bool start = true;
  for (char& c : s) {
    const bool sep = c == '-' || c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v' || c == '(' ||
                     c == '{' || c == '[' || c == '<';
    if (sep) { start = true; continue; }
    if (start && c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
    else if (!start && c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
    start = false;
  }
  return Value(std::move(s));
}

Value f_safe(Renderer&, const Value& v, CallArgs& a) {
  a.expect_consumed("safe");
  return Value::markup(v.str());
}

Value f_escape(Renderer&, const Value& v, CallArgs& a) {
  a.expect_consumed("escape");
  return Value::markup(html_escape(v));
}

Value f_replace(Renderer&, const Value& v, CallArgs& a) {
  Value o = a.take(0, "old"), n = a.take(1, "new"), c = a.take(2, "count");
  a.expect_consumed("replace");
  return Value(py_replace(v.str(), o.str(), n.str(), c.is_int() ? c.as_int() : -1));
}

Value f_join(Renderer&, const Value& v, CallArgs& a) {
  Value sep = a.take(0, "d"), attribute = a.take(1, "attribute");
  a.expect_consumed("join");
  std::string out;
  bool first = true;
  for (const Value& x : iterate(v)) {
    if (!first) out += sep.str();
    out += (attribute.is_undefined() || attribute.is_none() ? x : attr_path(x, attribute)).str();
    first = false;
  }
  return Value(std::move(out));
}

Value f_list(Renderer&, const Value& v, CallArgs& a) { a.expect_consumed("list"); return Value::list(iterate(v)); }

Value f_first(Renderer&, const Value& v, CallArgs& a) {
  a.expect_consumed("first");
  List l = iterate(v);
  return l.empty() ? Value::undefined("No first item, sequence was empty.") : l.front();
}

Value f_last(Renderer&, const Value& v, CallArgs& a) {
  a.expect_consumed("last");
  List l = iterate(v);
  return l.empty() ? Value::undefined("No last item, sequence was empty.") : l.back();
}

Value f_reverse(Renderer&, const Value& v, CallArgs& a) {
  a.expect_consumed("reverse");
  if (v.is_string()) {
    std::vector<std::string> cps = code_points(v.as_string());
    std::string out;
    for (auto it = cps.rbegin(); it != cps.rend(); ++it) out += *it;
    return Value(std::move(out));
  }
  List l = iterate(v);
  std::reverse(l.begin(), l.end());
  return Value::list(std::move(l));
}

Value f_items(Renderer&, const Value& v, CallArgs& a) {
  a.expect_consumed("items");
  if (v.is_undefined()) return Value::list({});
  if (!v.is_dict()) throw TemplateError("items: can only get item pairs from a mapping, not " + v.type_name());
  List out;
  for (size_t i = 0; i < v.as_dict().size(); ++i) out.push_back(Value::list({v.as_dict().key_at(i), v.as_dict().items()[i].second}, true));
  return Value::list(std::move(out));
}

Value f_dictsort(Renderer&, const Value& v, CallArgs& a) {
  const bool cs = a.take(0, "case_sensitive").truthy();
  Value by = a.take(1, "by");
  const bool rev = a.take(2, "reverse").truthy();
  a.expect_consumed("dictsort");
  if (!v.is_dict()) throw TemplateError("dictsort: a mapping is required, not " + v.type_name());
  const size_t pos = by.is_string() && by.as_string() == "value" ? 1 : 0;
  List out;
  for (size_t i = 0; i < v.as_dict().size(); ++i) out.push_back(Value::list({v.as_dict().key_at(i), v.as_dict().items()[i].second}, true));
  std::stable_sort(out.begin(), out.end(), [&](const Value& l, const Value& r) {
    const Value kl = sort_key(l.as_list()[pos], cs), kr = sort_key(r.as_list()[pos], cs);
    return rev ? kr.less(kl) : kl.less(kr);
  });
  return Value::list(std::move(out));
}

Value f_sort(Renderer&, const Value& v, CallArgs& a) {
  const bool rev = a.take(0, "reverse").truthy(), cs = a.take(1, "case_sensitive").truthy();
  Value attribute = a.take(2, "attribute");
  a.expect_consumed("sort");
  List l = iterate(v);
  const bool by_attr = !attribute.is_undefined() && !attribute.is_none();
  std::stable_sort(l.begin(), l.end(), [&](const Value& x, const Value& y) {
    const Value kx = sort_key(by_attr ? attr_path(x, attribute) : x, cs), ky = sort_key(by_attr ? attr_path(y, attribute) : y, cs);
    return rev ? ky.less(kx) : kx.less(ky);
  });
  return Value::list(std::move(l));
}

Value f_unique(Renderer&, const Value& v, CallArgs& a) {
  const bool cs = a.take(0, "case_sensitive").truthy();
  Value attribute = a.take(1, "attribute");
  a.expect_consumed("unique");
  List out, seen;
  for (const Value& x : iterate(v)) {
    const Value k = sort_key(attribute.is_undefined() || attribute.is_none() ? x : attr_path(x, attribute), cs);
    if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return s == k; })) {
      seen.push_back(k);
      out.push_back(x);
    }
  }
  return Value::list(std::move(out));
}

Value min_max(const Value& v, CallArgs& a, bool want_max) {
  const bool cs = a.take(0, "case_sensitive").truthy();
  Value attribute = a.take(1, "attribute");
  a.expect_consumed(want_max ? "max" : "min");
  List l = iterate(v);
  if (l.empty()) return Value::undefined(std::string("No aggregated item, sequence was empty."));
  const bool by_attr = !attribute.is_undefined() && !attribute.is_none();
  size_t best = 0;
  for (size_t i = 1; i < l.size(); ++i) {
    const Value ki = sort_key(by_attr ? attr_path(l[i], attribute) : l[i], cs);
    const Value kb = sort_key(by_attr ? attr_path(l[best], attribute) : l[best], cs);
    if (want_max ? kb.less(ki) : ki.less(kb)) best = i;
  }
  return l[best];
}

Value f_min(Renderer&, const Value& v, CallArgs& a) { return min_max(v, a, false); }
Value f_max(Renderer&, const Value& v, CallArgs& a) { return min_max(v, a, true); }

Value f_sum(Renderer&, const Value& v, CallArgs& a) {
  Value attribute = a.take(0, "attribute"), start = a.take(1, "start");
  a.expect_consumed("sum");
  Value total = start.is_undefined() ? Value(int64_t{0}) : start;
  for (const Value& x : iterate(v))
    total = binary_op("+", total, attribute.is_undefined() || attribute.is_none() ? x : attr_path(x, attribute));
  return total;
}

Value f_int(Renderer&, const Value& v, CallArgs& a) {
  Value dflt = a.take(0, "default");
  a.expect_consumed("int");
  const Value fallback = dflt.is_undefined() ? Value(int64_t{0}) : dflt;
  if (v.is_int() || v.is_bool()) return Value(v.as_int());
  if (v.is_float()) return std::isfinite(v.as_number()) ? Value(static_cast<int64_t>(v.as_number())) : fallback;
  if (v.is_string()) {
    const std::string s = py_strip(v.as_string(), Value::none(), true, true);
    try {
      size_t used = 0;
      const long long i = std::stoll(s, &used, 10);
      if (used == s.size()) return Value(static_cast<int64_t>(i));
      const double d = std::stod(s, &used);
      if (used == s.size() && std::isfinite(d)) return Value(static_cast<int64_t>(d));
    } catch (const std::exception&) {
    }
  }
  return fallback;
}

Value f_float(Renderer&, const Value& v, CallArgs& a) {
  Value dflt = a.take(0, "default");
  a.expect_consumed("float");
  const Value fallback = dflt.is_undefined() ? Value(0.0) : dflt;
  if (v.is_number()) return Value(v.as_number());
  if (v.is_string()) {
    try {
      size_t used = 0;
      const std::string s = py_strip(v.as_string(), Value::none(), true, true);
      const double d = std::stod(s, &used);
      if (used == s.size()) return Value(d);
    } catch (const std::exception&) {
    }
  }
  return fallback;
}

Value f_abs(Renderer&, const Value& v, CallArgs& a) {
  a.expect_consumed("abs");
  if (v.is_float()) return Value(std::fabs(v.as_number()));
  if (v.is_number()) return Value(v.as_int() < 0 ? -v.as_int() : v.as_int());
  throw TemplateError("bad operand type for abs(): '" + v.type_name() + "'");
}

Value f_round(Renderer&, const Value& v, CallArgs& a) {
  Value precision = a.take(0, "precision"), how = a.take(1, "method");
  a.expect_consumed("round");
  const double p = std::pow(10.0, precision.is_int() ? static_cast<double>(precision.as_int()) : 0.0);
  const std::string m = how.is_string() ? how.as_string() : "common";
  const double x = v.as_number() * p;
  const double r = m == "ceil" ? std::ceil(x) : m == "floor" ? std::floor(x) : std::round(x);
  return Value(r / p);
}

// jinja2's indent: the first line is left alone unless `first`; blank lines unless `blank`.
Value f_indent(Renderer&, const Value& v, CallArgs& a) {
  Value width = a.take(0, "width"), first = a.take(1, "first"), blank = a.take(2, "blank");
  a.expect_consumed("indent");
  const std::string ind = width.is_string() ? width.as_string() : std::string(static_cast<size_t>(width.is_int() ? width.as_int() : 4), ' ');
  List lines = py_splitlines(v.str() + "\n", false);
  std::string rv;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& line = lines[i].as_string();
    if (i == 0) { rv = line; continue; }
    rv += "\n";
    if (blank.truthy() || !line.empty()) rv += ind;
    rv += line;
  }
  if (first.truthy()) rv = ind + rv;
  return Value(std::move(rv));
}

Value f_attr(Renderer&, const Value& v, CallArgs& a) {
  Value name = a.take(0, "name");
  a.expect_consumed("attr");
  return get_attr(v, name.str());
}

Value f_map(Renderer& r, const Value& v, CallArgs& a) {
  List out;
  if (!v.truthy()) return Value::generator({});
  Value attribute;
  for (const auto& [k, x] : a.keyword) if (k == "attribute") attribute = x;
  if (!attribute.is_undefined()) {
    Value dflt;
    for (const auto& [k, x] : a.keyword) if (k == "default") dflt = x;
    for (const Value& x : iterate(v)) {
      Value got = attr_path(x, attribute);
      out.push_back(got.is_undefined() && !dflt.is_undefined() ? dflt : got);
    }
    return Value::generator(std::move(out));
  }
  if (a.positional.empty()) throw TemplateError("map: a filter name or attribute= is required");
  const std::string name = a.positional[0].str();
  for (const Value& x : iterate(v)) {
    CallArgs rest;
    rest.positional.assign(a.positional.begin() + 1, a.positional.end());
    rest.keyword = a.keyword;
    out.push_back(apply_filter(r, name, x, rest));
  }
  return Value::generator(std::move(out));
}

Value select_common(Renderer& r, const Value& v, CallArgs& a, bool by_attr, bool keep_if) {
  size_t i = 0;
  Value attribute;
  if (by_attr) {
    if (a.positional.empty()) throw TemplateError("selectattr: an attribute name is required");
    attribute = a.positional[i++];
  }
  std::string test;
  if (i < a.positional.size()) test = a.positional[i++].str();
  List out;
  if (!v.truthy()) return Value::generator({});
  for (const Value& x : iterate(v)) {
    const Value subject = by_attr ? attr_path(x, attribute) : x;
    bool ok;
    if (test.empty()) {
      ok = subject.truthy();
    } else {
      CallArgs rest;
      rest.positional.assign(a.positional.begin() + static_cast<std::ptrdiff_t>(i), a.positional.end());
      ok = apply_test(r, test, subject, rest);
    }
    if (ok == keep_if) out.push_back(x);
  }
  return Value::generator(std::move(out));
}

Value f_select(Renderer& r, const Value& v, CallArgs& a) { return select_common(r, v, a, false, true); }
Value f_reject(Renderer& r, const Value& v, CallArgs& a) { return select_common(r, v, a, false, false); }
Value f_selectattr(Renderer& r, const Value& v, CallArgs& a) { return select_common(r, v, a, true, true); }
Value f_rejectattr(Renderer& r, const Value& v, CallArgs& a) { return select_common(r, v, a, true, false); }

Value f_wordcount(Renderer&, const Value& v, CallArgs& a) {
  a.expect_consumed("wordcount");
  return Value(static_cast<int64_t>(py_split(v.str(), Value::none(), -1, false).size()));
}

const std::map<std::string, FilterFn>& filters() {
  static const std::map<std::string, FilterFn> table = {
      {"abs", f_abs}, {"attr", f_attr}, {"capitalize", f_capitalize}, {"count", f_length}, {"d", f_default},
      {"default", f_default}, {"dictsort", f_dictsort}, {"e", f_escape}, {"escape", f_escape}, {"first", f_first},
      {"float", f_float}, {"indent", f_indent}, {"int", f_int}, {"items", f_items}, {"join", f_join},
      {"last", f_last}, {"length", f_length}, {"list", f_list}, {"lower", f_lower}, {"map", f_map}, {"max", f_max},
      {"min", f_min}, {"reject", f_reject}, {"rejectattr", f_rejectattr}, {"replace", f_replace},
      {"reverse", f_reverse}, {"round", f_round}, {"safe", f_safe}, {"select", f_select},
      {"selectattr", f_selectattr}, {"sort", f_sort}, {"string", f_string}, {"sum", f_sum}, {"title", f_title},
      {"tojson", f_tojson}, {"trim", f_trim}, {"unique", f_unique}, {"upper", f_upper}, {"wordcount", f_wordcount},
  };
  return table;
}

bool arg_or_fail(CallArgs& a, const char* test, Value& out) {
  out = a.take(0, "other");
  a.expect_consumed(test);
  if (out.is_undefined() && a.positional.empty()) throw TemplateError(std::string(test) + "() missing 1 required positional argument");
  return true;
}

bool t_defined(Renderer&, const Value& v, CallArgs&) { return !v.is_undefined(); }
bool t_undefined(Renderer&, const Value& v, CallArgs&) { return v.is_undefined(); }
bool t_none(Renderer&, const Value& v, CallArgs&) { return v.is_none(); }
bool t_boolean(Renderer&, const Value& v, CallArgs&) { return v.is_bool(); }
bool t_true(Renderer&, const Value& v, CallArgs&) { return v.is_bool() && v.as_bool(); }
bool t_false(Renderer&, const Value& v, CallArgs&) { return v.is_bool() && !v.as_bool(); }
bool t_integer(Renderer&, const Value& v, CallArgs&) { return v.is_int(); }
bool t_float(Renderer&, const Value& v, CallArgs&) { return v.is_float(); }
bool t_number(Renderer&, const Value& v, CallArgs&) { return v.is_number(); }
bool t_string(Renderer&, const Value& v, CallArgs&) { return v.is_string(); }
bool t_mapping(Renderer&, const Value& v, CallArgs&) { return v.is_dict(); }
bool t_iterable(Renderer&, const Value& v, CallArgs&) { return v.is_undefined() || v.is_list() || v.is_dict() || v.is_string(); }
bool t_sequence(Renderer&, const Value& v, CallArgs&) { return v.is_undefined() || (v.is_list() && !v.is_generator()) || v.is_dict() || v.is_string(); }
bool t_callable(Renderer&, const Value& v, CallArgs&) { return v.is_function(); }
bool t_lower(Renderer&, const Value& v, CallArgs&) { const std::string s = v.str(); return py_lower(s) == s; }
bool t_upper(Renderer&, const Value& v, CallArgs&) { const std::string s = v.str(); return py_upper(s) == s; }
bool t_odd(Renderer&, const Value& v, CallArgs&) { return v.is_number() && v.as_int() % 2 != 0; }
bool t_even(Renderer&, const Value& v, CallArgs&) { return v.is_number() && v.as_int() % 2 == 0; }
bool t_divisibleby(Renderer&, const Value& v, CallArgs& a) {
  Value n;
  arg_or_fail(a, "divisibleby", n);
  if (n.as_int() == 0) throw TemplateError("integer division or modulo by zero");
  return v.as_int() % n.as_int() == 0;
}
bool t_eq(Renderer&, const Value& v, CallArgs& a) { Value o; arg_or_fail(a, "eq", o); return v == o; }
bool t_ne(Renderer&, const Value& v, CallArgs& a) { Value o; arg_or_fail(a, "ne", o); return !(v == o); }
bool t_lt(Renderer&, const Value& v, CallArgs& a) { Value o; arg_or_fail(a, "lt", o); return v.less(o); }
bool t_gt(Renderer&, const Value& v, CallArgs& a) { Value o; arg_or_fail(a, "gt", o); return o.less(v); }
bool t_le(Renderer&, const Value& v, CallArgs& a) { Value o; arg_or_fail(a, "le", o); return !o.less(v); }
bool t_ge(Renderer&, const Value& v, CallArgs& a) { Value o; arg_or_fail(a, "ge", o); return !v.less(o); }
bool t_in(Renderer&, const Value& v, CallArgs& a) { Value o; arg_or_fail(a, "in", o); return contains(o, v); }
bool t_sameas(Renderer&, const Value& v, CallArgs& a) {
  Value o;
  arg_or_fail(a, "sameas", o);
  if (v.is_none() || v.is_bool() || o.is_none() || o.is_bool()) return v.kind() == o.kind() && v == o;
  return v == o && (v.is_int() || v.is_string());
}
bool t_filter(Renderer&, const Value& v, CallArgs&) { return v.is_string() && has_filter(v.as_string()); }
bool t_test(Renderer&, const Value& v, CallArgs&) { return v.is_string() && has_test(v.as_string()); }

const std::map<std::string, TestFn>& tests() {
  static const std::map<std::string, TestFn> table = {
      {"!=", t_ne}, {"<", t_lt}, {"<=", t_le}, {"==", t_eq}, {">", t_gt}, {">=", t_ge}, {"boolean", t_boolean},
      {"callable", t_callable}, {"defined", t_defined}, {"divisibleby", t_divisibleby}, {"eq", t_eq},
      {"equalto", t_eq}, {"even", t_even}, {"false", t_false}, {"filter", t_filter}, {"float", t_float},
      {"ge", t_ge}, {"greaterthan", t_gt}, {"gt", t_gt}, {"in", t_in}, {"integer", t_integer},
      {"iterable", t_iterable}, {"le", t_le}, {"lessthan", t_lt}, {"lower", t_lower}, {"lt", t_lt},
      {"mapping", t_mapping}, {"ne", t_ne}, {"none", t_none}, {"number", t_number}, {"odd", t_odd},
      {"sameas", t_sameas}, {"sequence", t_sequence}, {"string", t_string}, {"test", t_test}, {"true", t_true},
      {"undefined", t_undefined}, {"upper", t_upper},
  };
  return table;
}

}  // namespace

bool has_filter(const std::string& name) { return filters().count(name) != 0; }
bool has_test(const std::string& name) { return tests().count(name) != 0; }

Value apply_filter(Renderer& r, const std::string& name, const Value& input, CallArgs& args) {
  auto it = filters().find(name);
  if (it == filters().end()) throw TemplateError("No filter named '" + name + "'.");
  return it->second(r, input, args);
}

bool apply_test(Renderer& r, const std::string& name, const Value& input, CallArgs& args) {
  auto it = tests().find(name);
  if (it == tests().end()) throw TemplateError("No test named '" + name + "'.");
  return it->second(r, input, args);
}

void add_globals(Frame& g) {
  g.vars["range"] = Value::function("range", [](Renderer&, CallArgs& a) {
    if (a.positional.empty() || a.positional.size() > 3) throw TemplateError("range expected 1 to 3 arguments");
    for (const Value& v : a.positional)
      if (!v.is_int() && !v.is_bool()) throw TemplateError("'" + v.type_name() + "' object cannot be interpreted as an integer");
    int64_t start = 0, stop, step = 1;
    if (a.positional.size() == 1) stop = a.positional[0].as_int();
    else { start = a.positional[0].as_int(); stop = a.positional[1].as_int(); }
    if (a.positional.size() == 3) step = a.positional[2].as_int();
    if (step == 0) throw TemplateError("range() arg 3 must not be zero");
    List out;
    // Bounded: a template asking for more is refused rather than allowed to exhaust memory.
    for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
      if (out.size() >= 1000000) throw TemplateError("range(): more than 1,000,000 items");
      out.push_back(Value(i));
      if (__builtin_add_overflow(i, step, &i)) break;   // past INT64's end: past stop too
    }
    return Value::list(std::move(out));
  });
  auto make_dict = [](CallArgs& a, bool ns) {
    Dict d;
    for (const Value& p : a.positional) {
      if (!p.is_dict()) throw TemplateError(std::string(ns ? "namespace" : "dict") + "(): a positional argument must be a mapping");
      for (const auto& [k, v] : p.as_dict().items()) d.set(k, v);
    }
    for (const auto& [k, v] : a.keyword) d.set(k, v);
    return Value::dict(std::move(d), ns);
  };
  g.vars["dict"] = Value::function("dict", [make_dict](Renderer&, CallArgs& a) { return make_dict(a, false); });
  g.vars["namespace"] = Value::function("namespace", [make_dict](Renderer&, CallArgs& a) { return make_dict(a, true); });
  g.vars["raise_exception"] = Value::function("raise_exception", [](Renderer&, CallArgs& a) -> Value {
    throw TemplateError(a.take(0, "message").str());
  });
  g.vars["strftime_now"] = Value::function("strftime_now", [](Renderer& r, CallArgs& a) {
    const std::string fmt = a.take(0, "format").str();
    a.expect_consumed("strftime_now");
    const std::time_t t = r.now();
    std::tm tm{};
    localtime_r(&t, &tm);
    char buf[512];
    const size_t n = std::strftime(buf, sizeof buf, fmt.c_str(), &tm);
    return Value(std::string(buf, n));
  });
}

}  // namespace moraine::jinja
