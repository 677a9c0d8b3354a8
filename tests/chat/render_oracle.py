#!/usr/bin/env python3
"""Renders chat templates with python3-jinja2 in Hugging Face's environment (what
transformers' apply_chat_template builds): the expected strings for chat_template_oracle_test.

usage: render_oracle.py CASES_JSON OUT_JSON
CASES_JSON: [{"template": path, "context": {...}, "now": epoch}], OUT_JSON: one string per case,
the rendered text or "ERROR: <message>".
"""
import json
import sys
from datetime import datetime

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class GenerationBlocks(Extension):
    """{% generation %}...{% endgeneration %} renders its body (transformers' AssistantTracker when not tracking)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def environment(now):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.fromtimestamp(now).strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def main():
    cases = json.load(open(sys.argv[1], encoding="utf-8"))
    out = []
    compiled = {}
    for case in cases:
        try:
            key = (case["template"], case["now"])
            if key not in compiled:
                src = open(case["template"], encoding="utf-8").read()
                compiled[key] = environment(case["now"]).from_string(src)
            out.append(compiled[key].render(**case["context"]))
        except Exception as e:  # noqa: BLE001 -- every failure is an expected "ERROR" string
            out.append("ERROR: " + type(e).__name__ + ": " + str(e))
    json.dump(out, open(sys.argv[2], "w", encoding="utf-8"), ensure_ascii=False)


if __name__ == "__main__":
    main()
