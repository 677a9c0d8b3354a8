#!/usr/bin/env python3
"""The cut tokenizer three ways on the corpus: bpe.py (which tokenized the training data), moraine
(moraine-tokenize on the GGUF moraine-convert wrote) and llama.cpp (node-llama-cpp reading the same
GGUF, through tests/tokenizer/corpus_oracle.mjs, special-token parsing off and on). Every held-out
document, every --every-th training document and generate.PROMPTS must give the same ids everywhere.

  check_tokenizer.py --gguf FILE.gguf --tokenizer DIR --corpus DIR --moraine-tokenize BIN [--every 10]
Exits non-zero on any difference, naming the text and the first differing position."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bpe import ByteLevelBpe  # noqa: E402
from generate import PROMPTS  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def texts(corpus, every):
    with open(os.path.join(corpus, "documents.json")) as f:
        meta = json.load(f)
    out = []
    for split in ("heldout", "train"):
        with open(os.path.join(corpus, f"{split}.txt"), encoding="utf-8") as f:
            text = f.read()
        docs = [d for d in meta["documents"] if d["split"] == split]
        step = 1 if split == "heldout" else every
        out += [(f"{split}:{d['path']}", text[d["start"]:d["end"]]) for d in docs[::step]]
    return out + [(f"prompt {i}", p) for i, p in enumerate(PROMPTS)]


def llama_ids(gguf, corpus_texts):
    oracle = os.path.join(ROOT, ".cache", "oracle")
    if not os.path.isdir(os.path.join(oracle, "node_modules", "node-llama-cpp")):
        sys.exit(f"check_tokenizer: {oracle} has no node-llama-cpp (run tests/oracle/setup)")
    with tempfile.TemporaryDirectory() as tmp:
        cpath, opath = os.path.join(tmp, "corpus.json"), os.path.join(tmp, "oracle.json")
        with open(cpath, "w", encoding="utf-8") as f:
            json.dump(corpus_texts, f, ensure_ascii=False)
        subprocess.run(["node", os.path.join(ROOT, "tests", "tokenizer", "corpus_oracle.mjs"), opath, cpath,
                        os.path.abspath(gguf)], cwd=oracle, check=True)
        with open(opath) as f:
            return json.load(f)[os.path.abspath(gguf)]


def moraine_ids(binary, gguf, text):
    r = subprocess.run([binary, "-m", gguf], input=text.encode("utf-8"), capture_output=True, check=True)
    return json.loads(r.stdout)


def first_difference(a, b):
    return next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--tokenizer", required=True, help="folder with the cut tokenizer.json")
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--moraine-tokenize", required=True)
    ap.add_argument("--every", type=int, default=10, help="check every n-th training document")
    args = ap.parse_args()
    bpe = ByteLevelBpe.from_file(os.path.join(args.tokenizer, "tokenizer.json"))
    named = texts(args.corpus, args.every)
    llama = llama_ids(args.gguf, [t for _, t in named])
    failures, n_tokens = [], 0
    for i, (name, text) in enumerate(named):
        ours = bpe.encode(text)
        n_tokens += len(ours)
        for who, ids in (("moraine", moraine_ids(args.moraine_tokenize, args.gguf, text)),
                         ("llama.cpp", llama["plain"][i]), ("llama.cpp special", llama["special"][i])):
            if ids != ours:
                k = first_difference(ids, ours)
                failures.append((name, f"{who} differs from bpe.py at token {k}: {ids[k:k + 6]} vs {ours[k:k + 6]}"))
    for name, msg in failures:
        print(f"FAIL: {name}: {msg}")
    failed = len({name for name, _ in failures})
    print(f"check_tokenizer: {len(named)} texts, {n_tokens:,} tokens: bpe.py, moraine and llama.cpp "
          f"{'agree' if not failures else 'differ'}")
    print(f"{len(named) - failed} passed, {failed} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
