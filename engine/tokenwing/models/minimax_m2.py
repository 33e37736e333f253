"""MiniMax M2 / M2.5 (`minimax-m2`): MiniMax-M2, 230B parameters, 10B active.

A layer: RMSNorm → attention (GQA; the query and the key each RMS-normalised as one vector over all their heads,
not per head; NEOX RoPE on the first rope.dimension_count dims of each head) → residual → RMSNorm → sigmoid
router whose top-k adds a per-expert selection bias → weights renormalised, never scaled → SwiGLU experts →
residual. No shared expert, no dense layer (llama.cpp: src/models/minimax-m2.cpp).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenwing.compute.ggml_lib import Tensor
from tokenwing.errors import UnsupportedError
from tokenwing.format.gguf_io import KV
from tokenwing.models import common, specs
from tokenwing.models.base import MoEModel
from tokenwing.models.factory import Factory, common_kv
from tokenwing.models.hparams import HParams
from tokenwing.models.specs import Parts, TensorSpec

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape


def _kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes MiniMax M2: partial rotary dims, the sigmoid scoring function; llama.cpp
    reads no weights-norm or scale key for it (it always renormalises and never scales)."""
    a = "minimax-m2"
    kv = common_kv(s, a)
    kv[f"{a}.feed_forward_length"] = KV.u32(s.n_ff_exp)
    kv[f"{a}.rope.dimension_count"] = KV.u32(s.rot)
    kv[f"{a}.expert_gating_func"] = KV.u32(2)  # sigmoid
    return kv


def _check(s: ModelShape) -> None:
    if s.rot > s.head_dim or s.rot % 2:
        raise ValueError("minimax-m2's --n-rot must be even and at most --head-dim")


class MiniMaxM2(MoEModel):
    arch = "minimax-m2"
    factory = Factory(
        "MiniMax M2: GQA with whole-vector q/k RMSNorm, partial RoPE, sigmoid router with selection bias",
        _kv,
        _check,
        takes=frozenset({"n_rot"}),
    )
    selection_bias = True
    sigmoid_router = True

    @classmethod
    def make_router(cls, hp: HParams, has_bias: bool = True) -> common.Router:
        # llama.cpp takes the scoring function from the file (sigmoid in MiniMax's) and always renormalises;
        # it reads no expert_weights_norm or _scale key for this family, so neither applies here
        return common.Router(hp.n_expert_used, hp.gating != 1, True, 1.0, True)

    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        if hp.gating == 0:  # llama.cpp aborts on a MiniMax file without a scoring function
            raise UnsupportedError(f"{where}: {cls.arch}.expert_gating_func is missing (llama.cpp stops on it too)")
        if len(streamed) != hp.n_layer:
            raise UnsupportedError(f"{where}: every {cls.arch} layer routes experts; this file has dense layers")
        super().check(hp, shapes, streamed, where)

    @classmethod
    def attention_tensors(cls, hp: HParams, il: int, parts: Parts) -> list[TensorSpec]:
        p = f"blk.{il}."
        return [
            *specs.attention(hp, il, qk_norm=False, bias=False),
            TensorSpec(p + "attn_q_norm.weight", (hp.n_head * hp.head_dim,), "norm"),  # (all heads at once)
            TensorSpec(p + "attn_k_norm.weight", (hp.n_head_kv * hp.head_dim,), "norm"),
        ]

    def attention(
        self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache
    ) -> tuple[Tensor, list[Tensor]]:
        return common.attention(
            ctx, self.hp, self.w[il], x, at, common.kv_cache(kv), self.rope, False, False, whole_qk_norm=True
        )
