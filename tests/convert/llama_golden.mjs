// Oracle side of the converter tests: llama.cpp (node-llama-cpp on CPU) loads each GGUF that
// moraine-convert wrote, evaluates the golden prompt and continues it greedily.
//   node llama_golden.mjs ORACLE_DIR JOB.json
// JOB.json: [{"gguf": PATH, "tokens": [ids...], "n_greedy": N, "logits_out": PATH,
//             "texts": [strings to tokenize, special tokens parsed]}, ...]
// Writes logits_out as float32 [n_tokens][n_vocab] (the logits after each prompt position) and
// prints a JSON report {gguf: {loaded, error, n_vocab, greedy, tokenized, tensors}} on stdout.
// node-llama-cpp is resolved from ORACLE_DIR (.cache/oracle) because this file lives outside
// that folder's node_modules. One node start serves every model: starting llama.cpp costs more
// than evaluating these tiny models.
import fs from "node:fs";
import path from "node:path";
import {createRequire} from "node:module";
import {pathToFileURL} from "node:url";

const [oracleDir, jobPath] = process.argv.slice(2);
const oracleRequire = createRequire(path.join(path.resolve(oracleDir), "package.json"));
const {getLlama} = await import(pathToFileURL(oracleRequire.resolve("node-llama-cpp")).href);
const jobs = JSON.parse(fs.readFileSync(jobPath, "utf8"));
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});

function argmax(logitsMap) {
  let best = -1, bestV = -Infinity;
  for (const [t, v] of logitsMap) if (v > bestV) { bestV = v; best = t; }
  return best;
}

const report = {};
for (const job of jobs) {
  const entry = {loaded: false};
  report[job.gguf] = entry;
  try {
    const model = await llama.loadModel({modelPath: job.gguf});
    entry.loaded = true;
    entry.tokenized = (job.texts ?? []).map((t) => Array.from(model.tokenize(t, true)));
    entry.tensors = Object.fromEntries(
        (model.fileInfo.tensorInfo ?? []).map((t) => [t.name, t.ggmlType]));
    // F32 KV cache and no flash attention: llama.cpp's plainest, most exact CPU path.
    const n = job.tokens.length + job.n_greedy;
    const context = await model.createContext({
      contextSize: Math.max(256, n), batchSize: Math.max(256, n), flashAttention: false,
      experimentalKvCacheKeyType: "F32", experimentalKvCacheValueType: "F32", threads: 2});
    const sequence = context.getSequence();
    const results = await sequence.controlledEvaluate(
        job.tokens.map((t) => [t, {generateNext: {logits: true}}]));
    const nVocab = results[0].next.logits.size;
    const logits = new Float32Array(job.tokens.length * nVocab);
    results.forEach((r, i) => {
      for (const [token, value] of r.next.logits) logits[i * nVocab + token] = value;
    });
    fs.writeFileSync(job.logits_out, Buffer.from(logits.buffer));
    entry.n_vocab = nVocab;
    // Greedy continuation, one token at a time through the KV cache / recurrent state.
    const greedy = [argmax(results[results.length - 1].next.logits)];
    while (greedy.length < job.n_greedy) {
      const [r] = await sequence.controlledEvaluate([[greedy[greedy.length - 1], {generateNext: {logits: true}}]]);
      greedy.push(argmax(r.next.logits));
    }
    entry.greedy = greedy;
    await context.dispose();
    await model.dispose();
  } catch (e) {
    entry.error = String(e && e.message ? e.message : e);
  }
}
process.stdout.write(JSON.stringify(report));
