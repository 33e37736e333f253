"""gpt-oss-120b / gpt-oss-20b (`gpt-oss`).

A layer (llama.cpp: src/models/openai-moe.cpp): RMSNorm → attention with q/k/v/output biases, NEOX RoPE with
YaRN, and a learned sink logit per head in every softmax; even layers attend over a sliding window of 128
positions, odd ones over everything (or the file's sliding_window_pattern) → residual → post-attention RMSNorm
→ a router with a bias on its logits, whose top-k are weighted by a softmax over the k selected logits → experts
with biases on all three projections and a clamped SwiGLU (swiglu_oai: α 1.702, limit 7) → residual. Experts
are MXFP4 in the released files; the rest in the file's types.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from tokenwing.compute.ggml_lib import ROPE_NEOX, Tensor, ops
from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import KV
from tokenwing.models import common
from tokenwing.models.base import MoEModel
from tokenwing.models.factory import Factory, common_kv, yarn_kv
from tokenwing.models.hparams import HParams
from tokenwing.models.specs import Parts, TensorSpec
from tokenwing.models.weights import ModelWeights

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape


def _kv(s: ModelShape) -> dict[str, KV]:
    a = "gpt-oss"
    kv = common_kv(s, a)
    kv[f"{a}.feed_forward_length"] = KV.u32(s.n_ff_exp)
    kv[f"{a}.attention.sliding_window"] = KV.u32(s.sliding_window)
    kv.update(yarn_kv(s, a))
    return kv


def _check(s: ModelShape) -> None:
    if s.sliding_window <= 0:
        raise ValueError("--sliding-window must be positive")


class GptOss(MoEModel):
    arch = "gpt-oss"
    factory = Factory(
        "gpt-oss: attention sinks, alternating sliding-window layers, YaRN, biases, swiglu_oai experts", _kv, _check
    )
    rope_mode = ROPE_NEOX
    ffn_norm = "post_attention_norm"
    qkv_bias = True
    normalize_weights = False
    softmax_selected = True

    def __init__(self, hp: HParams, weights: ModelWeights, streamed: list[int]) -> None:
        super().__init__(hp, weights, streamed)
        self.swa = [sliding(hp, il) for il in range(hp.n_layer)]

    @property
    def window(self) -> int:
        return self.hp.sliding_window if any(self.swa) else 0

    @classmethod
    def attention_tensors(cls, hp: HParams, il: int, parts: Parts) -> list[TensorSpec]:
        """Biased q/k/v/o projections (each bias after its matrix, as the converter writes them) and a sink logit
        per head."""
        p, e = f"blk.{il}.", hp.n_embd
        q, kv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        return [
            TensorSpec(p + "attn_norm.weight", (e,), "norm"),
            TensorSpec(p + "attn_q.weight", (e, q), "matrix"),
            TensorSpec(p + "attn_q.bias", (q,), "vector"),
            TensorSpec(p + "attn_k.weight", (e, kv), "matrix"),
            TensorSpec(p + "attn_k.bias", (kv,), "vector"),
            TensorSpec(p + "attn_v.weight", (e, kv), "matrix"),
            TensorSpec(p + "attn_v.bias", (kv,), "vector"),
            TensorSpec(p + "attn_output.weight", (q, e), "matrix"),
            TensorSpec(p + "attn_output.bias", (e,), "vector"),
            TensorSpec(p + "attn_sinks.weight", (hp.n_head,), "vector"),
        ]

    @classmethod
    def ffn_tensors(cls, hp: HParams, il: int, parts: Parts) -> list[TensorSpec]:
        """The routed experts with a bias on the router's logits and on each expert's three projections."""
        out = super().ffn_tensors(hp, il, parts)
        if il not in parts.moe_layers:
            return out
        p, ff, n = f"blk.{il}.", parts.ff_exp, hp.n_expert
        return [
            *out,
            TensorSpec(p + "ffn_gate_inp.bias", (n,), "vector"),
            TensorSpec(p + "ffn_gate_exps.bias", (ff, n), "vector"),
            TensorSpec(p + "ffn_up_exps.bias", (ff, n), "vector"),
            TensorSpec(p + "ffn_down_exps.bias", (hp.n_embd, n), "vector"),
        ]

    @classmethod
    def file_parts(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int]) -> Parts:
        """The experts' width is resident too, in their biases' shape (the first layer with experts')."""
        ff = shapes.get(f"blk.{min(streamed, default=-1)}.ffn_gate_exps.bias", (0,))[0]
        return dataclasses.replace(super().file_parts(hp, shapes, streamed), ff_exp=ff)

    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        super().check(hp, shapes, streamed, where)
        if any(sliding(hp, il) for il in range(hp.n_layer)) and hp.sliding_window <= 0:
            raise BadInputError(f"{where}: sliding-window layers need attention.sliding_window")

    def attention(
        self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache
    ) -> tuple[Tensor, list[Tensor]]:
        hp, w, n = self.hp, self.w[il], at.n
        q = ops.ggml_add(ctx, ops.ggml_mul_mat(ctx, w["attn_q"], x), w["attn_q.bias"])
        k = ops.ggml_add(ctx, ops.ggml_mul_mat(ctx, w["attn_k"], x), w["attn_k.bias"])
        v = ops.ggml_add(ctx, ops.ggml_mul_mat(ctx, w["attn_v"], x), w["attn_v.bias"])
        q = common.rope(ctx, ops.ggml_reshape_3d(ctx, q, hp.head_dim, hp.n_head, n), at.positions, self.rope)
        k = common.rope(ctx, ops.ggml_reshape_3d(ctx, k, hp.head_dim, hp.n_head_kv, n), at.positions, self.rope)
        mask = at.mask_swa if self.swa[il] else None
        scale = 1.0 / math.sqrt(hp.n_rot)
        cur, writes = common.attend(ctx, q, k, v, at, common.kv_cache(kv), scale, mask=mask, sinks=w["attn_sinks"])
        return ops.ggml_add(ctx, ops.ggml_mul_mat(ctx, w["attn_output"], cur), w["attn_output.bias"]), writes

    def routed(self, ctx: Any, il: int, cur: Tensor, residual: Tensor, shared: Tensor | None) -> common.Routed:
        w = self.w[il]
        logits = ops.ggml_add(ctx, ops.ggml_mul_mat(ctx, w["ffn_gate_inp"], cur), w["ffn_gate_inp.bias"])
        ids, weights = common.route(ctx, logits, self.router)
        return common.Routed(cur, residual, ids, weights, shared)

    def expert_ffn(self, il: int) -> common.ExpertFFN:
        w = self.w[il]
        return common.ExpertFFN(True, (w["ffn_gate_exps.bias"], w["ffn_up_exps.bias"], w["ffn_down_exps.bias"]))

    def router_bias_name(self, il: int) -> str | None:
        return f"blk.{il}.ffn_gate_inp.bias"  # added to the logits before the top-k


def sliding(hp: HParams, il: int) -> bool:
    """Whether layer il attends over the sliding window: the file's pattern, else llama.cpp's default for
    gpt-oss (every second layer, starting with the first)."""
    p = hp.swa_pattern
    if isinstance(p, tuple):
        return il < len(p) and p[il]
    n = p or 2
    return il % n < n - 1
