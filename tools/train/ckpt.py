"""Hugging Face checkpoint folders for model.py's Qwen3Next: config.json and model.safetensors in
the hub layout of Qwen3-Next (routed experts one matrix each, mlp.experts.E.{gate,up,down}_proj.weight;
mtp.* beside the trunk), read and written by our own safetensors code (Debian 12 ships no
safetensors package; the format is an 8-byte header length, a JSON header, the raw tensors)."""
import json
import os
import re
import struct

import torch

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
NAMES = {v: k for k, v in DTYPES.items()}
EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def write_safetensors(path, tensors):
    header, blobs, pos = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + len(data)]}
        blobs.append(data)
        pos += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * ((-len(head)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, not one of {sorted(DTYPES)}")
        a, b = info["data_offsets"]
        t = torch.frombuffer(bytearray(data[a:b]), dtype=DTYPES[info["dtype"]]) if b > a else \
            torch.empty(0, dtype=DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    return out


def read_checkpoint(d):
    """All tensors of a folder (model.safetensors or its shards)."""
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no .safetensors file")
    out = {}
    for f in files:
        out.update(read_safetensors(os.path.join(d, f)))
    return out


def to_hub_layout(state):
    """Our fused experts (gate_up_proj [E, 2F, H], down_proj [E, H, F]) split one matrix per expert."""
    out = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base, f = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = v[e, :f]
                out[f"{base}{e}.up_proj.weight"] = v[e, f:]
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


def from_hub_layout(tensors):
    """The inverse of to_hub_layout; fused tensors pass through."""
    out, experts = {}, {}
    for k, v in tensors.items():
        m = EXPERT.match(k)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
        else:
            out[k] = v
    for base, per in experts.items():
        n = max(per) + 1
        if sorted(per) != list(range(n)):
            raise ValueError(f"{base}: experts {sorted(per)} are not 0..{n - 1}")
        out[base + ".gate_up_proj"] = torch.stack([torch.cat((per[e]["gate"], per[e]["up"])) for e in range(n)])
        out[base + ".down_proj"] = torch.stack([per[e]["down"] for e in range(n)])
    return out


def save(model, cfg, d, dtype=torch.float32):
    """config.json + model.safetensors (tied embeddings: no lm_head.weight, as HF saves them)."""
    os.makedirs(d, exist_ok=True)
    state = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    write_safetensors(os.path.join(d, "model.safetensors"), to_hub_layout(state))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def load(model_cls, d, with_mtp=True):
    """A model of model_cls from a folder; mtp.* tensors are loaded when the config asks for MTP
    (else left out, as transformers does)."""
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    if not with_mtp:
        cfg = dict(cfg, mtp_num_hidden_layers=0)
    model = model_cls(cfg)
    tensors = from_hub_layout(read_checkpoint(d))
    if not hasattr(model, "mtp"):
        tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    if cfg.get("tie_word_embeddings"):
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"{d}: checkpoint does not match the config: missing {missing}, unexpected {unexpected}")
    return model.eval(), cfg
