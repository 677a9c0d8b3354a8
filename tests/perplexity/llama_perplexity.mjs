// Oracle for perplexity_test: llama.cpp (node-llama-cpp, CPU) tokenizes the text and evaluates it
// in chunks as llama-perplexity does, and this script computes, in double from llama.cpp's full
// logits, each file's perplexity and, for pairs of files, KL(base || model), top-1 agreement and
// the perplexity difference. Nothing is shared with moraine-perplexity but the definitions: the
// text with one trailing newline dropped, tokenized whole (BOS first where the vocabulary adds
// one), non-overlapping chunks of `ctx` tokens (first token BOS where the vocabulary adds one),
// each from an empty cache, positions ctx/2 .. ctx-2 scored against the next token.
// Run as `node tests/perplexity/llama_perplexity.mjs JOB.json` in .cache/oracle. JOB.json is
// {"text": PATH, "ctx": N, "files": [GGUF, ...], "pairs": [[model, base], ...]} (indices into
// files). F32 KV cache, no flash attention (as the other oracle scripts: the F16 cache alone
// moves these models' logits by ~7e-3). Prints JSON {"files": [{n_tokens, n_chunks, count, ppl,
// ppl_error, max_abs_logit (over the scored rows)}], "pairs": [{ppl, base_ppl, delta_ppl, delta_ppl_error, kl, kl_error, top1,
// top1_error}]} or {"error": text}.
import {readFileSync} from "node:fs";
import {pathToFileURL} from "node:url";

const {getLlama} = await import(
    new URL("node_modules/node-llama-cpp/dist/index.js", pathToFileURL(process.cwd() + "/")).href);
const job = JSON.parse(readFileSync(process.argv[2], "utf8"));
let text = readFileSync(job.text, "utf8");
if (text.endsWith("\n")) text = text.slice(0, -1);

// Mean and standard error of the mean from sums over n samples.
function meanAndError(sum, sum2, n) {
  const mean = sum / n, variance = sum2 / n - mean * mean;
  return [mean, n > 1 && variance > 0 ? Math.sqrt(variance / (n - 1)) : 0];
}

// log softmax of a row of logits, in double.
function logSoftmax(row) {
  let max = -Infinity;
  for (const z of row) max = Math.max(max, z);
  let sum = 0;
  for (const z of row) sum += Math.exp(z - max);
  const shift = max + Math.log(sum);
  return Float64Array.from(row, z => z - shift);
}

function argmax(row) {
  let best = 0;
  for (let i = 1; i < row.length; i++) if (row[i] > row[best]) best = i;
  return best;
}

// Every scored row's log-probabilities and the token it predicts, for one file.
async function scoredRows(llama, path) {
  const model = await llama.loadModel({modelPath: path});
  const ctx = await model.createContext({
    contextSize: job.ctx, batchSize: job.ctx, threads: 2, flashAttention: false,
    experimentalKvCacheKeyType: "F32", experimentalKvCacheValueType: "F32",
  });
  let tokens = model.tokenize(text, false);
  const bos = model.tokens.shouldPrependBosToken ? model.tokens.bos : null;
  if (bos != null) tokens = [bos, ...tokens];
  const n = job.ctx, first = Math.floor(n / 2), nChunks = Math.floor(tokens.length / n);
  const rows = [], targets = [];
  const seq = ctx.getSequence();
  for (let c = 0; c < nChunks; c++) {
    const chunk = tokens.slice(c * n, (c + 1) * n);
    if (bos != null) chunk[0] = bos;
    await seq.clearHistory();
    const input = chunk.slice(0, n - 1).map((t, i) => i >= first ? [t, {generateNext: {logits: true}}] : t);
    const out = await seq.controlledEvaluate(input);
    for (let i = first; i < n - 1; i++) {
      const logits = out[i].next.logits;   // a Map token -> logit, every token of the vocabulary
      const row = new Array(logits.size);
      for (const [t, v] of logits.entries()) row[t] = v;
      if (row.length !== logits.size || row.some(v => v === undefined))
        throw new Error(`${path}: position ${i} lacks logits`);
      rows.push(row);
      targets.push(chunk[i + 1]);
    }
  }
  await ctx.dispose();
  await model.dispose();
  return {nTokens: tokens.length, nChunks, rows, targets};
}

const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
try {
  const files = [];
  for (const path of job.files) files.push(await scoredRows(llama, path));
  const logProbs = files.map(f => f.rows.map(logSoftmax));
  const result = {files: [], pairs: []};
  files.forEach((f, k) => {
    let sum = 0, sum2 = 0;
    f.targets.forEach((t, i) => {
      const nll = -logProbs[k][i][t];
      sum += nll;
      sum2 += nll * nll;
    });
    const [mean, err] = meanAndError(sum, sum2, f.targets.length);
    let maxAbs = 0;
    for (const row of f.rows) for (const z of row) maxAbs = Math.max(maxAbs, Math.abs(z));
    result.files.push({n_tokens: f.nTokens, n_chunks: f.nChunks, count: f.targets.length,
                       ppl: Math.exp(mean), ppl_error: Math.exp(mean) * err, max_abs_logit: maxAbs});
  });
  for (const [m, b] of job.pairs) {
    const q = logProbs[m], p = logProbs[b], targets = files[m].targets, n = targets.length;
    let sq = 0, sq2 = 0, sb = 0, sb2 = 0, sqb = 0, skl = 0, skl2 = 0, same = 0;
    for (let i = 0; i < n; i++) {
      const nq = -q[i][targets[i]], nb = -p[i][targets[i]];
      sq += nq; sq2 += nq * nq; sb += nb; sb2 += nb * nb; sqb += nq * nb;
      let kl = 0;
      for (let v = 0; v < p[i].length; v++) kl += Math.exp(p[i][v]) * (p[i][v] - q[i][v]);
      skl += kl; skl2 += kl * kl;
      if (argmax(files[m].rows[i]) === argmax(files[b].rows[i])) same++;
    }
    const [lq, eq] = meanAndError(sq, sq2, n), [lb, eb] = meanAndError(sb, sb2, n);
    const ppl = Math.exp(lq), basePpl = Math.exp(lb);
    const cov = (sqb / n - (sq / n) * (sb / n)) / (n - 1);
    const deltaVar = (ppl * eq) ** 2 + (basePpl * eb) ** 2 - 2 * ppl * basePpl * cov;
    const [kl, klErr] = meanAndError(skl, skl2, n);
    const top1 = same / n;
    result.pairs.push({ppl, base_ppl: basePpl, delta_ppl: ppl - basePpl, delta_ppl_error: Math.sqrt(Math.max(deltaVar, 0)),
                       kl, kl_error: klErr, top1, top1_error: Math.sqrt(top1 * (1 - top1) / (n - 1))});
  }
  process.stdout.write(JSON.stringify(result));
} catch (e) {
  process.stdout.write(JSON.stringify({error: String(e?.stack ?? e)}));
}
await llama.dispose();
