// Oracle side of the interop tests: loads GGUF files with llama.cpp (node-llama-cpp on CPU) and
// writes, per model, the full logits of tokens 0..n_tokens-1 as float32 [n_tokens][n_vocab] to
// OUT_DIR/<file name>.logits, plus OUT_DIR/report.json describing what llama.cpp saw.
//   node llama_logits.mjs ORACLE_DIR OUT_DIR N_TOKENS MODEL.gguf...
// node-llama-cpp is resolved from ORACLE_DIR (.cache/oracle, made by tests/oracle/setup) rather
// than by a bare import, because this file lives outside that folder's node_modules and stdin
// modules cannot be used: node-llama-cpp forks a test process with the parent's node flags.
// One node start serves every model: starting llama.cpp costs more than evaluating our tiny models.
import fs from "node:fs";
import path from "node:path";
import {createRequire} from "node:module";
import {pathToFileURL} from "node:url";

const [oracleDir, outDir, nTokensArg, ...models] = process.argv.slice(2);
const oracleRequire = createRequire(path.join(path.resolve(oracleDir), "package.json"));
const {getLlama} = await import(pathToFileURL(oracleRequire.resolve("node-llama-cpp")).href);
const nTokens = Number(nTokensArg);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const report = {};
for (const modelPath of models) {
  const entry = {loaded: false};
  report[modelPath] = entry;
  try {
    const model = await llama.loadModel({modelPath});
    entry.loaded = true;
    entry.type_description = model.typeDescription;
    entry.tensors = Object.fromEntries(
        (model.fileInfo.tensorInfo ?? []).map((t) => [t.name, t.ggmlType]));
    if (nTokens > 0) {
      // Attention must not mix positions in a way that matters: the layer weights are zero, so
      // the attention output is zero whatever it attends to. F32 KV and no flash attention keep
      // llama.cpp on its plainest path.
      const context = await model.createContext({
        contextSize: Math.max(256, nTokens), batchSize: Math.max(256, nTokens),
        flashAttention: false, experimentalKvCacheKeyType: "F32",
        experimentalKvCacheValueType: "F32", threads: 2});
      const sequence = context.getSequence();
      const input = [];
      for (let t = 0; t < nTokens; t++) input.push([t, {generateNext: {logits: true}}]);
      const results = await sequence.controlledEvaluate(input);
      const nVocab = results[0].next.logits.size;
      const logits = new Float32Array(nTokens * nVocab);
      results.forEach((r, i) => {
        for (const [token, value] of r.next.logits) logits[i * nVocab + token] = value;
      });
      fs.writeFileSync(path.join(outDir, path.basename(modelPath) + ".logits"),
                       Buffer.from(logits.buffer));
      entry.n_vocab = nVocab;
      await context.dispose();
    }
    await model.dispose();
  } catch (e) {
    entry.error = String(e && e.message ? e.message : e);
  }
}
fs.writeFileSync(path.join(outDir, "report.json"), JSON.stringify(report, null, 1));
