"""GLM-4.5 / GLM-4.5-Air (`glm4moe`).

q/k/v biases (q/k norms where the file has them), partial RoPE, leading dense layers, a post-attention norm
before the FFN, a sigmoid router whose top-k adds a per-expert selection bias with weights renormalised and
scaled by expert_weights_scale, shared experts; the multi-token-prediction blocks after the last layer are
neither loaded nor run (llama.cpp: src/models/glm4-moe.cpp).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenwing.format.gguf_io import KV
from tokenwing.models.base import MoEModel
from tokenwing.models.factory import Factory, common_kv, sigmoid_routed_kv

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape


def _kv(s: ModelShape) -> dict[str, KV]:
    a = "glm4moe"
    kv = common_kv(s, a)
    kv.update(sigmoid_routed_kv(s, a))
    kv[f"{a}.rope.dimension_count"] = KV.u32(s.head_dim // 2)  # partial rotary, as GLM-4.5
    kv[f"{a}.nextn_predict_layers"] = KV.u32(0)
    return kv


def _check(s: ModelShape) -> None:
    if s.head_dim % 4:
        raise ValueError("glm4moe rotates half of each head: --head-dim must be a multiple of 4")


class Glm4MoE(MoEModel):
    arch = "glm4moe"
    factory = Factory(
        "GLM-4.5-MoE: q/k/v bias, partial RoPE, leading dense layers, sigmoid router with selection bias",
        _kv,
        _check,
        takes=frozenset({"n_dense_lead"}),
    )
    shared_experts = "required"
    shared_as_experts = True
    normalize_weights = False  # llama.cpp's default where the file has no expert_weights_norm
    routing_keys = True
    qk_norm = None
    qkv_bias = True
    ffn_norm = "post_attention_norm"
    sigmoid_router = True
    selection_bias = True
