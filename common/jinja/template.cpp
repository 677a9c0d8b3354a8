#include "common/jinja/template.h"

#include "common/jinja/parser.h"
#include "common/jinja/renderer.h"

namespace moraine::jinja {

namespace {

// jinja2 normalises newlines to "\n" and drops one trailing newline (keep_trailing_newline=False).
std::string normalise_source(const std::string& src) {
  std::string out;
  out.reserve(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i] == '\r') {
      out += '\n';
      if (i + 1 < src.size() && src[i + 1] == '\n') ++i;
    } else {
      out += src[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

}  // namespace

Template::Template(const std::string& source) {
  try {
    program_ = std::make_shared<const Program>(parse(normalise_source(source), LexOptions{}));
  } catch (const TemplateError&) {
    throw;
  } catch (const std::exception& e) {  // e.g. a number std::sto* cannot hold: still the template's fault
    throw TemplateError(std::string("template: ") + e.what());
  }
}

std::string Template::render(const nlohmann::ordered_json& context, const RenderOptions& options) const {
  if (!context.is_object()) throw TemplateError("the template's context must be a JSON object");
  Dict d;
  for (auto it = context.begin(); it != context.end(); ++it) d.set(it.key(), Value::from_json(it.value()));
  return render(d, options);
}

std::string Template::render(const Dict& context, const RenderOptions& options) const {
  auto globals = std::make_shared<Frame>();
  add_globals(*globals);
  auto ctx = std::make_shared<Frame>();
  ctx->parent = globals;
  for (const auto& [k, v] : context.items()) ctx->vars[k] = v;
  Renderer r(ctx, options.now);
  try {
    return r.render(*program_);
  } catch (const TemplateError&) {
    throw;
  } catch (const std::exception& e) {
    throw TemplateError(std::string("template: ") + e.what());
  }
}

}  // namespace moraine::jinja
