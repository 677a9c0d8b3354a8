// A Jinja2 template engine for chat templates: renders byte-for-byte what python3-jinja2 renders
// in Hugging Face's environment (ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks,
// loopcontrols; globals raise_exception and strftime_now; tojson as json.dumps with
// ensure_ascii=False; {% generation %} blocks rendered as their body).
//
//   moraine::jinja::Template t(source);          // parses; throws TemplateError (with the line)
//   std::string s = t.render({{"messages", ...}, {"add_generation_prompt", true}});
//
// A Template is immutable after construction: render may run on many threads at once. Bad
// templates and bad input give a TemplateError naming the template line, never a crash:
// nesting is bounded (kMaxParseDepth, kMaxCallDepth, 256 levels of input JSON).
#pragma once
#include <ctime>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "common/jinja/value.h"

namespace moraine::jinja {

struct Program;

struct RenderOptions {
  std::optional<std::time_t> now;  // what strftime_now formats (local time); unset: the clock
};

class Template {
 public:
  explicit Template(const std::string& source);
  // context: a JSON object whose members become the template's variables.
  // An ordered_json keeps the members' order, which tojson and items() show.
  std::string render(const nlohmann::ordered_json& context, const RenderOptions& options = {}) const;
  // The same, with values already converted (e.g. to add callables).
  std::string render(const Dict& context, const RenderOptions& options = {}) const;

 private:
  std::shared_ptr<const Program> program_;
};

}  // namespace moraine::jinja
