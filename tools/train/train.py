#!/usr/bin/env python3
"""Trains the built-in model: model.py's Qwen3-Next with an MTP head, on cut_tokenizer.py's token files.

  train.py --data DIR --out DIR [--minutes 9] [--preset default] [--device cuda] [--seed 1]

DIR holds tokenizer.json, tokenizer_config.json, train.bin, heldout.bin. Seeded init and batches;
AdamW, linear warm-up then cosine decay to 10% over the run's horizon (--max-steps, or the steps the
first timed steps say fit in --minutes); bf16 autocast on CUDA; loss = next-token cross entropy +
--mtp-weight * the MTP head's (token i+2) + --balance-weight * the Switch load-balancing term.
Logs every --log-every steps (OUT/loss.tsv and stdout) and the held-out loss every --eval-every;
stops at the horizon or the wall-clock limit, whichever comes first. Writes OUT/checkpoint
(config.json, model.safetensors in float32, the tokenizer files: what moraine-convert reads) and
OUT/train_log.json (settings, steps, tokens, wall time, final losses, each MoE layer's expert shares
over the whole run, most used first).
"""
import argparse
import json
import math
import os
import shutil
import sys
import time

import numpy
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402
from model import Qwen3Next, init_weights  # noqa: E402

# The built-in model: ~9.5M parameters, ~9 MB as Q4_K experts / Q8_0 rest (README.md has the sums).
PRESETS = {
    "default": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                    linear_value_head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
                    shared_expert_intermediate_size=256),
}


def hf_config(preset, tok_dir):
    """config.json as transformers 5.17 writes Qwen3NextConfig's (tests/golden/qwen3next_*), the ids
    from the tokenizer, one MTP layer, tied embeddings."""
    with open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    added = {a["content"]: a["id"] for a in tok["added_tokens"]}
    p = PRESETS[preset]
    n = p["num_hidden_layers"]
    return dict(
        p, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=len(tok["model"]["vocab"]) + len(added),
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        full_attention_interval=4, linear_conv_kernel_dim=4, hidden_act="silu", intermediate_size=2 * p["hidden_size"],
        attention_bias=False, attention_dropout=0.0, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        rms_norm_eps=1e-6, max_position_embeddings=4096, partial_rotary_factor=0.25,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        router_aux_loss_coef=0.001, output_router_logits=False, tie_word_embeddings=True, use_cache=True,
        mtp_num_hidden_layers=1, initializer_range=0.02, bos_token_id=added["<|endoftext|>"],
        eos_token_id=added["<|endoftext|>"], pad_token_id=added["<|endoftext|>"], transformers_version="5.17.0")


def load_tokens(path):
    return torch.from_numpy(numpy.fromfile(path, dtype="<u2").astype(numpy.int64))


def lr_at(step, horizon, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, horizon - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def losses(model, ids, args):
    """(total, next-token CE, MTP CE, balance, chosen experts) for a batch of T+1-token windows."""
    x, y = ids[:, :-1], ids[:, 1:]
    logits, mtp_logits, balance, chosen = model(x, with_mtp=True)
    V = logits.shape[-1]
    main = F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1))
    mtp = F.cross_entropy(mtp_logits.float().reshape(-1, V), y[:, 1:].reshape(-1))
    return main + args.mtp_weight * mtp + args.balance_weight * balance, main, mtp, balance, chosen


def autocast(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def heldout_loss(model, held, args, device):
    T = args.seq
    n = min(args.eval_windows, (len(held) - 1) // (T + 1))
    wins = held[: n * (T + 1)].view(n, T + 1).to(device)
    main = mtp = 0.0
    for i in range(0, n, args.batch):
        with autocast(device):
            _, m, t, _, _ = losses(model, wins[i:i + args.batch], args)
        k = min(args.batch, n - i)
        main += float(m) * k
        mtp += float(t) * k
    return main / n, mtp / n


def param_groups(model, weight_decay):
    """Weight decay on matrices (experts included), none on norms, biases, A_log, dt_bias."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed_tokens" not in name else plain).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


class Log:
    def __init__(self, path):
        self.f = open(path, "w")
        self.f.write("step\tseconds\tlr\ttokens\tloss\tmtp_loss\tbalance\theldout_loss\theldout_mtp_loss\n")

    def row(self, step, seconds, lr, tokens, loss, mtp, balance, held=None):
        h = f"{held[0]:.4f}\t{held[1]:.4f}" if held else "\t"
        line = f"{step}\t{seconds:.1f}\t{lr:.3e}\t{tokens}\t{loss:.4f}\t{mtp:.4f}\t{balance:.4f}\t{h}"
        self.f.write(line + "\n")
        self.f.flush()
        print(line, flush=True)


def expert_shares(counts):
    """Per MoE layer, each expert's share of the routed slots, most used first."""
    return [[round(c / max(1, sum(row)), 4) for c in sorted(row, reverse=True)] for row in counts.tolist()]


def train(args):
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    cfg = hf_config(args.preset, args.data)
    torch.manual_seed(args.seed)
    model = Qwen3Next(cfg)
    init_weights(model, args.seed)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    train_ids, held = load_tokens(os.path.join(args.data, "train.bin")), load_tokens(os.path.join(args.data, "heldout.bin"))
    if int(max(train_ids.max(), held.max())) >= cfg["vocab_size"]:
        sys.exit(f"train: token ids reach {int(train_ids.max())}, past the vocabulary of {cfg['vocab_size']}")
    train_dev = train_ids.to(device)
    step_fn = torch.compile(lambda ids: losses(model, ids, args)) if args.compile else (lambda ids: losses(model, ids, args))
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed + 1)
    os.makedirs(args.out, exist_ok=True)
    log = Log(os.path.join(args.out, "loss.tsv"))
    print(f"train: {n_params:,} parameters, {len(train_ids):,} training tokens, {len(held):,} held out, "
          f"batch {args.batch} x {args.seq}, device {device}", flush=True)
    limit = args.minutes * 60.0
    horizon = args.max_steps or 10 ** 9
    counts = torch.zeros(len(cfg["layer_types"]) + 1, cfg["num_experts"], dtype=torch.long, device=device)
    window = torch.arange(args.seq + 1)[None, :]
    start, step, timed_from = time.time(), 0, None
    # (held-out loss, step, weights on the CPU) of the best evaluation: the run of 2026-12-03 was best
    # at step 500 of 4,349 (3.38 vs 7.77 at the end), so the checkpoint written is the best one seen.
    best = None
    while step < horizon and time.time() - start < limit:
        lr = lr_at(step, horizon, args)
        for g in opt.param_groups:
            g["lr"] = lr
        offs = torch.randint(0, len(train_ids) - args.seq - 1, (args.batch, 1), generator=gen)
        ids = train_dev[(offs + window).to(device)]
        with autocast(device):
            total, main, mtp, balance, chosen = step_fn(ids)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        for i, ch in enumerate(chosen):  # on the device: no sync
            counts[i] += torch.bincount(ch.reshape(-1), minlength=cfg["num_experts"])
        step += 1
        if step == 3:  # the first steps carry allocator and compile warm-up: time from here
            if device.type == "cuda":
                torch.cuda.synchronize()
            timed_from = (step, time.time())
        if step == 3 + args.calibrate_steps and not args.max_steps:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per = (time.time() - timed_from[1]) / (step - timed_from[0])
            horizon = step + int((limit - (time.time() - start)) / per * 0.97)  # margin for the evals
            print(f"train: {per * 1000:.1f} ms a step: horizon {horizon} steps", flush=True)
        if step % args.log_every == 0 and step < horizon:
            held_l = None
            if step % args.eval_every == 0:
                model.eval()
                held_l = heldout_loss(model, held, args, device)
                model.train()
                if best is None or held_l[0] < best[0]:
                    best = (held_l[0], step, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
            log.row(step, time.time() - start, lr, step * args.batch * args.seq, float(main), float(mtp),
                    float(balance), held_l)
    wall = time.time() - start
    model.eval()
    final_held = heldout_loss(model, held, args, device)
    if step:  # the last step's row, with the final held-out loss
        log.row(step, wall, lr, step * args.batch * args.seq, float(main), float(mtp), float(balance), final_held)
    kept_step = step
    if best is not None and best[0] < final_held[0]:
        model.load_state_dict(best[2])
        kept_step = best[1]
        final_held = heldout_loss(model, held, args, device)
    ck = os.path.join(args.out, "checkpoint")
    ckpt.save(model.cpu(), cfg, ck)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(args.data, f), os.path.join(ck, f))
    summary = {"preset": args.preset, "parameters": n_params, "steps": step, "checkpoint_step": kept_step, "horizon": horizon,
               "tokens": step * args.batch * args.seq, "wall_seconds": round(wall, 1),
               "heldout_loss": round(final_held[0], 4), "heldout_mtp_loss": round(final_held[1], 4),
               "heldout_perplexity": round(math.exp(final_held[0]), 2),
               "expert_shares": expert_shares(counts), "settings": vars(args),
               "torch": torch.__version__, "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"train: {step} steps in {wall:.0f} s; checkpoint of step {kept_step}: held-out loss {final_held[0]:.4f} (perplexity "
          f"{math.exp(final_held[0]):.1f}), MTP {final_held[1]:.4f}; checkpoint {ck}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", required=True, help="cut_tokenizer.py's output folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--minutes", type=float, default=9.0, help="wall-clock limit of the training loop")
    ap.add_argument("--max-steps", type=int, default=0, help="fixed horizon (default: from --minutes)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--balance-weight", type=float, default=0.001, help="HF's router_aux_loss_coef")
    ap.add_argument("--calibrate-steps", type=int, default=20, help="timed steps that set the horizon")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-windows", type=int, default=256, help="held-out windows of --seq tokens per evaluation")
    ap.add_argument("--compile", action="store_true", help="torch.compile the loss (torch 2.x)")
    train(ap.parse_args())


if __name__ == "__main__":
    main()
