"""Qwen3-MoE (`qwen3moe`): Qwen3-30B-A3B, Qwen3-235B-A22B.

A layer: RMSNorm → attention (per-head q/k RMSNorm, NEOX RoPE, GQA) → residual → RMSNorm → softmax router →
top-k → renormalised weights → SwiGLU experts → residual (llama.cpp: src/models/qwen3moe.cpp).
"""

from __future__ import annotations

from tokenwing.models.base import MoEModel


class Qwen3MoE(MoEModel):
    arch = "qwen3moe"
    qk_norm = True
