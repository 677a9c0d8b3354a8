"""Qwen3-Next in plain torch (1.13 to 2.x) for training: transformers' Qwen3NextForCausalLM with its
parameter names and its math (checked against transformers' own logits on tests/golden/qwen3next_*,
test_model.py), plus the multi-token-prediction block of the released checkpoints (mtp.*), which
transformers does not implement.

Our own module rather than transformers' because the training must also run where transformers
cannot (Debian 12's torch 1.13), and because it computes the routed experts densely (every expert,
weighted by the top-k router weights, zero elsewhere: the same sums and gradients as HF's sparse loop,
without a host sync per expert) and the gated delta rule by chunks with a triangular solve.

MTP (as vLLM and llama.cpp run Qwen3-Next's): slot i takes the trunk's final-normed hidden row h_i
and the embedding of token i+1, h' = fc([pre_fc_norm_embedding(e); pre_fc_norm_hidden(h)]), one
full-attention MoE decoder layer, mtp.norm, the shared LM head: the logits of token i+2.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


def layer_types(cfg):
    if "layer_types" in cfg:
        return list(cfg["layer_types"])
    k = cfg.get("full_attention_interval", 4)
    return ["linear_attention" if (i + 1) % k else "full_attention" for i in range(cfg["num_hidden_layers"])]


class RMSNorm(nn.Module):
    """Qwen3Next's RMSNorm: scales by (1 + w), w starting at 0, computed in float32."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """The DeltaNet output norm: rmsnorm(x) * w * silu(z), w starting at 1."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y * F.silu(z.float())).type_as(x)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_tables(n_rot, theta, positions):
    """cos/sin of NEOX rotary over the first n_rot dims, in float32 whatever the autocast."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, n_rot, 2, dtype=torch.float32, device=positions.device) / n_rot))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    """Gated attention: q_proj gives [query | gate] per head, per-head q/k norms, partial RoPE,
    output * sigmoid(gate)."""

    def __init__(self, cfg):
        super().__init__()
        H, hd = cfg["hidden_size"], cfg["head_dim"]
        self.nh, self.nkv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], hd
        self.q_proj = nn.Linear(H, self.nh * hd * 2, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, cfg["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, cfg["rms_norm_eps"])

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q, gate = torch.chunk(self.q_proj(x).view(B, T, self.nh, 2 * self.hd), 2, dim=-1)
        gate = gate.reshape(B, T, self.nh * self.hd)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        n_rot = cos.shape[-1]
        q = torch.cat((q[..., :n_rot] * cos + rotate_half(q[..., :n_rot]) * sin, q[..., n_rot:]), dim=-1)
        k = torch.cat((k[..., :n_rot] * cos + rotate_half(k[..., :n_rot]) * sin, k[..., n_rot:]), dim=-1)
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1).to(q.dtype)
        k = k.to(q.dtype)
        if hasattr(F, "scaled_dot_product_attention"):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # torch 1.13: the same softmax(q k^T / sqrt(d)) v, causal
            s = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            o = torch.softmax(s.masked_fill(mask, float("-inf")).float(), dim=-1).to(q.dtype) @ v
        o = o.transpose(1, 2).reshape(B, T, self.nh * self.hd)
        return self.o_proj(o * torch.sigmoid(gate))


def gated_delta_rule(q, k, v, g, beta, chunk=64):
    """o_t = S_t^T q_t / sqrt(dk) with S_t = e^{g_t} S_{t-1} + k_t (beta_t (v_t - e^{g_t} S_{t-1}^T k_t))^T,
    S_0 = 0, by chunks: within a chunk the corrections U solve the unit lower-triangular system
    (I + A) U = beta V - (beta e^G K) S_0, A_ij = beta_i e^{G_i - G_j} k_i.k_j (j < i), G the
    in-chunk cumulative g. q, k: [B, T, Hv, dk] (L2-normalised); v: [B, T, Hv, dv]; g, beta: [B, T, Hv]."""
    with torch.autocast(device_type=v.device.type, enabled=False):  # float32 throughout: bf16 products would blur the decays
        return _chunked_delta_rule(q, k, v, g, beta, chunk).to(v.dtype)


def _chunked_delta_rule(q, k, v, g, beta, chunk):
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))
    B, Hh, T, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:  # beta = 0 and g = 0 there: padded steps change nothing before them
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // chunk
    q = (q * dk ** -0.5).view(B, Hh, n, chunk, dk)
    k = k.view(B, Hh, n, chunk, dk)
    v = v.view(B, Hh, n, chunk, dv)
    G = g.view(B, Hh, n, chunk).cumsum(-1)
    beta = beta.view(B, Hh, n, chunk, 1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(causal, G[..., :, None] - G[..., None, :], torch.full_like(G[..., :1, None], float("-inf")))
    decay = decay.exp()
    kb = k * beta
    A = (kb @ k.transpose(-1, -2)) * decay
    W = torch.linalg.solve_triangular(A, kb * G.exp()[..., None], upper=False, unitriangular=True)
    U0 = torch.linalg.solve_triangular(A, v * beta, upper=False, unitriangular=True)
    QK = (q @ k.transpose(-1, -2)) * decay
    S = q.new_zeros(B, Hh, dk, dv)
    outs = []
    for c in range(n):
        U = U0[:, :, c] - W[:, :, c] @ S
        Gc = G[:, :, c]
        outs.append((q[:, :, c] * Gc.exp()[..., None]) @ S + QK[:, :, c] @ U)
        last = Gc[..., -1:]
        S = S * last.exp()[..., None] + (k[:, :, c] * (last - Gc).exp()[..., None]).transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2).reshape(B, Hh, n * chunk, dv)[:, :, :T]
    return o.transpose(1, 2)


def l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        H = cfg["hidden_size"]
        self.nk, self.nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        self.dk, self.dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        self.r = self.nv // self.nk
        key_dim, value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * key_dim + value_dim
        K = cfg["linear_conv_kernel_dim"]
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, K, groups=self.conv_dim, padding=K - 1, bias=False)
        self.in_proj_qkvz = nn.Linear(H, 2 * key_dim + 2 * value_dim, bias=False)
        self.in_proj_ba = nn.Linear(H, 2 * self.nv, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.nv).uniform_(0, 16)))
        self.norm = GatedRMSNorm(self.dv, cfg["rms_norm_eps"])
        self.out_proj = nn.Linear(value_dim, H, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        nk, r, dk, dv = self.nk, self.r, self.dk, self.dv
        # in_proj_qkvz rows are grouped per key head: [q (dk), k (dk), v (r dv), z (r dv)].
        q, k, v, z = torch.split(self.in_proj_qkvz(x).view(B, T, nk, 2 * dk + 2 * r * dv), [dk, dk, r * dv, r * dv], -1)
        b, a = torch.split(self.in_proj_ba(x).view(B, T, nk, 2 * r), [r, r], -1)
        mixed = torch.cat((q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)), -1).transpose(1, 2)
        mixed = F.silu(self.conv1d(mixed)[:, :, :T]).transpose(1, 2)
        q, k, v = torch.split(mixed, [nk * dk, nk * dk, self.nv * dv], -1)
        q = q.reshape(B, T, nk, dk).repeat_interleave(r, dim=2)
        k = k.reshape(B, T, nk, dk).repeat_interleave(r, dim=2)
        v = v.reshape(B, T, self.nv, dv)
        beta = b.reshape(B, T, self.nv).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(B, T, self.nv).float() + self.dt_bias)
        o = gated_delta_rule(l2norm(q.float()), l2norm(k.float()), v, g, beta)
        o = self.norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(B, T, self.nv * dv)
        return self.out_proj(o)


class Router(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg["num_experts"], cfg["hidden_size"]))


class Experts(nn.Module):
    """transformers v5's fused layout: gate_up_proj [E, 2F, H] (gate rows first), down_proj [E, H, F]."""

    def __init__(self, cfg):
        super().__init__()
        E, H, Fe = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * Fe, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, Fe))


class MLP(nn.Module):
    def __init__(self, H, Fm):
        super().__init__()
        self.gate_proj = nn.Linear(H, Fm, bias=False)
        self.up_proj = nn.Linear(H, Fm, bias=False)
        self.down_proj = nn.Linear(Fm, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nn.Module):
    """Softmax router, top-k renormalised, every expert computed densely and weighted (zero
    outside the top k), plus the sigmoid-gated shared expert. Returns the output and the
    Switch load-balancing term of this layer."""

    def __init__(self, cfg):
        super().__init__()
        self.k, self.E, self.Fe = cfg["num_experts_per_tok"], cfg["num_experts"], cfg["moe_intermediate_size"]
        self.norm_topk = cfg["norm_topk_prob"]
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = MLP(cfg["hidden_size"], cfg["shared_expert_intermediate_size"])
        self.shared_expert_gate = nn.Linear(cfg["hidden_size"], 1, bias=False)

    def forward(self, x):
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        probs = torch.softmax(F.linear(h, self.gate.weight).float(), dim=-1)
        top_w, top_i = probs.topk(self.k, dim=-1)
        if self.norm_topk:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        weights = torch.zeros_like(probs).scatter(1, top_i, top_w).to(h.dtype)
        gu = F.linear(h, self.experts.gate_up_proj.reshape(-1, shape[-1])).view(-1, self.E, 2 * self.Fe)
        act = F.silu(gu[..., :self.Fe]) * gu[..., self.Fe:] * weights[..., None]
        down = self.experts.down_proj.permute(0, 2, 1).reshape(self.E * self.Fe, shape[-1])
        y = act.reshape(-1, self.E * self.Fe) @ down.to(act.dtype)
        y = y + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        chosen = torch.zeros_like(probs).scatter(1, top_i, 1.0)
        balance = self.E * (chosen.mean(0) * probs.mean(0)).sum()
        return y.view(shape), balance, top_i


class DecoderLayer(nn.Module):
    def __init__(self, cfg, kind):
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.mlp = SparseMoe(cfg)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, x, cos, sin):
        h = self.input_layernorm(x)
        h = self.linear_attn(h) if self.kind == "linear_attention" else self.self_attn(h, cos, sin)
        x = x + h
        y, balance, chosen = self.mlp(self.post_attention_layernorm(x))
        return x + y, balance, chosen


class Trunk(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in layer_types(cfg))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class Mtp(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        H = cfg["hidden_size"]
        self.pre_fc_norm_embedding = RMSNorm(H, cfg["rms_norm_eps"])
        self.pre_fc_norm_hidden = RMSNorm(H, cfg["rms_norm_eps"])
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, "full_attention")])
        self.norm = RMSNorm(H, cfg["rms_norm_eps"])


class Qwen3Next(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = Trunk(cfg)
        if not cfg.get("tie_word_embeddings", False):
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        if cfg.get("mtp_num_hidden_layers", 0):
            if cfg["mtp_num_hidden_layers"] != 1:
                raise ValueError("mtp_num_hidden_layers: only 1 MTP layer is built")
            self.mtp = Mtp(cfg)
        hd = cfg["head_dim"]
        rope = cfg["rope_parameters"]
        self.n_rot = int(hd * rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        self.rope_theta = float(rope["rope_theta"])

    def head(self, h):
        w = self.model.embed_tokens.weight if not hasattr(self, "lm_head") else self.lm_head.weight
        return F.linear(h, w)

    def forward(self, ids, with_mtp=False):
        """Logits [B, T, V]; with_mtp: also the MTP logits [B, T-1, V] (slot i: token i+2), the mean
        load-balancing term and every layer's chosen experts (trunk then MTP)."""
        T = ids.shape[1]
        cos, sin = rope_tables(self.n_rot, self.rope_theta, torch.arange(T, device=ids.device))
        x = self.model.embed_tokens(ids)
        balances, chosen = [], []
        for layer in self.model.layers:
            x, bal, ch = layer(x, cos, sin)
            balances.append(bal)
            chosen.append(ch)
        h = self.model.norm(x)
        logits = self.head(h)
        if not with_mtp:
            return logits
        mtp_logits = None
        if hasattr(self, "mtp"):
            m = self.mtp
            e = m.pre_fc_norm_embedding(self.model.embed_tokens(ids[:, 1:]))
            y = m.fc(torch.cat((e, m.pre_fc_norm_hidden(h[:, :-1])), dim=-1))
            y, bal, ch = m.layers[0](y, cos[:T - 1], sin[:T - 1])
            balances.append(bal)
            chosen.append(ch)
            mtp_logits = self.head(m.norm(y))
        return logits, mtp_logits, torch.stack(balances).mean(), chosen


def init_weights(model, seed, std=0.02):
    """Seeded init: normal(0, std) matrices and embeddings, the residual outputs scaled by
    1/sqrt(2 * layers) (GPT-2's), norms as their modules start them; DeltaNet's A_log = log U(1, 16)
    and dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] (Mamba-2's and the Gated DeltaNet
    paper's: slow decays at the start; transformers' dt_bias = 1 makes every state forget at once)."""
    gen = torch.Generator().manual_seed(seed)
    n_layers = len(model.model.layers) + (1 if hasattr(model, "mtp") else 0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=gen)))
            elif name.endswith("dt_bias"):
                dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(p.shape, generator=gen))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            else:
                s = std / math.sqrt(2 * n_layers) if name.endswith(("o_proj.weight", "out_proj.weight",
                                                                      "down_proj", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * s)
