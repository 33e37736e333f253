"""Qwen3-MoE (`qwen3moe`): Qwen3-30B-A3B, Qwen3-235B-A22B.

A layer: RMSNorm → attention (per-head q/k RMSNorm, NEOX RoPE, GQA) → residual → RMSNorm → softmax router →
top-k → renormalised weights → SwiGLU experts → residual (llama.cpp: src/models/qwen3moe.cpp).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenwing.format.gguf_io import KV
from tokenwing.models.base import MoEModel
from tokenwing.models.factory import Factory, common_kv

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape


def _kv(s: ModelShape) -> dict[str, KV]:
    kv = common_kv(s, "qwen3moe")
    kv["qwen3moe.feed_forward_length"] = KV.u32(s.n_ff_exp)
    return kv


class Qwen3MoE(MoEModel):
    arch = "qwen3moe"
    factory = Factory("Qwen3-MoE: q/k RMSNorm, GQA, softmax top-k router, SwiGLU experts", _kv)
    qk_norm = True
