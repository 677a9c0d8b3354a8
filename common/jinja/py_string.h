// Python str semantics on UTF-8 text: code-point indexing and the str methods templates call.
#pragma once
#include <string>
#include <vector>

#include "common/jinja/value.h"

namespace moraine::jinja {

// The code points of s, each as its UTF-8 bytes (invalid bytes stand alone).
std::vector<std::string> code_points(const std::string& s);
size_t code_point_count(const std::string& s);
bool is_py_space(const std::string& cp);  // str.isspace() for one code point
std::string py_strip(const std::string& s, const Value& chars, bool left, bool right);
List py_split(const std::string& s, const Value& sep, int64_t maxsplit, bool from_right);
std::string py_replace(const std::string& s, const std::string& old, const std::string& repl, int64_t count);
std::string py_upper(const std::string& s);
std::string py_lower(const std::string& s);
std::string py_title(const std::string& s);       // str.title()
std::string py_capitalize(const std::string& s);  // str.capitalize()
List py_splitlines(const std::string& s, bool keepends);
// str.format(*args, **kwargs) for "{}", "{0}", "{name}" fields (a format spec is not supported).
std::string py_format(const std::string& fmt, const CallArgs& args);
// The bound method `name` of a str, or Undefined when str has no such attribute.
Value string_method(const std::string& s, const std::string& name);

}  // namespace moraine::jinja
