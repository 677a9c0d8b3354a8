// The Jinja engine on its own: semantics spot checks (the expected strings are what
// python3-jinja2 3.1.6 renders in render_oracle.py's environment), clear errors naming the
// template line, and bounded work on hostile input.
#include <gtest/gtest.h>

#include <random>

#include "common/jinja/template.h"

namespace {

using moraine::jinja::Template;
using moraine::jinja::TemplateError;
using ojson = nlohmann::ordered_json;

std::string render(const std::string& src, const ojson& ctx = ojson::object()) { return Template(src).render(ctx); }

// The error a template gives, or "" when it renders.
std::string error_of(const std::string& src, const ojson& ctx = ojson::object()) {
  try {
    Template(src).render(ctx);
  } catch (const TemplateError& e) {
    return e.what();
  }
  return "";
}

struct Case {
  const char* source;
  const char* expected;
};

const Case kCases[] = {
    {"{% for x in [1,2] %}{% if loop.first %}{% set y = 5 %}{% endif %}[{{ y }}]{% endfor %}",
     "[5][]"},
    {"{% set ns = namespace(n=0) %}{% for x in range(5) %}{% if x is odd %}{% set ns.n = ns.n + x %}{% endif %}{% endfor %}{{ ns.n }}",
     "4"},
    {"{{ 'a' ~ none ~ 1.0 ~ 1e20 ~ 1e-5 ~ [1,'a',\"b'\",none,true] ~ {'k':1.5} }}",
     "aNone1.01e+201e-05[1, 'a', \"b'\", None, True]{'k': 1.5}"},
    {"{{ 'abc'[::-1] }} {{ [1,2,3][1:] }} {{ 'a b  c'.split() }} {{ 'a,b,,c'.split(',', 1) }} {{ '日本語'[1] }}",
     "cba [2, 3] ['a', 'b', 'c'] ['a', 'b,,c'] 本"},
    {"{% macro f(a, b=2) %}{{a}}{{b}}{{ varargs }}{{ kwargs }}{% endmacro %}{{ f(1) }}|{{ f(1, 3, 4, z=5) }}|{{ f(b=7, a=0) }}",
     "12(){}|13(4,){'z': 5}|07(){}"},
    {"  {% if true %}\n  x\n  {% endif %}\n{{- 1 }}  {#- c -#}  {{ 2 }}\n",
     "  x\n12"},
    {"{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 0.1 + 0.2 }}",
     "3 -4 2 3.5 1024 0.30000000000000004"},
    {"{{ {'b':1,'a':2}|dictsort }} {{ [3,1,2]|sort(reverse=true) }} {{ 'hello wORLD-x'|title }} {{ [1,2]|join(', ') }}",
     "[('a', 2), ('b', 1)] [3, 2, 1] Hello World-X 1, 2"},
    {"{{ {'a': [1, {'b': 'é\"\\n'}], 'c': none}|tojson }}|{{ {'a': [1, 2], 'e': {}}|tojson(indent=2) }}",
     "{\"a\": [1, {\"b\": \"é\\\"\\n\"}], \"c\": null}|{\n  \"a\": [\n    1,\n    2\n  ],\n  \"e\": {}\n}"},
    {"{% for k, v in {'x': 1, 'y': 2}.items() %}{{ loop.index }}{{ k }}={{ v }}{{ ',' if not loop.last }}{% endfor %}",
     "1x=1,2y=2"},
    {"{{ ' ab '.strip() }}|{{ 'xxabxx'.lstrip('x') }}|{{ 'Hello'.upper() }}|{{ 'a-b'.replace('-', '+') }}|{{ 'abc'.startswith(('x', 'a')) }}",
     "ab|abxx|HELLO|a+b|True"},
    {"{{ x is defined }} {{ none is none }} {{ 'a' is string }} {{ {} is mapping }} {{ [] is iterable }} {{ 3 is divisibleby 3 }} {{ 'a' in 'cat' }} {{ 2 not in [1] }}",
     "False True True True True True True True"},
    {"{% for x in [1, 2, 3, 4] if x > 1 %}{% if x == 3 %}{% continue %}{% endif %}{{ x }}{{ loop.length }}{% if x == 4 %}{% break %}{% endif %}{% else %}none{% endfor %}",
     "2343"},
    {"{% set b %}inner {{ 1 + 1 }}{% endset %}[{{ b }}]{{ b|length }}",
     "[inner 2]7"},
    {"{{ [1, 2, 3]|selectattr('x', 'defined')|list }} {{ [{'n': 'a', 'k': 1}, {'n': 'b'}]|selectattr('k')|map(attribute='n')|join }} {{ [3, 1]|min }} {{ ['b', 'A']|max }}",
     "[] a 1 b"},
    {"{{ 'line1\nline2\n\nline3'|indent(2) }}|{{ 'x'|indent(2, true) }}",
     "line1\n  line2\n\n  line3|  x"},
    {"{{ x|default('d') }} {{ ''|default('e', true) }} {{ none|default('f') }} {{ [1,2,3]|first }} {{ [1,2,3]|last }} {{ '3'|int + 1 }} {{ 'x'|int }} {{ 2|float }}",
     "d e None 1 3 4 0 2.0"},
    {"{{ '{} and {name}'.format(1, name='n') }} {{ '%s-%s' % ('a', 1) }} {{ (1, 2) }} {{ (1,) }} {{ range(3)|list }}",
     "1 and n a-1 (1, 2) (1,) [0, 1, 2]"},
    {"{% macro outer() %}[{{ caller() }}]{% endmacro %}{% call outer() %}body{% endcall %}",
     "[body]"},
    {"{% filter upper %}abc{% endfilter %}{{ 'Tom & \"J\"'|e }}{{ 'a'|safe + '<b>' }}",
     "ABCTom &amp; &#34;J&#34;a&lt;b&gt;"}
};

TEST(JinjaEngine, RendersLikePythonJinja2) {
  for (const Case& c : kCases) EXPECT_EQ(render(c.source), c.expected) << c.source;
}

TEST(JinjaEngine, ContextValuesKeepTheirOrderAndTypes) {
  const ojson ctx = ojson::parse(R"({"d": {"z": 1, "a": [true, null, 2.5, "s"]}})");
  EXPECT_EQ(render("{{ d|tojson }}|{{ d }}|{% for k in d %}{{ k }}{% endfor %}", ctx),
            R"({"z": 1, "a": [true, null, 2.5, "s"]}|{'z': 1, 'a': [True, None, 2.5, 's']}|za)");
}

TEST(JinjaEngine, SyntaxErrorsNameTheLine) {
  EXPECT_NE(error_of("line one\n{% if %}x{% endif %}").find("template line 2"), std::string::npos);
  EXPECT_NE(error_of("a\nb\n{% for x in y %}").find("template line 3"), std::string::npos);
  EXPECT_NE(error_of("{% endfor %}").find("unexpected 'endfor'"), std::string::npos);
  EXPECT_NE(error_of("{{ 'unterminated }}").find("unterminated string"), std::string::npos);
  EXPECT_NE(error_of("x\n{{ a + }}").find("template line 2"), std::string::npos);
  EXPECT_NE(error_of("{% frobnicate %}").find("unknown tag 'frobnicate'"), std::string::npos);
  EXPECT_NE(error_of("{% break %}").find("outside a for loop"), std::string::npos);
  EXPECT_NE(error_of("{# never closed").find("unterminated comment"), std::string::npos);
}

TEST(JinjaEngine, RuntimeErrorsNameTheLine) {
  const std::string e = error_of("ok\n\n{{ raise_exception('Only user and assistant roles!') }}");
  EXPECT_NE(e.find("template line 3"), std::string::npos) << e;
  EXPECT_NE(e.find("Only user and assistant roles!"), std::string::npos) << e;
  EXPECT_NE(error_of("{{ x.y }}").find("'x' is undefined"), std::string::npos);
  EXPECT_NE(error_of("{{ [1].append(2) }}").find("unsafe"), std::string::npos);
  EXPECT_NE(error_of("{{ 1 + 'a' }}").find("unsupported operand"), std::string::npos);
  EXPECT_NE(error_of("{{ 1 // 0 }}").find("division"), std::string::npos);
  EXPECT_NE(error_of("{{ x|nosuchfilter }}").find("No filter named 'nosuchfilter'"), std::string::npos);
  EXPECT_NE(error_of("{{ (tools|map('upper'))|length }}", {{"tools", ojson::array()}}).find("no len()"), std::string::npos);
  // Undefined prints as nothing and is falsy, as jinja2's default Undefined.
  EXPECT_EQ(render("[{{ nothing }}]{{ nothing|length }}{% if not nothing %}f{% endif %}{% for x in nothing %}x{% endfor %}"), "[]0f");
}

TEST(JinjaEngine, DeepNestingIsRefusedNotRecursed) {
  const std::string deep_expr = "{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}";
  EXPECT_NE(error_of(deep_expr).find("nests deeper"), std::string::npos);
  std::string deep_blocks;
  for (int i = 0; i < 3000; ++i) deep_blocks += "{% if true %}";
  EXPECT_NE(error_of(deep_blocks).find("nests deeper"), std::string::npos);
  EXPECT_NE(error_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").find("calls nest deeper"), std::string::npos);
  std::string deep_json;
  for (int i = 0; i < 100000; ++i) deep_json += "[";
  for (int i = 0; i < 100000; ++i) deep_json += "]";
  ojson ctx = {{"v", ojson::parse(deep_json)}};
  EXPECT_NE(error_of("{{ v }}", ctx).find("nests deeper"), std::string::npos);
  // A value nested by the template itself is bounded when written out.
  EXPECT_NE(error_of("{% set ns = namespace(v=[]) %}{% for i in range(2000) %}{% set ns.v = [ns.v] %}{% endfor %}{{ ns.v|tojson }}")
                .find("nests deeper"),
            std::string::npos);
  EXPECT_NE(error_of("{{ range(100000000)|length }}").find("1,000,000"), std::string::npos);
  EXPECT_NE(error_of("{{ ('x' * 1000000000000)|length }}").find("repetition"), std::string::npos);
  EXPECT_NE(error_of("{{ '{99999999999999999999999}'.format(1) }}"), "");
  EXPECT_NE(error_of("{{ x.99999999999999999999999 }}", {{"x", ojson::array()}}), "");
}

TEST(JinjaEngine, HugeInputRendersInFull) {
  const std::string big(20u << 20, 'x');
  const std::string out = render("{% for m in messages %}<{{ m.content }}>{% endfor %}",
                                 {{"messages", ojson::array({{{"content", big}}, {{"content", big}}})}});
  EXPECT_EQ(out.size(), 2 * big.size() + 4);
}

TEST(JinjaEngine, GarbageNeverCrashes) {
  // Every prefix of a real-looking template either renders or gives a TemplateError.
  const std::string src =
      "{%- for m in messages %}{{- '<|' + m.role ~ '|>' }}{% if m.content is string %}{{ m.content|trim }}"
      "{%- elif m.content %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}{% endfor -%}"
      "{{ {'a': [1, 2][::-1], 'b': (1, 2)}|tojson(indent=2) }}";
  const ojson ctx = {{"messages", ojson::array({{{"role", "user"}, {"content", " hi "}}})}};
  for (size_t n = 0; n <= src.size(); ++n) {
    try {
      Template(src.substr(0, n)).render(ctx);
    } catch (const TemplateError&) {
    }
  }
  // Random edits (fixed seed): tag pieces inserted, bytes erased or overwritten.
  std::mt19937 rng(27);
  const char* pieces[] = {"{%", "%}", "{{", "}}", "{#", "#}", "-", "(", ")", "[", "]", "'", "|", ".", " if ", "endfor", "\n", "**"};
  for (int it = 0; it < 3000; ++it) {
    std::string s = src;
    for (int m = 0; m < 1 + static_cast<int>(rng() % 3); ++m) {
      const size_t pos = rng() % (s.size() + 1);
      const unsigned op = rng() % 3;
      if (op == 0) s.insert(pos, pieces[rng() % (sizeof pieces / sizeof *pieces)]);
      else if (op == 1) s.erase(pos, rng() % 8);
      else if (pos < s.size()) s[pos] = static_cast<char>(rng() % 256);
    }
    try {
      Template(s).render(ctx);
    } catch (const TemplateError&) {
    }
  }
  EXPECT_EQ(render(src, ctx), "<|user|>hi{\n  \"a\": [\n    2,\n    1\n  ],\n  \"b\": [\n    1,\n    2\n  ]\n}");
}

}  // namespace
