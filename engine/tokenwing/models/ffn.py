"""Dense and shared FFNs (SwiGLU, with a clamp where the family has one), and a layer's result (`Routed`,
`LayerOut`) with `moe_tail`, the default of a family's `tail`: experts + shared expert + residual."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from tokenwing.compute.ggml_lib import Tensor, ops


# ------------------------------------------------------------------------------------------------ FFNs
def swiglu(ctx: Any, g: Tensor, u: Tensor, limit: float = 0.0) -> Tensor:
    """silu(g) · u; with a `limit` (Ling 3.0's swiglu_clamp_*), min(silu(g), limit) · clamp(u, ±limit), in
    llama.cpp's ops (it takes a limit above 1e-6 as set)."""
    if limit > 1e-6:
        u = ops.ggml_clamp(ctx, u, -limit, limit)
        return ops.ggml_mul(ctx, ops.ggml_clamp(ctx, ops.ggml_silu(ctx, g), -math.inf, limit), u)
    return ops.ggml_swiglu_split(ctx, g, u)


def swiglu_ffn(ctx: Any, gate: Tensor, up: Tensor, down: Tensor, x: Tensor, limit: float = 0.0) -> Tensor:
    g = ops.ggml_mul_mat(ctx, gate, x)
    u = ops.ggml_mul_mat(ctx, up, x)
    return ops.ggml_mul_mat(ctx, down, swiglu(ctx, g, u, limit))


def dense_ffn(ctx: Any, w: dict[str, Tensor], x: Tensor, limit: float = 0.0) -> Tensor:
    return swiglu_ffn(ctx, w["ffn_gate"], w["ffn_up"], w["ffn_down"], x, limit)


def shared_expert(ctx: Any, w: dict[str, Tensor], x: Tensor, gated: bool, limit: float = 0.0) -> Tensor:
    """The shared expert(s) of a MoE layer; `gated`: scaled by sigmoid(ffn_gate_inp_shexp · x) (qwen2moe)."""
    out = swiglu_ffn(ctx, w["ffn_gate_shexp"], w["ffn_up_shexp"], w["ffn_down_shexp"], x, limit)
    if gated:
        out = ops.ggml_mul(ctx, out, ops.ggml_sigmoid(ctx, ops.ggml_mul_mat(ctx, w["ffn_gate_inp_shexp"], x)))
    return out


# -------------------------------------------------------------------------------------- a layer's result
@dataclass
class Routed:
    """A MoE layer's graph up to its routed experts, which the runtime computes from wherever they are."""

    cur: Tensor  # the experts' input (after the FFN norm)
    residual: Tensor  # added after the experts (the attention output plus the layer input)
    ids: Tensor  # I32 [k, n]: the selected experts, highest first
    weights: Tensor  # F32 [k, n]
    shared: Tensor | None = None  # the shared expert's output, when the layer has one

    def outputs(self) -> dict[str, Tensor]:
        return {f.name: t for f in fields(self) if (t := getattr(self, f.name)) is not None}


@dataclass
class LayerOut:
    """What a family's `layer` graph gives: the cache writes (to put in the graph first), and either the layer's
    output (a dense layer) or its routed part."""

    writes: list[Tensor]
    out: Tensor | None = None
    routed: Routed | None = None


def moe_tail(ctx: Any, experts: Tensor, shared: Tensor | None, residual: Tensor) -> Tensor:
    """The layer's output: (routed experts + shared expert) + residual, as llama.cpp's graph adds them."""
    total = experts if shared is None else ops.ggml_add(ctx, experts, shared)
    return ops.ggml_add(ctx, total, residual)


def moe_tail_array(experts: np.ndarray, shared: np.ndarray | None, residual: np.ndarray) -> np.ndarray:
    """`moe_tail` on arrays, in place in `experts` (the prompt path: same additions, same order)."""
    if shared is not None:
        experts += shared
    experts += residual
    return experts
