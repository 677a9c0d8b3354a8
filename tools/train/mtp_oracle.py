#!/usr/bin/env python3
"""The MTP head's oracle (issue 30 item 3): a tiny random Qwen3-Next with one MTP layer, built by
model.py (seeded), saved as an HF checkpoint folder (BF16 weights, ckpt.py's layout) together with
model.py's float32 logits and MTP logits of a prompt, for tests/reference/mtp_test.cpp, which converts
the folder with moraine-convert and holds the reference executor's MTP head to these logits.

Every 1-D weight (the norms, dt_bias) is drawn too, not left at init's zeros: with zero norm
offsets enorm and hnorm are the same function and a swapped pair would pass.
Run on CPU (torch 1.13 or later): python3 tools/train/mtp_oracle.py OUT_DIR"""
import json
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402
from model import Qwen3Next, init_weights  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
TOKENIZER = os.path.join(ROOT, "tests", "golden", "qwen3next_odd")   # 1,031 tokens, 1,026.. special
SEED, N_PROMPT = 3001, 24

CFG = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "vocab_size": 1031, "hidden_size": 96, "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"], "mtp_num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_value_head_dim": 16,
    "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 40, "norm_topk_prob": True,
    "shared_expert_intermediate_size": 48, "intermediate_size": 160, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "partial_rotary_factor": 0.25, "max_position_embeddings": 512,
    "bos_token_id": 1026, "eos_token_id": 1028, "pad_token_id": 1026,
}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "reference", "data", "qwen3next_mtp")
    torch.manual_seed(SEED)
    model = Qwen3Next(CFG)
    init_weights(model, SEED, std=0.08)   # larger than training's 0.02: logits spread over a few units
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and not name.endswith(("A_log", "dt_bias")):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    ckpt.save(model, CFG, out, dtype=torch.bfloat16)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER, f), os.path.join(out, f))
    # The oracle reads the saved BF16 weights back, as moraine does.
    model, _ = ckpt.load(Qwen3Next, out)
    prompt = torch.randint(0, 1026, (1, N_PROMPT), generator=gen)
    with torch.no_grad():
        logits, mtp_logits, _, _ = model(prompt, with_mtp=True)
    logits, mtp_logits = logits[0].float().contiguous(), mtp_logits[0].float().contiguous()
    logits.numpy().tofile(os.path.join(out, "logits.f32"))
    mtp_logits.numpy().tofile(os.path.join(out, "mtp_logits.f32"))
    meta = {
        "torch": torch.__version__, "seed": SEED, "tokens": prompt[0].tolist(),
        "logits_shape": list(logits.shape), "mtp_logits_shape": list(mtp_logits.shape),
        "layout": "row-major float32 little-endian; mtp row i: the logits of token i+2 (slot i)",
        "logits_max_abs": float(logits.abs().max()), "mtp_logits_max_abs": float(mtp_logits.abs().max()),
        "mtp_argmax": mtp_logits.argmax(-1).tolist(),
    }
    with open(os.path.join(out, "oracle.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps({k: meta[k] for k in ("logits_max_abs", "mtp_logits_max_abs", "mtp_logits_shape")}))


if __name__ == "__main__":
    main()
