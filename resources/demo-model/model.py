"""The demo model in PyTorch (llama.cpp's qwen3moe, ggml's RoPE scaling), and its weights under the GGUF's names."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from recipe import (
    CFG,
    Config,
)


def rope_scaling(scaling: str, factor: float, n_ctx_orig: int) -> tuple[np.ndarray, float]:
    """RoPE scaling as ggml's rope applies it (ggml-cpu's rope_yarn): each rotary pair's multiplier of its angle
    and the multiplier of cos and sin. Linear: every angle / factor. YaRN (ext_factor 1, llama.cpp's beta_fast
    32 and beta_slow 1): the pairs that turn more than 32 times in n_ctx_orig positions keep their angle, those
    that turn less than once are divided by the factor, a linear ramp between; cos and sin x (1 + 0.1 ln factor)."""
    half = CFG.head_dim // 2
    if scaling == "none":
        return np.ones(half), 1.0
    if scaling == "linear":
        return np.full(half, 1.0 / factor), 1.0

    def corr_dim(n_rot: float) -> float:  # ggml_rope_yarn_corr_dim
        return CFG.head_dim * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(CFG.rope_base))

    low = max(0.0, math.floor(corr_dim(32.0)))
    high = min(CFG.head_dim - 1.0, math.ceil(corr_dim(1.0)))
    ramp = 1 - np.clip((np.arange(half) - low) / max(0.001, high - low), 0, 1)  # 1: extrapolate, 0: interpolate
    return (1 - ramp) / factor + ramp, 1 + 0.1 * math.log(factor)


def build_model(cfg: Config, scaling: str = "none", factor: float = 1.0) -> Any:
    """The qwen3moe forward pass in PyTorch (imported lazily: only `train` and `export` need torch); `scaling`
    and `factor`: the RoPE scaling the GGUF declares (training: none)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    # Export only: round the inputs of the quantised matrices as ggml's CPU kernels do (activations become
    # Q8_0 blocks: 32 values, scale max|x|/127 stored as f16), so the golden tokens are llama.cpp's math.
    act_q8 = {"on": False}

    def aq(x: torch.Tensor) -> torch.Tensor:
        if not act_q8["on"]:
            return x
        xb = x.reshape(*x.shape[:-1], -1, 32)
        amax = xb.abs().amax(-1, keepdim=True)
        d = amax / 127
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))  # ggml's x86 path: 127/max, half-even
        q = torch.round(xb * inv)
        return (q * d.half().float()).reshape(x.shape)

    class RMSNorm(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_eps) * self.weight

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # NEOX style: dimension i pairs with i + head_dim/2.
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d, h = cfg.head_dim, cfg.n_head
            self.q = nn.Linear(cfg.n_embd, h * d, bias=False)
            self.k = nn.Linear(cfg.n_embd, cfg.n_head_kv * d, bias=False)
            self.v = nn.Linear(cfg.n_embd, cfg.n_head_kv * d, bias=False)
            self.o = nn.Linear(h * d, cfg.n_embd, bias=False)
            self.q_norm = RMSNorm(d)
            self.k_norm = RMSNorm(d)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            d = cfg.head_dim
            x = aq(x)
            q = self.q_norm(self.q(x).view(b, t, cfg.n_head, d)).transpose(1, 2)
            k = self.k_norm(self.k(x).view(b, t, cfg.n_head_kv, d)).transpose(1, 2)
            v = self.v(x).view(b, t, cfg.n_head_kv, d).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            rep = cfg.n_head // cfg.n_head_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(aq(y.transpose(1, 2).reshape(b, t, cfg.n_head * d)))

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            e, f, n = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
            self.router = nn.Linear(n, e, bias=False)
            # One parameter per expert matrix: slicing a stacked tensor makes autograd fill whole-size gradients.
            self.gate = nn.ParameterList([nn.Parameter(torch.randn(f, n) * 0.02) for _ in range(e)])
            self.up = nn.ParameterList([nn.Parameter(torch.randn(f, n) * 0.02) for _ in range(e)])
            down_std = 0.02 / math.sqrt(2 * cfg.n_layer)
            self.down = nn.ParameterList([nn.Parameter(torch.randn(n, f) * down_std) for _ in range(e)])

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            shape = x.shape
            x = x.reshape(-1, shape[-1])
            probs = F.softmax(self.router(x).float(), dim=-1)
            top_w, top_i = probs.topk(cfg.n_expert_used, dim=-1)
            top_w = top_w / top_w.sum(-1, keepdim=True)  # norm_topk_prob
            flat = top_i.reshape(-1)
            order = flat.argsort(stable=True)
            tokens = order // cfg.n_expert_used
            weights = top_w.reshape(-1)[order].unsqueeze(1)
            counts = torch.bincount(flat, minlength=cfg.n_expert)
            # Tokens grouped by expert into a padded [expert, slot, n_embd] batch: three batched matmuls per
            # layer instead of three per expert (few, large kernels: fast, and robust to a busy CPU).
            experts = flat[order]
            slot = torch.arange(flat.numel()) - (counts.cumsum(0) - counts)[experts]
            xs = x.new_zeros(cfg.n_expert, int(counts.max()), x.shape[1])
            xs[experts, slot] = x[tokens]
            gate, up, down = torch.stack(list(self.gate)), torch.stack(list(self.up)), torch.stack(list(self.down))
            xs = aq(xs)
            h = F.silu(torch.bmm(xs, gate.transpose(1, 2))) * torch.bmm(xs, up.transpose(1, 2))
            y = torch.bmm(aq(h), down.transpose(1, 2))[experts, slot]
            out = torch.zeros_like(x).index_add_(0, tokens, y * weights)
            # Switch-style balance loss: fraction routed to each expert x mean router probability.
            frac = counts.float() / flat.numel()
            balance = cfg.n_expert * (frac * probs.mean(0)).sum()
            return out.view(shape), balance

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn_norm = RMSNorm(cfg.n_embd)
            self.attn = Attention()
            self.ffn_norm = RMSNorm(cfg.n_embd)
            self.moe = MoE()

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = x + self.attn(self.attn_norm(x), cos, sin)
            y, balance = self.moe(self.ffn_norm(x))
            return x + y, balance

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.blocks = nn.ModuleList([Block() for _ in range(cfg.n_layer)])
            self.norm = RMSNorm(cfg.n_embd)
            self.output = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
            for name, p in self.named_parameters():
                if name.endswith((".q.weight", ".k.weight", ".v.weight", "router.weight", "output.weight")):
                    nn.init.normal_(p, std=0.02)
                elif name.endswith(".o.weight"):
                    nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))
            nn.init.normal_(self.embed.weight, std=0.02)
            half = cfg.head_dim // 2
            inv = cfg.rope_base ** (-torch.arange(half, dtype=torch.float64) * 2 / cfg.head_dim)
            mult, self.mscale = rope_scaling(scaling, factor, cfg.seq_len)
            self.register_buffer("inv_freq", inv.float(), persistent=False)
            self.register_buffer("freq_mult", torch.from_numpy(mult).float(), persistent=False)

        def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            t = ids.shape[1]
            ang = torch.arange(t, dtype=torch.float32).unsqueeze(1) * self.inv_freq.unsqueeze(0)
            if scaling != "none":
                ang = ang * self.freq_mult.unsqueeze(0)
            cos, sin = ang.cos() * self.mscale, ang.sin() * self.mscale
            x = self.embed(ids)
            balance = torch.zeros((), dtype=torch.float32)
            for block in self.blocks:
                x, b = block(x, cos, sin)
                balance = balance + b
            return self.output(aq(self.norm(x))), balance / cfg.n_layer

    model = Model()
    model.act_q8 = act_q8
    return model


def gguf_tensors(model: Any) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's qwen3moe names, as numpy arrays in C order (rows = GGUF ne1...)."""
    import torch

    def a(t: Any) -> np.ndarray:
        return np.ascontiguousarray(t.detach().float().numpy())

    out = {"token_embd.weight": a(model.embed.weight)}
    for i, b in enumerate(model.blocks):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = a(b.attn_norm.weight)
        out[p + "attn_q.weight"] = a(b.attn.q.weight)
        out[p + "attn_k.weight"] = a(b.attn.k.weight)
        out[p + "attn_v.weight"] = a(b.attn.v.weight)
        out[p + "attn_output.weight"] = a(b.attn.o.weight)
        out[p + "attn_q_norm.weight"] = a(b.attn.q_norm.weight)
        out[p + "attn_k_norm.weight"] = a(b.attn.k_norm.weight)
        out[p + "ffn_norm.weight"] = a(b.ffn_norm.weight)
        out[p + "ffn_gate_inp.weight"] = a(b.moe.router.weight)
        out[p + "ffn_gate_exps.weight"] = a(torch.stack(list(b.moe.gate)))
        out[p + "ffn_up_exps.weight"] = a(torch.stack(list(b.moe.up)))
        out[p + "ffn_down_exps.weight"] = a(torch.stack(list(b.moe.down)))
    out["output_norm.weight"] = a(model.norm.weight)
    out["output.weight"] = a(model.output.weight)
    return out


def load_tensors(model: Any, tensors: dict[str, np.ndarray]) -> None:
    """The inverse of gguf_tensors (used to run PyTorch on the exact, dequantised weights of the file)."""
    import torch

    def put(p: Any, x: np.ndarray) -> None:
        with torch.no_grad():
            p.copy_(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).view(p.shape))

    put(model.embed.weight, tensors["token_embd.weight"])
    for i, b in enumerate(model.blocks):
        p = f"blk.{i}."
        for name, param in [
            ("attn_norm", b.attn_norm.weight),
            ("attn_q", b.attn.q.weight),
            ("attn_k", b.attn.k.weight),
            ("attn_v", b.attn.v.weight),
            ("attn_output", b.attn.o.weight),
            ("attn_q_norm", b.attn.q_norm.weight),
            ("attn_k_norm", b.attn.k_norm.weight),
            ("ffn_norm", b.ffn_norm.weight),
            ("ffn_gate_inp", b.moe.router.weight),
        ]:
            put(param, tensors[p + name + ".weight"])
        for name, plist in [("ffn_gate_exps", b.moe.gate), ("ffn_up_exps", b.moe.up), ("ffn_down_exps", b.moe.down)]:
            for e, param in enumerate(plist):
                put(param, tensors[p + name + ".weight"][e])
    put(model.norm.weight, tensors["output_norm.weight"])
    put(model.output.weight, tensors["output.weight"])
