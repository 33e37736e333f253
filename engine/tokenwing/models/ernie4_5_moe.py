"""ERNIE-4.5-MoE (`ernie4_5-moe`).

Leading dense layers, normal (not NEOX) RoPE, routed plus ungated shared experts (llama.cpp:
src/models/ernie4-5-moe.cpp).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenwing.compute.ggml_lib import ROPE_NORM
from tokenwing.format.gguf_io import KV
from tokenwing.models.base import MoEModel
from tokenwing.models.factory import Factory, common_kv, shared_ff

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape


def _kv(s: ModelShape) -> dict[str, KV]:
    a = "ernie4_5-moe"
    kv = common_kv(s, a)
    kv[f"{a}.feed_forward_length"] = KV.u32(s.n_ff_dense)
    kv[f"{a}.leading_dense_block_count"] = KV.u32(s.n_dense_lead)
    kv[f"{a}.interleave_moe_layer_step"] = KV.u32(1)
    kv[f"{a}.expert_shared_feed_forward_length"] = KV.u32(shared_ff(s) if s.n_shared_exp else 0)
    return kv


class Ernie45MoE(MoEModel):
    arch = "ernie4_5-moe"
    factory = Factory(
        "ERNIE-4.5-MoE: leading dense layers, routed plus ungated shared experts",
        _kv,
        takes=frozenset({"n_dense_lead"}),
    )
    shared_experts = "optional"
    rope_mode = ROPE_NORM
