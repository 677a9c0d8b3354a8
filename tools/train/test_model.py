#!/usr/bin/env python3
"""model.py against its references, on CPU (torch 1.13 or later, no transformers needed):
  1. the chunked gated delta rule against the step-by-step recurrence it rewrites (outputs and the
     gradients of every input), over lengths that are and are not multiples of the chunk;
  2. the whole forward against transformers' own float32 logits of the tiny Qwen3-Next golden models
     (tests/golden/qwen3next_*: transformers 5.17, per tests/golden/manifest.json): argmax at every
     position and max |logit difference| / max |logit|. Float32 reordering moves logits by ~1e-6 of
     their range; a wrong formula by O(1): 1e-4 lies two orders from each.
  3. to_hub_layout / from_hub_layout and our safetensors writer/reader round-trip exactly.
Exits non-zero on a failure."""
import json
import os
import sys
import tempfile

import numpy
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402
from model import Qwen3Next, gated_delta_rule, init_weights  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
GOLDENS = ["qwen3next_odd", "qwen3next_k256", "qwen3next_hd256"]
BOUND = 1e-4


def recurrent_delta_rule(q, k, v, g, beta):
    B, T, Hh, dk = k.shape
    S = torch.zeros(B, Hh, dk, v.shape[-1], dtype=torch.float64)
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        mem = (S * k[:, t, :, :, None]).sum(-2)
        S = S + k[:, t, :, :, None] * ((v[:, t] - mem) * beta[:, t, :, None])[:, :, None, :]
        out.append((S * (q[:, t] * dk ** -0.5)[..., None]).sum(-2))
    return torch.stack(out, 1)


def check_delta_rule():
    gen = torch.Generator().manual_seed(7)
    worst = 0.0
    for T in (1, 63, 64, 130):
        B, Hh, dk, dv = 2, 3, 16, 8
        q = torch.nn.functional.normalize(torch.randn(B, T, Hh, dk, generator=gen), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(B, T, Hh, dk, generator=gen), dim=-1)
        v = torch.randn(B, T, Hh, dv, generator=gen)
        g = -torch.rand(B, T, Hh, generator=gen) * 2
        beta = torch.rand(B, T, Hh, generator=gen)
        inputs = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
        probe = torch.randn(B, T, Hh, dv, generator=gen)
        with torch.enable_grad():
            got = gated_delta_rule(*inputs)
            got_grads = torch.autograd.grad((got * probe).sum(), inputs)
            want = recurrent_delta_rule(*inputs)
            want_grads = torch.autograd.grad((want * probe.double()).sum(), inputs)
        pairs = [(got.double(), want)] + [(a.double(), b) for a, b in zip(got_grads, want_grads)]
        err = max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)
        worst = max(worst, err)
        if err > BOUND:
            return f"delta rule T={T}: relative error {err:.2e} > {BOUND} (output or a gradient)"
    print(f"delta rule: chunked == recurrent, output and gradients (worst relative error {worst:.2e})")
    return None


def check_golden(name):
    d = os.path.join(ROOT, "tests", "golden", name)
    model, cfg = ckpt.load(Qwen3Next, d, with_mtp=False)
    with open(os.path.join(d, "greedy.json")) as f:
        prompt = json.load(f)["prompt"]
    with open(os.path.join(d, "logits.json")) as f:
        meta = json.load(f)
    want = torch.from_numpy(numpy.fromfile(os.path.join(d, "logits.f32"), dtype="<f4")).view(*meta["shape"])
    with torch.no_grad():
        got = model(torch.tensor([prompt]))[0]
    rel = float((got - want).abs().max() / want.abs().max())
    same_argmax = got.argmax(-1).tolist() == meta["argmax"]
    print(f"{name}: max |logit - transformers| / max |logit| = {rel:.2e}, argmax equal at every position: {same_argmax}")
    if rel > BOUND or not same_argmax:
        return f"{name}: differs from transformers (relative {rel:.2e}, argmax equal {same_argmax})"
    return None


def check_roundtrip():
    cfg = {"vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
           "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "norm_topk_prob": True,
           "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.5},
           "tie_word_embeddings": True, "mtp_num_hidden_layers": 1}
    torch.manual_seed(3)
    m = Qwen3Next(cfg)
    init_weights(m, 5)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt.save(m, cfg, tmp)
        names = set(ckpt.read_checkpoint(tmp))
        m2, _ = ckpt.load(Qwen3Next, tmp)
    for k, v in m.state_dict().items():
        if not torch.equal(v, m2.state_dict()[k]):
            return f"round trip: {k} differs"
    if "lm_head.weight" in names or "mtp.layers.0.mlp.experts.3.down_proj.weight" not in names:
        return f"round trip: unexpected tensor names {sorted(names)[:8]}..."
    print(f"checkpoint round trip: {len(names)} tensors, hub layout, exact")
    return None


def main():
    torch.set_grad_enabled(False)
    failures = [f for f in [check_delta_rule(), check_roundtrip()] + [check_golden(n) for n in GOLDENS] if f]
    for f in failures:
        print("FAIL:", f)
    print(f"{2 + len(GOLDENS) - len(failures)} passed, {len(failures)} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
