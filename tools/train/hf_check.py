#!/usr/bin/env python3
"""The trained checkpoint through transformers (where it is installed: the GPU machine), against
model.py and bpe.py:
  1. from_pretrained loads every trunk tensor (mtp.* it skips, as it does Qwen3-Next's);
  2. its tokenizer (tokenizer.json via AutoTokenizer) gives bpe.py's ids on every held-out document;
  3. its float32 logits on held-out windows match model.py's: argmax equal everywhere, max |difference|
     / max |logit| <= 1e-4 (float32 reordering gives ~1e-6, a wrong formula O(1), test_model.py);
  4. greedy generate() (KV and recurrent cache) on generate.PROMPTS: the samples, and whether
     model.py's full-forward greedy gives the same tokens (where not: the margin there, a near-tie
     or not).
  hf_check.py --checkpoint DIR --heldout heldout.txt --documents documents.json --out DIR [-n 48]
Writes OUT/samples.md and OUT/hf_check.json; exits non-zero when 1, 2 or 3 fails."""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402
from bpe import ByteLevelBpe  # noqa: E402
from generate import PROMPTS, greedy  # noqa: E402
from model import Qwen3Next  # noqa: E402

BOUND = 1e-4


def heldout_documents(text_path, documents_path):
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    with open(documents_path) as f:
        meta = json.load(f)
    return [text[d["start"]:d["end"]] for d in meta["documents"] if d["split"] == "heldout"]


def check_tokenizer(ckpt_dir, docs, ours):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(ckpt_dir)
    bad = []
    for i, d in enumerate(docs + PROMPTS):
        a, b = hf.encode(d, add_special_tokens=False), ours.encode(d)
        if a != b:
            k = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
            bad.append({"document": i, "first_difference": k, "hf": a[k:k + 8], "ours": b[k:k + 8]})
    n_tokens = sum(len(ours.encode(d)) for d in docs)
    return {"documents": len(docs), "prompts": len(PROMPTS), "tokens": n_tokens, "differences": bad}


def check_logits(hf_model, our_model, ids, device):
    worst, argmax_equal = 0.0, True
    with torch.no_grad():
        for w in ids:
            x = torch.tensor([w], device=device)
            a = hf_model(x, use_cache=False).logits[0].float()
            b = our_model(x)[0].float()
            worst = max(worst, float((a - b).abs().max() / a.abs().max()))
            argmax_equal = argmax_equal and bool((a.argmax(-1) == b.argmax(-1)).all())
    return {"windows": len(ids), "window_tokens": len(ids[0]), "max_relative_difference": worst,
            "argmax_equal": argmax_equal}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--heldout", required=True)
    ap.add_argument("--documents", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ours = ByteLevelBpe.from_file(os.path.join(args.checkpoint, "tokenizer.json"))
    hf_model, info = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32,
                                                          attn_implementation="eager", output_loading_info=True)
    hf_model.to(device).eval()
    our_model, cfg = ckpt.load(Qwen3Next, args.checkpoint, with_mtp=False)
    our_model.to(device)
    load = {k: sorted(map(str, v)) for k, v in info.items() if v}
    missing = load.get("missing_keys", [])
    if cfg.get("tie_word_embeddings") and torch.equal(hf_model.lm_head.weight, hf_model.model.embed_tokens.weight):
        missing = [k for k in missing if k != "lm_head.weight"]   # tied: filled from the embeddings
    docs = heldout_documents(args.heldout, args.documents)
    report = {"transformers": transformers.__version__, "torch": torch.__version__, "loading_info": load,
              "tokenizer": check_tokenizer(args.checkpoint, docs, ours)}
    held_ids = ours.encode("\n\n".join(docs))
    windows = [held_ids[i:i + 256] for i in range(0, min(len(held_ids) - 256, 4 * 256), 256)]
    report["logits"] = check_logits(hf_model, our_model, windows, device)

    gcfg = GenerationConfig(max_new_tokens=args.n, do_sample=False, use_cache=True, eos_token_id=None,
                            pad_token_id=cfg["pad_token_id"])
    hf_model.generation_config.eos_token_id = None
    samples, lines = [], ["# Greedy samples (transformers generate, float32)", ""]
    for p in PROMPTS:
        pid = ours.encode(p)
        out = hf_model.generate(torch.tensor([pid], device=device), generation_config=gcfg)[0, len(pid):].tolist()
        mine, margins = greedy(our_model, pid, args.n, device)
        k = next((j for j in range(len(out)) if out[j] != mine[j]), None)
        samples.append({"prompt": p, "hf": out, "ours": mine, "first_difference": k,
                        "our_margin_there": None if k is None else margins[k]})
        lines += [f"## {p!r}", "", "```", p + ours.decode(out), "```", ""]
    report["greedy"] = samples
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "samples.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    with open(os.path.join(args.out, "hf_check.json"), "w") as f:
        json.dump(report, f, indent=1, ensure_ascii=False)
    failures = []
    if missing:
        failures.append(f"transformers left tensors uninitialised: {missing}")
    if report["tokenizer"]["differences"]:
        failures.append(f"tokenizer: {len(report['tokenizer']['differences'])} documents differ")
    lg = report["logits"]
    if lg["max_relative_difference"] > BOUND or not lg["argmax_equal"]:
        failures.append(f"logits differ from transformers: {lg}")
    same = sum(s["first_difference"] is None for s in samples)
    print(f"hf_check: tokenizer {report['tokenizer']['tokens']:,} held-out tokens, "
          f"{len(report['tokenizer']['differences'])} documents differ; logits {lg}; greedy equal on "
          f"{same}/{len(samples)} prompts", flush=True)
    for f in failures:
        print("FAIL:", f)
    print(f"{3 - len(failures)} passed, {len(failures)} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
