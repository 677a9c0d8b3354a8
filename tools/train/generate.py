#!/usr/bin/env python3
"""Greedy continuations of a checkpoint by model.py (float32, a full forward per token), with each
step's top1 - top2 logit margin so a comparison can tell a real disagreement from a near-tie.

  generate.py --checkpoint DIR [-n 32] [--json OUT.json] [--device cpu] [PROMPT ...]
             [--moraine-run BIN --gguf FILE.gguf]

Without prompts it uses PROMPTS. Prints the text; --json writes [{prompt, prompt_ids, ids, margins, text}].
With --moraine-run, moraine-run (the CPU reference executor) generates greedily from the same text on
FILE.gguf too: its prompt ids and greedy ids must equal ours, and its logits at every position ours
(exit 1 if not, with our margin at the first differing token).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402
from bpe import ByteLevelBpe  # noqa: E402
from model import Qwen3Next  # noqa: E402

LOGITS_BOUND = 1e-4
PROMPTS = [
    "The glacier carried the stones down to the valley,",
    "A list is a mutable sequence",
    "To read a file line by line,",
    "def fibonacci(n):\n",
    "The :mod:`socket` module provides",
]


@torch.no_grad()
def greedy(model, prompt_ids, n, device):
    seq = list(prompt_ids)
    ids, margins = [], []
    for _ in range(n):
        logits = model(torch.tensor([seq], device=device))[0, -1].float()
        top = torch.topk(logits, 2)
        ids.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        seq.append(ids[-1])
    return ids, margins


def moraine_greedy(binary, gguf, prompt, n):
    """moraine-run's prompt ids, greedy ids and the logits of every position (prompt and generated)."""
    with tempfile.TemporaryDirectory() as tmp:
        npy = os.path.join(tmp, "logits.npy")
        r = subprocess.run([binary, "-m", gguf, "-p", prompt, "-n", str(n), "--temp", "0", "--ignore-eos", "--json",
                            "--logits-out", npy], capture_output=True, check=True)
        j = json.loads(r.stdout)
        return j["prompt_ids"], j["generated_ids"], numpy.load(npy)


@torch.no_grad()
def compare(model, rows, binary, gguf, n):
    """Per prompt: the same prompt ids and greedy ids, and moraine's logits at every position within
    LOGITS_BOUND of max |logit| of ours with the same argmax (float32 both: reordering gives ~1e-6)."""
    failed, worst = 0, 0.0
    for r in rows:
        pid, ids, theirs = moraine_greedy(binary, gguf, r["prompt"], n)
        k = next((i for i in range(n) if ids[i] != r["ids"][i]), None)
        ours = model(torch.tensor([pid + ids]))[0].numpy()[: len(theirs)]
        rel = float(numpy.abs(ours - theirs).max() / numpy.abs(ours).max())
        worst = max(worst, rel)
        problems = []
        if pid != r["prompt_ids"]:
            problems.append("prompt ids")
        if k is not None:
            problems.append(f"greedy token {k} (our top1-top2 margin {r['margins'][k]:.4f})")
        if rel > LOGITS_BOUND or not (ours.argmax(-1) == theirs.argmax(-1)).all():
            problems.append(f"logits (max difference {rel:.2e} of max |logit|)")
        if problems:
            failed += 1
            print(f"FAIL: {r['prompt']!r}: moraine-run differs in " + ", ".join(problems))
    print(f"moraine-run vs model.py on {gguf}: ids and logits (worst {worst:.2e} of max |logit|): "
          f"{len(rows) - failed} passed, {failed} failed")
    return failed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--json")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--moraine-run")
    ap.add_argument("--gguf")
    ap.add_argument("prompts", nargs="*")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    model, _ = ckpt.load(Qwen3Next, args.checkpoint, with_mtp=False)
    model.to(device)
    tok = ByteLevelBpe.from_file(os.path.join(args.checkpoint, "tokenizer.json"))
    out = []
    for p in args.prompts or PROMPTS:
        pid = tok.encode(p)
        ids, margins = greedy(model, pid, args.n, device)
        text = tok.decode(ids)
        out.append({"prompt": p, "prompt_ids": pid, "ids": ids, "margins": margins, "text": text})
        print(f"--- {p!r}\n{p}{text}\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, ensure_ascii=False, indent=1)
    if args.moraine_run and compare(model.cpu(), out, args.moraine_run, args.gguf, args.n):
        sys.exit(1)


if __name__ == "__main__":
    main()
