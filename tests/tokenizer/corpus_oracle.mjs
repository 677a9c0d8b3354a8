// Oracle for the tokenizer corpus test: tokenizes every string of a JSON corpus file with
// node-llama-cpp (llama.cpp's tokenizer) for each vocabulary given, with special-token parsing
// off and on, and writes one JSON object to OUT.json:
// {vocab_path: {plain: [[ids]...], special: [[ids]...]}}. (A file, not stdout: process.exit can
// cut a large write to a pipe short.)
//
// Run from .cache/oracle: node-llama-cpp is imported from the working directory's node_modules
// (this file lives in tests/, where module resolution would not find it).
//   cd .cache/oracle && node tests/tokenizer/corpus_oracle.mjs OUT.json CORPUS.json VOCAB.gguf...
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const { getLlama } = await import(
  pathToFileURL(path.join(process.cwd(), "node_modules/node-llama-cpp/dist/index.js")).href);
const [outPath, corpusPath, ...vocabs] = process.argv.slice(2);
const corpus = JSON.parse(fs.readFileSync(corpusPath, "utf8"));
const llama = await getLlama({ gpu: false, build: "never", logLevel: "error" });
const result = {};
for (const vocab of vocabs) {
  const model = await llama.loadModel({ modelPath: vocab, vocabOnly: true });
  result[vocab] = {
    plain: corpus.map((text) => Array.from(model.tokenize(text, false))),
    special: corpus.map((text) => Array.from(model.tokenize(text, true))),
  };
  await model.dispose();
}
fs.writeFileSync(outPath, JSON.stringify(result));
process.exit(0);
