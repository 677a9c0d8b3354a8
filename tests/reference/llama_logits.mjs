// Oracle for llama_oracle_test: llama.cpp (node-llama-cpp, CPU) logits at every position of token
// sequences, for several models in one process (starting node and loading the backend is most
// of the cost). Run as `node tests/reference/llama_logits.mjs JOBS.json` with the working
// directory .cache/oracle: the package is imported from there. (Piping this file to
// `node --input-type=module` does not work: node-llama-cpp's binary self-test re-runs the
// process and fails.) JOBS.json is [{"path": GGUF, "ids": [token, ...]}, ...].
// KV cache in F32 and no flash attention: the default F16 cache alone moves logits by ~7e-3
// (measured on qwen3moe_odd), which would hide what we compare.
// Prints JSON {"results": [{"rows": [[logit, ...], ...]} | {"error": text}, ...]}, one per job,
// one row per position (all n_vocab logits, in token order).
import {readFileSync} from "node:fs";
import {pathToFileURL} from "node:url";

const {getLlama} = await import(
    new URL("node_modules/node-llama-cpp/dist/index.js", pathToFileURL(process.cwd() + "/")).href);
const jobs = JSON.parse(readFileSync(process.argv[2], "utf8"));
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const results = [];
for (const job of jobs) {
  try {
    const model = await llama.loadModel({modelPath: job.path});
    const ctx = await model.createContext({
      contextSize: 256, batchSize: 256, threads: 2, flashAttention: false,
      experimentalKvCacheKeyType: "F32", experimentalKvCacheValueType: "F32",
    });
    const out = await ctx.getSequence().controlledEvaluate(
        job.ids.map(t => [t, {generateNext: {logits: true}}]));
    // logits is a Map token -> logit; a token it lacks stays null, which the test rejects.
    results.push({rows: out.map(o => {
      const row = [];
      for (const [t, v] of o.next.logits.entries()) row[t] = v;
      return Array.from(row, v => v ?? null);
    })});
    await ctx.dispose();
    await model.dispose();
  } catch (e) {
    results.push({error: String(e?.stack ?? e)});
  }
}
process.stdout.write(JSON.stringify({results}));
await llama.dispose();
