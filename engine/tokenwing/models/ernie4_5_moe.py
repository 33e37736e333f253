"""ERNIE-4.5-MoE (`ernie4_5-moe`).

Leading dense layers, normal (not NEOX) RoPE, routed plus ungated shared experts (llama.cpp:
src/models/ernie4-5-moe.cpp).
"""

from __future__ import annotations

from tokenwing.compute.ggml_lib import ROPE_NORM
from tokenwing.models.base import MoEModel


class Ernie45MoE(MoEModel):
    arch = "ernie4_5-moe"
    shared_experts = "optional"
    rope_mode = ROPE_NORM
