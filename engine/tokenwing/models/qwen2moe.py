"""Qwen2-MoE (`qwen2moe`): Qwen1.5-MoE, Qwen2-57B-A14B.

As qwen3moe but with q/k/v biases and no q/k norm, top-k weights not renormalised, and a shared expert scaled
by a sigmoid gate of its own (llama.cpp: src/models/qwen2moe.cpp).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenwing.format.gguf_io import KV
from tokenwing.models.base import MoEModel
from tokenwing.models.factory import Factory, common_kv, shared_ff

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape


def _kv(s: ModelShape) -> dict[str, KV]:
    kv = common_kv(s, "qwen2moe")
    kv["qwen2moe.feed_forward_length"] = KV.u32(s.n_ff_dense)
    kv["qwen2moe.expert_shared_feed_forward_length"] = KV.u32(shared_ff(s))
    return kv


class Qwen2MoE(MoEModel):
    arch = "qwen2moe"
    factory = Factory("Qwen2-MoE: q/k/v bias, routed experts plus one sigmoid-gated shared expert", _kv)
    shared_experts = "required"
    qkv_bias = True
    shared_gated = True
    normalize_weights = False
