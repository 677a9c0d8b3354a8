// Renders a template with a JSON context: jinja_render_tool TEMPLATE CONTEXT_JSON [NOW_EPOCH].
// Prints the output, or "ERROR: <message>" and exits 2: for comparing one template by hand with render_oracle.py.
#include <fstream>
#include <iostream>
#include <sstream>

#include "common/jinja/template.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: jinja_render_tool TEMPLATE CONTEXT_JSON [NOW_EPOCH]\n";
    return 1;
  }
  std::ifstream tf(argv[1], std::ios::binary), cf(argv[2], std::ios::binary);
  std::stringstream ts, cs;
  ts << tf.rdbuf();
  cs << cf.rdbuf();
  try {
    moraine::jinja::RenderOptions o;
    if (argc > 3) o.now = static_cast<std::time_t>(std::stoll(argv[3]));
    moraine::jinja::Template t(ts.str());
    std::cout << t.render(nlohmann::ordered_json::parse(cs.str()), o);
  } catch (const std::exception& e) {
    std::cout << "ERROR: " << e.what();
    return 2;
  }
  return 0;
}
