"""Qwen2-MoE (`qwen2moe`): Qwen1.5-MoE, Qwen2-57B-A14B.

As qwen3moe but with q/k/v biases and no q/k norm, top-k weights not renormalised, and a shared expert scaled
by a sigmoid gate of its own (llama.cpp: src/models/qwen2moe.cpp).
"""

from __future__ import annotations

from tokenwing.models.base import MoEModel


class Qwen2MoE(MoEModel):
    arch = "qwen2moe"
    shared_experts = "required"
    qkv_bias = True
    shared_gated = True
    normalize_weights = False
