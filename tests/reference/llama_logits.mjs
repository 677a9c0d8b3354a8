// Oracle for llama_oracle_test: llama.cpp (node-llama-cpp, CPU) logits at every position of a
// token sequence. Run as `node tests/reference/llama_logits.mjs GGUF IDS` with the working
// directory .cache/oracle: the package is imported from there. (Piping this file to
// `node --input-type=module` does not work: node-llama-cpp's binary self-test re-runs the
// process and fails.) KV cache in F32 and no flash attention: the default F16 cache
// alone moves logits by ~7e-3 (measured on qwen3moe_odd), which would hide what we compare.
// Prints JSON {"rows": [[[token, logit], ...], ...]}, one row per position.
import {pathToFileURL} from "node:url";

const {getLlama} = await import(
    new URL("node_modules/node-llama-cpp/dist/index.js", pathToFileURL(process.cwd() + "/")).href);
const [path, idsCsv] = process.argv.slice(2);
const ids = idsCsv.split(",").map(Number);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath: path});
const ctx = await model.createContext({
  contextSize: 256, batchSize: 256, threads: 2, flashAttention: false,
  experimentalKvCacheKeyType: "F32", experimentalKvCacheValueType: "F32",
});
const out = await ctx.getSequence().controlledEvaluate(ids.map(t => [t, {generateNext: {logits: true}}]));
const rows = out.map(o => Array.from(o.next.logits.entries()));
process.stdout.write(JSON.stringify({rows}));
await ctx.dispose();
await model.dispose();
await llama.dispose();
