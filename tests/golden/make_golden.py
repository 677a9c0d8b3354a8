#!/usr/bin/env python3
"""Golden fixtures: tiny random Qwen3-MoE / Qwen3-Next models run through Hugging Face transformers.

Two phases, because torch lives on a different machine than the Qwen tokenizer source:

  make_golden.py tokenizers --qwen-tokenizer PATH [--out tests/golden]
      (stdlib only) writes <model>/tokenizer.json + tokenizer_config.json: Qwen3's real BPE
      tokenizer cut down to each model's vocabulary.

  make_golden.py models [--out DIR] [--tokenizers tests/golden]
      (torch + transformers + safetensors + tokenizers) builds each model from its config with a
      fixed seed, rounds every weight to bf16, saves a bf16 safetensors checkpoint, reloads it
      through from_pretrained (so the fixture is what HF itself reads from those files) and runs
      the float32 CPU forward. Writes per model: model.safetensors (or shards + index),
      config.json, tokens.json, logits.f32 + logits.json, greedy.json; and manifest.json.

The weights get a larger spread than HF's default init (std 0.02 makes every logit ~0 and every
router tie), so logits vary by several units and routers pick different experts per token.
"""
import argparse
import json
import math
import os
import sys

# ---------------------------------------------------------------------------------------------
# Model configurations. "odd" ones stress shapes (vocab not a power of two, GQA 2 and 8, head_dim
# not hidden/heads); "k256" ones have hidden and expert sizes divisible by 256 so K-quants apply;
# "hd128" / "hd256" carry the real models' head sizes (Qwen3-30B-A3B 128, Qwen3-Next 256, gated),
# so kernels that only take those (the tensor-core prefill attention) run against HF too.
# ---------------------------------------------------------------------------------------------
N_ADDED = 5  # <|endoftext|> <|im_start|> <|im_end|> (control) and <think> </think> (user-defined)

MODELS = {
    "qwen3moe_odd": dict(
        arch="Qwen3MoeForCausalLM", seed=1001, layout="per_expert", shards=2,
        config=dict(vocab_size=1031, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                    num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                    num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40,
                    norm_topk_prob=True, decoder_sparse_step=1, rms_norm_eps=1e-6,
                    max_position_embeddings=512, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3moe_k256": dict(
        arch="Qwen3MoeForCausalLM", seed=1002, layout="fused", shards=1,
        config=dict(vocab_size=643, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=1, head_dim=32,
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                    norm_topk_prob=True, decoder_sparse_step=1, rms_norm_eps=1e-6,
                    max_position_embeddings=512, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen3next_odd": dict(
        arch="Qwen3NextForCausalLM", seed=2001, layout="per_expert", shards=1, mtp_layers=1,
        config=dict(vocab_size=1031, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                    full_attention_interval=2,
                    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
                    shared_expert_intermediate_size=48, norm_topk_prob=True,
                    decoder_sparse_step=1, rms_norm_eps=1e-6, max_position_embeddings=512,
                    tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                     "partial_rotary_factor": 0.25})),
    "qwen3next_k256": dict(
        arch="Qwen3NextForCausalLM", seed=2002, layout="per_expert", shards=1,
        config=dict(vocab_size=643, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=1, head_dim=32,
                    layer_types=["linear_attention", "full_attention"],
                    linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    num_experts=3, num_experts_per_tok=2, moe_intermediate_size=256,
                    shared_expert_intermediate_size=256, norm_topk_prob=True,
                    decoder_sparse_step=1, rms_norm_eps=1e-6, max_position_embeddings=512,
                    tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                     "partial_rotary_factor": 0.25})),
    "qwen3moe_hd128": dict(
        arch="Qwen3MoeForCausalLM", seed=1003, layout="fused", shards=1,
        config=dict(vocab_size=643, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                    norm_topk_prob=True, decoder_sparse_step=1, rms_norm_eps=1e-6,
                    max_position_embeddings=512, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3next_hd256": dict(
        arch="Qwen3NextForCausalLM", seed=2003, layout="per_expert", shards=1,
        config=dict(vocab_size=643, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                    layer_types=["linear_attention", "full_attention"],
                    linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    num_experts=3, num_experts_per_tok=2, moe_intermediate_size=256,
                    shared_expert_intermediate_size=256, norm_topk_prob=True,
                    decoder_sparse_step=1, rms_norm_eps=1e-6, max_position_embeddings=512,
                    tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                     "partial_rotary_factor": 0.25})),
    # gpt-oss: attention biases and sinks, sliding (8, so the 24-token prompt crosses it) and
    # full layers alternating, YaRN, top-k-then-softmax router with bias, clamped-SwiGLU experts
    # with biases (moraine-convert maps GptOssForCausalLM: tools/convert/arch/gpt_oss.cpp).
    # HF's yarn here has truncate=False; llama.cpp (and a GGUF, which has no key for it) floors
    # and ceils the correction dims: this fixture measures that gap too.
    "gpt_oss_odd": dict(
        arch="GptOssForCausalLM", seed=3001, layout="fused", shards=1,
        config=dict(vocab_size=643, hidden_size=96, intermediate_size=40, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                    num_local_experts=6, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    attention_bias=True, rms_norm_eps=1e-5, max_position_embeddings=131072,
                    tie_word_embeddings=False, swiglu_limit=7.0,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                     "beta_fast": 32.0, "beta_slow": 1.0,
                                     "original_max_position_embeddings": 4096, "truncate": False})),
    # qwen2moe: the architecture made only of existing parts (q/k/v biases, softmax router
    # without renormalisation, gated shared expert).
    "qwen2moe_odd": dict(
        arch="Qwen2MoeForCausalLM", seed=4001, layout="per_expert", shards=1,
        config=dict(vocab_size=643, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                    num_attention_heads=6, num_key_value_heads=3,
                    num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
                    shared_expert_intermediate_size=48, norm_topk_prob=False,
                    decoder_sparse_step=1, rms_norm_eps=1e-6, max_position_embeddings=512,
                    tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # glm4moe (GLM-4.5): a leading dense layer, partial RoPE, q/k/v biases and q/k norm, sigmoid
    # router with its e_score_correction_bias (a buffer: init_weights fills it), routed scaling,
    # an ungated shared expert (moraine-convert maps Glm4MoeForCausalLM: tools/convert/arch/glm4moe.cpp;
    # transformers saves no MTP layer, so the file is llama.cpp's --no-mtp one).
    "glm4moe_odd": dict(
        arch="Glm4MoeForCausalLM", seed=7001, layout="per_expert", shards=1,
        config=dict(vocab_size=643, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                    n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                    n_group=1, topk_group=1, norm_topk_prob=True, use_qk_norm=True,
                    attention_bias=True, rms_norm_eps=1e-5, max_position_embeddings=512,
                    tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                     "partial_rotary_factor": 0.5})),
    # qwen35moe (Qwen3.5-MoE): qwen3next's hybrid with in_proj_qkv/z/b/a, value heads grouped
    # by key head in HF (llama.cpp's converter tiles them), interleaved M-RoPE whose sections
    # cover every rotary pair (text positions turn them all). The text config class is
    # Qwen3_5MoeTextConfig (moraine-convert maps it: tools/convert/arch/qwen35moe.cpp).
    "qwen35moe_odd": dict(
        arch="Qwen3_5MoeForCausalLM", config_cls="Qwen3_5MoeTextConfig", seed=8001,
        layout="per_expert", shards=1,
        config=dict(vocab_size=643, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    full_attention_interval=2,
                    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
                    shared_expert_intermediate_size=48, norm_topk_prob=True,
                    rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                     "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                     "mrope_interleaved": True})),
    # deepseek2 (MLA): the latent, the decoupled rotary key, DeepSeek's YaRN (mscale_all_dim),
    # a leading dense layer, shared experts. deepseek_v2: V2-Lite-like (q directly, softmax
    # router, no renormalisation, 2 shared experts); deepseek_v3: V3-like (q LoRA, sigmoid router
    # with e_score_correction_bias over 4 groups of which 2 are used, renormalised, scale 2.5).
    "deepseek_v2": dict(
        arch="DeepseekV2ForCausalLM", seed=7001, layout="per_expert", shards=1,
        config=dict(vocab_size=643, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=4,
                    q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                    v_head_dim=16, first_k_dense_replace=1, n_routed_experts=6, n_shared_experts=2,
                    num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=False,
                    routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1,
                    rms_norm_eps=1e-6, max_position_embeddings=163840, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                     "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707})),
    "deepseek_v3": dict(
        arch="DeepseekV3ForCausalLM", seed=7002, layout="per_expert", shards=1,
        config=dict(vocab_size=643, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=4,
                    q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                    v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
                    num_experts_per_tok=3, moe_intermediate_size=40, norm_topk_prob=True,
                    routed_scaling_factor=2.5, n_group=4, topk_group=2, rope_interleave=True,
                    rms_norm_eps=1e-6, max_position_embeddings=163840, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                     "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})),
}

N_PROMPT = 24
N_GREEDY = 32
PROMPT_TEXT = ("<|im_start|>user\nThe quick brown fox jumps over 13 lazy dogs, "
               "then naps in the sun.<think>\n</think><|im_end|>")
TOKENIZER_CASES = ["Hello world!", " the  cat\n\nsat 12345", "<|im_start|>system\nhi<|im_end|>",
                   "café naïve 你好", "<think>ok</think>"]


# ---------------------------------------------------------------------------------------------
# Phase 1: tokenizers (stdlib only)
# ---------------------------------------------------------------------------------------------
def truncate_tokenizer(src, vocab_size):
    """Qwen3's tokenizer.json restricted to ids < vocab_size - N_ADDED plus N_ADDED added tokens
    renumbered to the top ids, with only the merges whose pieces and result all survive."""
    t = json.loads(json.dumps(src))  # deep copy
    n_regular = vocab_size - N_ADDED
    vocab = {s: i for s, i in t["model"]["vocab"].items() if i < n_regular}
    merges = []
    for m in t["model"]["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        if a in vocab and b in vocab and (a + b) in vocab:
            merges.append(m)
    keep = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    by_content = {a["content"]: a for a in t["added_tokens"]}
    added = []
    for k, content in enumerate(keep):
        a = dict(by_content[content])
        a["id"] = n_regular + k
        added.append(a)
    t["added_tokens"] = added
    t["model"]["vocab"] = vocab
    t["model"]["merges"] = merges
    return t


def tokenizer_config(tok):
    ids = {a["content"]: a["id"] for a in tok["added_tokens"]}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(a["id"]): {k: a[k] for k in a if k != "id"}
                                 for a in tok["added_tokens"]},
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 512,
        "tokenizer_class": "Qwen2Tokenizer",
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "_ids": ids,
    }


def selected(args):
    """MODELS, or the ones --only names (the others' fixtures stay as they are)."""
    if not args.only:
        return {n: m for n, m in MODELS.items() if not m.get("opt_in")}
    names = args.only.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"--only: unknown models {unknown}; known: {sorted(MODELS)}")
    return {n: MODELS[n] for n in names}


def phase_tokenizers(args):
    with open(args.qwen_tokenizer, encoding="utf-8") as f:
        src = json.load(f)
    for name, spec in selected(args).items():
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        tok = truncate_tokenizer(src, spec["config"]["vocab_size"])
        cfg = tokenizer_config(tok)
        cfg.pop("_ids")
        with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(tok, f, ensure_ascii=False, separators=(",", ":"))
        with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, ensure_ascii=False, indent=1)
        print(f"{name}: {len(tok['model']['vocab'])} regular tokens, "
              f"{len(tok['model']['merges'])} merges, {len(tok['added_tokens'])} added")


# ---------------------------------------------------------------------------------------------
# Phase 2: models (torch)
# ---------------------------------------------------------------------------------------------
def init_weights(model, model_type, gen):
    """Deterministic init with spreads chosen so logits and routing are far from flat."""
    import torch
    for name, p in model.named_parameters():
        with torch.no_grad():
            def normal(std):
                p.copy_(torch.randn(p.shape, generator=gen) * std)

            def uniform(lo, hi):
                p.copy_(lo + (hi - lo) * torch.rand(p.shape, generator=gen))

            if name.endswith("embed_tokens.weight"):
                normal(1.0)
            elif name == "lm_head.weight":
                normal(2.0 / math.sqrt(p.shape[1]))           # logits of a few units
            elif name.endswith("mlp.gate.weight") or name.endswith("mlp.router.weight"):
                normal(3.0 / math.sqrt(p.shape[1]))           # decisive, token-dependent routing
            elif model_type == "gpt_oss" and name.endswith("experts.gate_up_proj"):   # [E, H, 2F]
                normal(1.0 / math.sqrt(p.shape[1]))
            elif model_type == "gpt_oss" and name.endswith("experts.down_proj"):      # [E, F, H]
                normal(1.0 / math.sqrt(p.shape[1]))
            elif name.endswith("_bias") and p.dim() == 2:     # gpt-oss per-expert biases
                normal(0.1)
            elif name.endswith("self_attn.sinks"):            # one softmax sink logit per head
                normal(1.0)
            elif name.endswith("experts.gate_up_proj"):       # [E, 2F, H]
                normal(1.0 / math.sqrt(p.shape[2]))
            elif name.endswith("experts.down_proj"):          # [E, H, F]
                normal(1.0 / math.sqrt(p.shape[2]))
            elif name.endswith("A_log"):
                # A in [0.05, 2]: decays slow enough that the recurrent state carries history.
                p.copy_(torch.log(0.05 + 1.95 * torch.rand(p.shape, generator=gen)))
            elif name.endswith("dt_bias"):
                normal(0.5)
            elif name.endswith("conv1d.weight"):
                normal(0.5)
            elif "norm" in name and p.dim() == 1:
                if model_type in ("qwen3_next", "qwen3_5_moe_text") and not name.endswith("linear_attn.norm.weight"):
                    normal(0.2)            # Qwen3NextRMSNorm scales by (1 + w)
                else:
                    uniform(0.6, 1.4)      # plain RMSNorm scales by w
            elif p.dim() == 2:
                normal(1.0 / math.sqrt(p.shape[1]))
            elif p.dim() == 1:
                normal(0.1)
            else:
                raise RuntimeError(f"no init rule for {name} {tuple(p.shape)}")
            # Real checkpoints are bf16: the fixture's weights are exactly bf16 values.
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    # glm4moe's and DeepSeek-V3's choice bias is a buffer (saved with the checkpoint): spread like the scores.
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            with torch.no_grad():
                b.copy_((torch.randn(b.shape, generator=gen) * 0.5).to(torch.bfloat16).to(b.dtype))


def checkpoint_tensors(model, layout):
    """State dict in checkpoint form. per_expert: the hub layout of Qwen3-30B-A3B / Qwen3-Next
    (mlp.experts.E.{gate,up,down}_proj.weight); fused: transformers v5's in-memory layout."""
    import torch
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach().to(torch.bfloat16).contiguous()
        if layout == "per_expert" and k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            f = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = v[e, :f].contiguous()
                out[f"{base}{e}.up_proj.weight"] = v[e, f:].contiguous()
        elif layout == "per_expert" and k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v
    return out


def mtp_tensors(cfg, n_layers, gen):
    """A Qwen3-Next multi-token-prediction block in the hub layout (mtp.*). transformers has no
    MTP module and skips these on load, so they do not change the logits; they are here so the
    converter's mtp -> nextn mapping runs on a checkpoint shaped like the real one."""
    import torch
    H, hd = cfg.hidden_size, cfg.head_dim
    E, F, Fs = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    shapes = {"mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
              "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,)}
    for i in range(n_layers):
        p = f"mtp.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (cfg.num_attention_heads * hd * 2, H),
            p + "self_attn.k_proj.weight": (cfg.num_key_value_heads * hd, H),
            p + "self_attn.v_proj.weight": (cfg.num_key_value_heads * hd, H),
            p + "self_attn.o_proj.weight": (H, cfg.num_attention_heads * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate.weight": (E, H), p + "mlp.shared_expert_gate.weight": (1, H),
            p + "mlp.shared_expert.gate_proj.weight": (Fs, H),
            p + "mlp.shared_expert.up_proj.weight": (Fs, H),
            p + "mlp.shared_expert.down_proj.weight": (H, Fs)})
        for e in range(E):
            shapes.update({p + f"mlp.experts.{e}.gate_proj.weight": (F, H),
                           p + f"mlp.experts.{e}.up_proj.weight": (F, H),
                           p + f"mlp.experts.{e}.down_proj.weight": (H, F)})
    out = {}
    for name, shape in sorted(shapes.items()):
        std = 0.2 if len(shape) == 1 else 1.0 / math.sqrt(shape[-1])
        out[name] = (torch.randn(shape, generator=gen) * std).to(torch.bfloat16).contiguous()
    return out


def save_checkpoint(tensors, d, shards):
    from safetensors.torch import save_file
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    per = math.ceil(len(names) / shards)
    files, weight_map, total = [], {}, 0
    for s in range(shards):
        fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        save_file(part, os.path.join(d, fn), metadata={"format": "pt"})
        for n, t in part.items():
            weight_map[n] = fn
            total += t.numel() * t.element_size()
        files.append(fn)
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return files + ["model.safetensors.index.json"]


def greedy_manual(model, ids, n):
    """Greedy by full forwards (no cache), with each step's top1-top2 logit margin so a checker
    can tell a real disagreement from a near-tie."""
    import torch
    seq = list(ids)
    toks, margins = [], []
    for _ in range(n):
        logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
        top = torch.topk(logits, 2)
        toks.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        seq.append(toks[-1])
    return toks, margins


def phase_models(args):
    import torch
    import transformers
    import safetensors
    import tokenizers

    torch.set_grad_enabled(False)
    os.makedirs(args.out, exist_ok=True)
    manifest = {"torch": torch.__version__, "transformers": transformers.__version__,
                "safetensors": safetensors.__version__, "tokenizers": tokenizers.__version__,
                "python": sys.version.split()[0], "device": "cpu", "dtype_forward": "float32",
                "dtype_weights": "bfloat16", "n_prompt": N_PROMPT, "n_greedy": N_GREEDY,
                "models": {}}
    path = os.path.join(args.out, "manifest.json")
    if args.only and os.path.exists(path):
        # Keep the other models' entries; the versions must be the ones they were made with.
        with open(path) as f:
            old = json.load(f)
        for k in ("torch", "transformers", "safetensors", "tokenizers"):
            if old.get(k) != manifest[k]:
                sys.exit(f"--only: {path} was made with {k} {old.get(k)}, this is {manifest[k]}: "
                         "remake every model instead")
        manifest["models"] = old.get("models", {})
    failed = {}
    for name, spec in selected(args).items():
        print(f"== {name}", flush=True)
        try:
            one_model(args, name, spec, manifest)
        except Exception as e:  # keep going: one bad config must not cost the others' run
            import traceback
            traceback.print_exc()
            failed[name] = repr(e)
    manifest["failed"] = failed
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)
    if failed:
        sys.exit(f"failed: {sorted(failed)}")


def one_model(args, name, spec, manifest):
    import torch
    import transformers
    import tokenizers
    from transformers import AutoModelForCausalLM, GenerationConfig
    d = os.path.join(args.out, name)
    os.makedirs(d, exist_ok=True)
    tok_path = os.path.join(args.tokenizers, name, "tokenizer.json")
    tk = tokenizers.Tokenizer.from_file(tok_path)
    ids = tk.encode(PROMPT_TEXT, add_special_tokens=False).ids
    if len(ids) < N_PROMPT:
        raise RuntimeError(f"{name}: prompt encodes to only {len(ids)} tokens")
    prompt = ids[:N_PROMPT]
    added = {a["content"]: a["id"] for a in json.load(open(tok_path))["added_tokens"]}

    cls = getattr(transformers, spec["arch"])
    cfg_cls = getattr(transformers, spec.get("config_cls", spec["arch"].replace("ForCausalLM", "Config")))
    cfg = cfg_cls(**spec["config"], bos_token_id=added["<|endoftext|>"],
                  eos_token_id=added["<|im_end|>"], pad_token_id=added["<|endoftext|>"])
    cfg.architectures = [spec["arch"]]
    torch.manual_seed(spec["seed"])
    model = cls(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(spec["seed"])
    init_weights(model, cfg.model_type, gen)

    # Save bf16, then reload through HF's own loader: the fixture is what HF reads.
    tensors = checkpoint_tensors(model, spec["layout"])
    if spec.get("mtp_layers"):
        tensors.update(mtp_tensors(cfg, spec["mtp_layers"], gen))
    files = save_checkpoint(tensors, d, spec["shards"])
    cfg.save_pretrained(d)
    ref, info = AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    ref.eval()
    load_info = {k: sorted(map(str, v)) for k, v in info.items() if v}
    if load_info:
        print(f"{name}: loading info {load_info}", flush=True)
    sd0, sd1 = model.state_dict(), ref.state_dict()
    for k in sd0:
        if not torch.equal(sd0[k], sd1[k].to(sd0[k].dtype)):
            raise RuntimeError(f"{name}: {k} differs after save/reload")

    logits = ref(torch.tensor([prompt]), use_cache=False).logits[0].to(torch.float32)
    if not torch.isfinite(logits).all():
        raise RuntimeError(f"{name}: non-finite logits")
    logits.numpy().astype("<f4").tofile(os.path.join(d, "logits.f32"))
    stats = {"shape": list(logits.shape), "dtype": "float32", "byte_order": "little",
             "layout": "row-major [n_positions, vocab]",
             "max_abs": float(logits.abs().max()), "std": float(logits.std()),
             "argmax": [int(x) for x in logits.argmax(-1)]}
    with open(os.path.join(d, "logits.json"), "w") as f:
        json.dump(stats, f, indent=1)

    # Expert routing spread: distinct top-k expert sets across positions, per MoE layer,
    # read from the routers' own outputs (an integer tensor of chosen expert ids).
    picked = []
    # (dense layers have no router; a router that returns only its logits, as DeepSeek-V3's,
    # is judged by its top-k logits)
    routers = [layer.mlp.gate if hasattr(layer.mlp, "gate") else layer.mlp.router   # qwen / gpt-oss
               for layer in ref.model.layers if hasattr(layer.mlp, "gate") or hasattr(layer.mlp, "router")]
    k_used = spec["config"].get("num_experts_per_tok", 2)

    def chosen(out):
        outs = out if isinstance(out, tuple) else (out,)
        ints = [o for o in outs if torch.is_tensor(o) and not o.is_floating_point()]
        return ints[-1] if ints else outs[0].topk(k_used, dim=-1).indices
    hooks = [router.register_forward_hook(lambda mod, inp, out: picked.append(chosen(out)))
             for router in routers]
    ref(torch.tensor([prompt]), use_cache=False)
    for h in hooks:
        h.remove()
    routing = [len({tuple(sorted(row)) for row in idx.reshape(-1, idx.shape[-1]).tolist()})
               for idx in picked]
    if any(r < 2 for r in routing):
        raise RuntimeError(f"{name}: a router picks the same experts for every token: {routing}")

    gcfg = dict(max_new_tokens=N_GREEDY, min_new_tokens=0, do_sample=False,
                eos_token_id=None, pad_token_id=added["<|endoftext|>"])
    inp = torch.tensor([prompt])
    # generate() fills unset fields from the model's generation config; without an eos it
    # always runs the full N_GREEDY steps.
    ref.generation_config.eos_token_id = None
    g_cache = ref.generate(inp, generation_config=GenerationConfig(**gcfg, use_cache=True))
    try:
        g_nocache = ref.generate(inp, generation_config=GenerationConfig(**gcfg, use_cache=False))
    except Exception as e:  # the full-forward greedy below is the no-cache check then
        print(f"{name}: generate(use_cache=False) failed: {e!r}", flush=True)
        g_nocache = torch.tensor([prompt + [-1] * N_GREEDY])
    g_cache = g_cache[0, N_PROMPT:].tolist()
    g_nocache = g_nocache[0, N_PROMPT:].tolist()
    manual, margins = greedy_manual(ref, prompt, N_GREEDY)
    if len(g_cache) != N_GREEDY or len(g_nocache) != N_GREEDY:
        raise RuntimeError(f"{name}: generate stopped early: {g_cache} / {g_nocache}")
    greedy = {"prompt": prompt, "tokens": g_cache, "tokens_no_cache": g_nocache,
              "tokens_full_forward": manual, "top1_top2_margin": margins,
              "agree_cache_nocache": g_cache == g_nocache,
              "agree_cache_full_forward": g_cache == manual}
    with open(os.path.join(d, "greedy.json"), "w") as f:
        json.dump(greedy, f, indent=1)

    cases = [{"text": s, "ids": tk.encode(s, add_special_tokens=False).ids}
             for s in TOKENIZER_CASES]
    with open(os.path.join(d, "tokens.json"), "w", encoding="utf-8") as f:
        json.dump({"text": PROMPT_TEXT, "ids": prompt,
                   "full_encoding": ids, "tokenizer_cases": cases}, f,
                  ensure_ascii=False, indent=1)

    n_params = sum(t.numel() for t in tensors.values())
    manifest["models"][name] = {
        "architecture": spec["arch"], "seed": spec["seed"], "expert_layout": spec["layout"],
        "files": files, "load_info": load_info, "n_params": n_params, "logits_max_abs": stats["max_abs"],
        "logits_std": stats["std"], "distinct_expert_sets_per_layer": routing,
        "greedy_agree_cache_nocache": greedy["agree_cache_nocache"],
        "greedy_agree_cache_full_forward": greedy["agree_cache_full_forward"],
        "min_greedy_margin": min(margins),
        "mtp": (f"{spec.get('mtp_layers', 0)} random mtp.* layer(s) in the checkpoint; "
                "transformers' Qwen3NextForCausalLM has no MTP module (it skips mtp.* on load), "
                "so the logits and greedy tokens are the trunk's")
               if cfg.model_type == "qwen3_next" else None}
    print(json.dumps(manifest["models"][name]), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="phase", required=True)
    t = sub.add_parser("tokenizers")
    t.add_argument("--qwen-tokenizer", required=True)
    t.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    m = sub.add_parser("models")
    m.add_argument("--out", required=True)
    m.add_argument("--tokenizers", default=os.path.dirname(os.path.abspath(__file__)))
    for p in (t, m):
        p.add_argument("--only", default="", help="comma-separated model names (default: all)")
    args = ap.parse_args()
    phase_tokenizers(args) if args.phase == "tokenizers" else phase_models(args)


if __name__ == "__main__":
    main()
