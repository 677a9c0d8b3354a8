#include "common/jinja/py_string.h"

#include <algorithm>
#include <cctype>

namespace moraine::jinja {

std::vector<std::string> code_points(const std::string& s) {
  std::vector<std::string> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (i + n > s.size()) n = 1;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) { n = 1; break; }
    }
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

size_t code_point_count(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xc0) != 0x80;
  return n;
}

bool is_py_space(const std::string& cp) {
  if (cp.size() == 1) {
    const char c = cp[0];
    return c == ' ' || (c >= '\t' && c <= '\r') || (c >= '\x1c' && c <= '\x1f');
  }
  static const char* wide[] = {"\xc2\x85", "\xc2\xa0", "\xe1\x9a\x80", "\xe2\x80\xa8", "\xe2\x80\xa9", "\xe2\x80\xaf",
                               "\xe2\x81\x9f", "\xe3\x80\x80"};
  for (const char* w : wide) if (cp == w) return true;
  // U+2000..U+200A
  return cp.size() == 3 && cp[0] == '\xe2' && cp[1] == '\x80' && static_cast<unsigned char>(cp[2]) >= 0x80 &&
         static_cast<unsigned char>(cp[2]) <= 0x8a;
}

std::string py_strip(const std::string& s, const Value& chars, bool left, bool right) {
  std::vector<std::string> cps = code_points(s);
  std::vector<std::string> set;
  const bool ws = chars.is_none() || chars.is_undefined();
  if (!ws) {
    if (!chars.is_string()) throw TemplateError("strip arg must be None or str, not " + chars.type_name());
    set = code_points(chars.as_string());
  }
  auto strip_it = [&](const std::string& cp) {
    return ws ? is_py_space(cp) : std::find(set.begin(), set.end(), cp) != set.end();
  };
  size_t b = 0, e = cps.size();
  if (left) while (b < e && strip_it(cps[b])) ++b;
  if (right) while (e > b && strip_it(cps[e - 1])) --e;
  std::string out;
  for (size_t i = b; i < e; ++i) out += cps[i];
  return out;
}

List py_split(const std::string& s, const Value& sep, int64_t maxsplit, bool from_right) {
  List out;
  if (sep.is_none() || sep.is_undefined()) {
    std::vector<std::string> cps = code_points(s);
    std::vector<std::string> words;
    if (from_right) std::reverse(cps.begin(), cps.end());
    size_t i = 0;
    int64_t splits = 0;
    while (i < cps.size()) {
      while (i < cps.size() && is_py_space(cps[i])) ++i;
      if (i >= cps.size()) break;
      std::string w;
      if (maxsplit >= 0 && splits >= maxsplit) {
        size_t e = cps.size();
        while (e > i && is_py_space(cps[e - 1])) --e;
        for (; i < e; ++i) w += cps[i];
        words.push_back(std::move(w));
        break;
      }
      while (i < cps.size() && !is_py_space(cps[i])) w += cps[i++];
      words.push_back(std::move(w));
      ++splits;
    }
    if (from_right) {
      std::reverse(words.begin(), words.end());
      for (std::string& w : words) {
        std::vector<std::string> c = code_points(w);
        std::reverse(c.begin(), c.end());
        w.clear();
        for (auto& x : c) w += x;
      }
    }
    for (std::string& w : words) out.push_back(Value(std::move(w)));
    return out;
  }
  if (!sep.is_string()) throw TemplateError("must be str or None, not " + sep.type_name());
  const std::string& d = sep.as_string();
  if (d.empty()) throw TemplateError("empty separator");
  std::vector<std::string> parts;
  if (!from_right) {
    size_t pos = 0;
    int64_t splits = 0;
    while (maxsplit < 0 || splits < maxsplit) {
      const size_t at = s.find(d, pos);
      if (at == std::string::npos) break;
      parts.push_back(s.substr(pos, at - pos));
      pos = at + d.size();
      ++splits;
    }
    parts.push_back(s.substr(pos));
  } else {
    size_t end = s.size();
    int64_t splits = 0;
    while (maxsplit < 0 || splits < maxsplit) {
      if (end < d.size()) break;
      const size_t at = s.rfind(d, end - d.size());
      if (at == std::string::npos) break;
      parts.push_back(s.substr(at + d.size(), end - at - d.size()));
      end = at;
      ++splits;
    }
    parts.push_back(s.substr(0, end));
    std::reverse(parts.begin(), parts.end());
  }
  for (std::string& p : parts) out.push_back(Value(std::move(p)));
  return out;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& repl, int64_t count) {
  std::string out;
  int64_t n = 0;
  if (old.empty()) {
    std::vector<std::string> cps = code_points(s);
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || n < count) { out += repl; ++n; }
      if (i < cps.size()) out += cps[i];
    }
    return out;
  }
  size_t pos = 0;
  while (count < 0 || n < count) {
    const size_t at = s.find(old, pos);
    if (at == std::string::npos) break;
    out.append(s, pos, at - pos);
    out += repl;
    pos = at + old.size();
    ++n;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

std::string py_upper(const std::string& s) {
  std::string o = s;
  for (char& c : o) if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
  return o;
}

std::string py_lower(const std::string& s) {
  std::string o = s;
  for (char& c : o) if (c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
  return o;
}

std::string py_title(const std::string& s) {
  std::string o = s;
  bool prev_cased = false;
  for (char& c : o) {
    const bool lower = c >= 'a' && c <= 'z', upper = c >= 'A' && c <= 'Z';
    if (lower && !prev_cased) c = static_cast<char>(c - 32);
    else if (upper && prev_cased) c = static_cast<char>(c + 32);
    prev_cased = lower || upper || (static_cast<unsigned char>(c) >= 0x80 && prev_cased);
  }
  return o;
}

std::string py_capitalize(const std::string& s) {
  std::string o = py_lower(s);
  if (!o.empty() && o[0] >= 'a' && o[0] <= 'z') o[0] = static_cast<char>(o[0] - 32);
  return o;
}

List py_splitlines(const std::string& s, bool keepends) {
  List out;
  size_t start = 0, i = 0;
  while (i < s.size()) {
    const char c = s[i];
    size_t brk = 0;
    if (c == '\r' && i + 1 < s.size() && s[i + 1] == '\n') brk = 2;
    else if (c == '\n' || c == '\r' || c == '\v' || c == '\f' || (c >= '\x1c' && c <= '\x1e')) brk = 1;
    else if (s.compare(i, 2, "\xc2\x85") == 0) brk = 2;
    else if (s.compare(i, 3, "\xe2\x80\xa8") == 0 || s.compare(i, 3, "\xe2\x80\xa9") == 0) brk = 3;
    if (brk) {
      out.push_back(Value(s.substr(start, (keepends ? i + brk : i) - start)));
      i += brk;
      start = i;
    } else {
      ++i;
    }
  }
  if (start < s.size()) out.push_back(Value(s.substr(start)));
  return out;
}

std::string py_format(const std::string& fmt, const CallArgs& args) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    const char c = fmt[i];
    if (c == '{' && i + 1 < fmt.size() && fmt[i + 1] == '{') { out += '{'; ++i; continue; }
    if (c == '}' && i + 1 < fmt.size() && fmt[i + 1] == '}') { out += '}'; ++i; continue; }
    if (c == '}') throw TemplateError("Single '}' encountered in format string");
    if (c != '{') { out += c; continue; }
    const size_t close = fmt.find('}', i);
    if (close == std::string::npos) throw TemplateError("Single '{' encountered in format string");
    std::string field = fmt.substr(i + 1, close - i - 1);
    if (field.find(':') != std::string::npos || field.find('!') != std::string::npos)
      throw TemplateError("str.format: format specs and conversions are not supported: {" + field + "}");
    const Value* v = nullptr;
    if (field.empty() || std::all_of(field.begin(), field.end(), [](char d) { return std::isdigit(static_cast<unsigned char>(d)); })) {
      const size_t idx = field.empty() ? auto_index++ : std::stoul(field);
      if (idx >= args.positional.size()) throw TemplateError("Replacement index " + std::to_string(idx) + " out of range for positional args tuple");
      v = &args.positional[idx];
    } else {
      for (const auto& [k, val] : args.keyword) if (k == field) v = &val;
      if (!v) throw TemplateError("str.format: no argument named '" + field + "'");
    }
    out += v->str();
    i = close;
  }
  return out;
}

}  // namespace moraine::jinja
