"""MiMo-V2-Flash (`mimo2`): Xiaomi's 309B / 15B-active MoE model (llama.cpp: src/models/mimo2.cpp).

A layer: RMSNorm → attention → residual → RMSNorm → a dense SwiGLU FFN (the first layer) or a sigmoid router
whose top-k adds a per-expert selection bias (exp_probs_b), weights renormalised and never scaled (llama.cpp reads
no expert_weights_scale for mimo2) → SwiGLU experts → residual. No shared expert, no q/k norms, no biases.

Attention is hybrid: the file's per-layer sliding_window_pattern marks the sliding-window layers (MiMo: five of
six), which attend over the last attention.sliding_window positions (128), rotate by rope.freq_base_swa (10,000;
llama.cpp's default where a file has none) unscaled, and have their own KV head count (head_count_kv is per
layer: 8 there, 4 in the full layers) and, where the file has them, a learned sink logit per head (MiMo's
sliding-window layers have them, its full ones not). Keys are key_length wide (192), values value_length (128);
NEOX RoPE on the first rope.dimension_count dims (64) at 1/√key_length; the attention output, after its projection,
is multiplied by attention.value_scale where the file has one other than 1 (MiMo: 0.707). q, k and v come from
their own projections or one fused attn_qkv (MiMo-V2.5's converter writes that: each token's query, key and value
rows in turn).

Sliding-window layers keep a full-context cache masked to the window, as gpt-oss's and Gemma 4's do (exact;
llama.cpp's iSWA cache keeps only the window). The next-token-prediction blocks the converter appends (3) are kept
in the file and never run, as every family's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from tokenwing.compute.ggml_lib import ROPE_NEOX, Tensor, ops
from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import KV, ValueType
from tokenwing.models import common, specs
from tokenwing.models.base import MoEModel
from tokenwing.models.factory import Factory, common_kv
from tokenwing.models.hparams import HParams, per_layer
from tokenwing.models.keys import Key, read_keys, write_keys
from tokenwing.models.specs import Parts, TensorSpec
from tokenwing.models.weights import ModelWeights

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape

# The family's own keys (models/keys.py: read here, written by the factory from the same table); the per-layer KV
# heads, the window and its pattern are shared keys (`read_hparams`)
KEYS: dict[str, Key] = {
    "rope_base_swa": Key("rope.freq_base_swa", "f32", 10000.0),  # (llama.cpp's default: llama-hparams.h)
    "value_scale": Key("attention.value_scale", "f32", 1.0),  # (1: none, as llama.cpp ignores 1)
}
# Keys of another head or rotary size for the sliding-window layers (by the HParams field they would differ from):
# MiMo's converter asserts they equal the full layers' and writes none; llama.cpp's mimo2 graph would take the
# full layers' sizes for them anyway, so a file where one differs is refused
OTHER_SIZES = {
    "attention.key_length_swa": "head_dim",
    "attention.value_length_swa": "head_dim_v",
    "rope.dimension_count_swa": "n_rot",
}
VALUE_SCALE = 0.707  # MiMo-V2-Flash's attention_value_scale (the factory writes it)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Per layer: whether it attends over the window, and its KV heads."""

    swa: tuple[bool, ...]
    head_kv: tuple[int, ...]


def layout(hp: HParams, where: str = "the model") -> Layout:
    """The window pattern (one flag per layer: llama.cpp's mimo2 loader requires the list) and the per-layer KV
    heads (a list, or one count for every layer), checked; one line naming the key otherwise."""
    pattern = hp.swa_pattern
    if not isinstance(pattern, tuple) or len(pattern) < hp.n_layer:
        raise BadInputError(f"{where}: {hp.arch}.attention.sliding_window_pattern must have one flag per layer")
    head_kv = per_layer(hp, "attention.head_count_kv", hp.n_head_kv)
    if len(head_kv) < hp.n_layer or min(head_kv) <= 0 or any(hp.n_head % h for h in head_kv):
        raise BadInputError(f"{where}: {hp.arch}.attention.head_count_kv must divide head_count in every layer")
    swa = tuple(pattern[: hp.n_layer])
    if any(swa) and hp.sliding_window <= 0:
        raise BadInputError(f"{where}: {hp.arch}'s sliding-window layers need attention.sliding_window")
    return Layout(swa, head_kv)


def full_layer(s: ModelShape, il: int) -> bool:
    """The factory's pattern, MiMo-V2-Flash's hybrid_layer_pattern: the first layer full, then every
    full_attention_interval-th (MiMo: layers 5, 11, ..., 47 of 48; the rest sliding-window)."""
    return il == 0 or (il + 1) % s.full_attention_interval == 0


def _kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes MiMo-V2-Flash (MimoV2Model): KV heads and the window pattern per block
    (INT32 flags, as its list of ints is written), key and value head sizes, partial rotary dims, both rope bases,
    the value scale, the dense layer's FFN width; no gating or weights keys (llama.cpp reads none for mimo2)."""
    a = "mimo2"
    kv = common_kv(s, a)
    full = [full_layer(s, il) for il in range(s.n_block)]
    kv_full = s.head_kv_full or max(1, s.n_head_kv // 2)
    kv[f"{a}.attention.head_count_kv"] = KV.array(ValueType.UINT32, [kv_full if f else s.n_head_kv for f in full])
    kv[f"{a}.attention.sliding_window_pattern"] = KV.array(ValueType.INT32, [0 if f else 1 for f in full])
    kv[f"{a}.attention.sliding_window"] = KV.u32(s.sliding_window)
    kv[f"{a}.attention.value_length"] = KV.u32(s.v_dim)
    kv[f"{a}.rope.dimension_count"] = KV.u32(s.rot)
    kv[f"{a}.feed_forward_length"] = KV.u32(s.n_ff_dense)
    return kv | write_keys(KEYS, a, {"rope_base_swa": 10000.0, "value_scale": VALUE_SCALE})


def _check(s: ModelShape) -> None:
    """What llama.cpp's mimo2 loader and graph take."""
    kv_full = s.head_kv_full or max(1, s.n_head_kv // 2)
    if s.n_head % kv_full:
        raise ValueError("mimo2's --n-head must be a multiple of --head-kv-full")
    if s.rot > s.head_dim or s.rot % 2:
        raise ValueError("mimo2's --n-rot must be even and at most --head-dim")
    if s.sliding_window <= 0 or s.full_attention_interval < 1:
        raise ValueError("mimo2 needs a positive --sliding-window and --full-attention-interval")


def _tensors(s: ModelShape, hp: HParams, parts: Parts) -> list[TensorSpec]:
    """The family's list, with the sinks where MiMo-V2-Flash has them: its sliding-window layers only."""
    return [
        t
        for t in Mimo2.tensors(hp, parts)
        if not (t.name.endswith("attn_sinks.weight") and full_layer(s, t.block or 0))
    ]


class Mimo2(MoEModel):
    arch = "mimo2"
    factory = Factory(
        "MiMo-V2-Flash: hybrid sliding-window (with sinks) and full attention of their own KV heads and rope bases, "
        "values narrower than keys and scaled, partial RoPE, a dense first layer, sigmoid router with selection bias",
        _kv,
        _check,
        tensors=_tensors,
        takes=frozenset({"n_dense_lead", "n_rot", "v_head_dim"}),
    )
    rope_mode = ROPE_NEOX
    selection_bias = None  # (exp_probs_b: llama.cpp's TENSOR_NOT_REQUIRED; MiMo's files have it)

    def __init__(self, hp: HParams, weights: ModelWeights, streamed: list[int]) -> None:
        super().__init__(hp, weights, streamed)
        self.layout = layout(hp)
        own = read_keys(KEYS, hp, "the model")
        self.value_scale = own["value_scale"]
        # The sliding-window layers' RoPE: their base, unscaled (llama.cpp: rope_freq_scale_train_swa 1)
        self.rope_swa = dataclasses.replace(self.rope, base=own["rope_base_swa"], freq_scale=1.0)

    @classmethod
    def make_router(cls, hp: HParams, has_bias: bool = True) -> common.Router:
        # llama.cpp's mimo2 graph: sigmoid and renormalised whatever the file says; its scale is the unread
        # expert_weights_scale (0: none). Groups as every family's (build_moe_ffn reads expert_group_count)
        return common.Router(hp.n_expert_used, True, True, 1.0, has_bias, hp.n_expert_groups, hp.n_group_used)

    @property
    def window(self) -> int:
        return self.hp.sliding_window if any(self.layout.swa) else 0

    # ------------------------------------------------------------------------------------------- tensors
    @classmethod
    def tensors(cls, hp: HParams, parts: Parts) -> list[TensorSpec]:
        """llama.cpp's loader (load_arch_tensors): per layer its own KV heads, keys of key_length and values of
        value_length, q/k/v split or one fused attn_qkv (`parts.forms`), a sink logit per head (optional), then a
        dense FFN or the router, its selection bias and the experts; the output never tied."""
        lay, e = layout(hp), hp.n_embd
        first, last = specs.head(hp)
        out = list(first)
        for il in range(hp.n_layer):
            p, nkv = f"blk.{il}.", lay.head_kv[il]
            q, k, v = hp.n_head * hp.head_dim, nkv * hp.head_dim, nkv * hp.head_dim_v
            out.append(TensorSpec(p + "attn_norm.weight", (e,), "norm"))
            if "attn_qkv" in parts.forms:
                out.append(TensorSpec(p + "attn_qkv.weight", (e, q + k + v), "matrix"))
            else:
                out += [
                    TensorSpec(p + "attn_q.weight", (e, q), "matrix"),
                    TensorSpec(p + "attn_k.weight", (e, k), "matrix"),
                    TensorSpec(p + "attn_v.weight", (e, v), "matrix"),
                ]
            out += [
                TensorSpec(p + "attn_output.weight", (hp.n_head * hp.head_dim_v, e), "matrix"),
                TensorSpec(p + "attn_sinks.weight", (hp.n_head,), "vector", optional=True),
            ]
            out += cls.ffn_tensors(hp, il, parts)
        return [*out, last[0], dataclasses.replace(last[1], optional=False)]  # (llama.cpp: the output required)

    @classmethod
    def file_parts(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int]) -> Parts:
        """The base's, and the fused attn_qkv where the file's first layer has one."""
        out = super().file_parts(hp, shapes, streamed)
        return dataclasses.replace(out, forms=frozenset({"attn_qkv"} if "blk.0.attn_qkv.weight" in shapes else ()))

    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        layout(hp, where)
        read_keys(KEYS, hp, where)
        for key, field in OTHER_SIZES.items():
            if key in hp.keys and hp.keys[key] != getattr(hp, field):
                raise BadInputError(f"{where}: {cls.arch}.{key}: sliding-window layers of another size are not run")
        super().check(hp, shapes, streamed, where)

    @classmethod
    def kv_layer(cls, hp: HParams, il: int) -> common.KVSpec:
        """K and V of the layer's own KV heads (a sliding-window layer's cache is full-context, masked)."""
        nkv = layout(hp).head_kv[il]
        return common.KVSpec(hp.head_dim * nkv, hp.head_dim_v * nkv)

    # --------------------------------------------------------------------------------------------- graph
    def attention(
        self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache
    ) -> tuple[Tensor, list[Tensor]]:
        """mimo2.cpp's order: q, k, v (split from the fused rows where the file has them); NEOX RoPE of the layer's
        kind; attention at 1/√key_length with the layer's sinks; the output projection, then the value scale."""
        hp, w, n = self.hp, self.w[il], at.n
        hd, hv, nh, nkv = hp.head_dim, hp.head_dim_v, hp.n_head, self.layout.head_kv[il]
        if "attn_qkv" in w:
            q, k, v = common.split_rows(ctx, ops.ggml_mul_mat(ctx, w["attn_qkv"], x), (hd * nh, hd * nkv, hv * nkv))
        else:
            q, k, v = (ops.ggml_mul_mat(ctx, w[name], x) for name in ("attn_q", "attn_k", "attn_v"))
        swa = self.layout.swa[il]
        r = self.rope_swa if swa else self.rope
        q = common.rope(ctx, ops.ggml_reshape_3d(ctx, q, hd, nh, n), at.positions, r)
        k = common.rope(ctx, ops.ggml_reshape_3d(ctx, k, hd, nkv, n), at.positions, r)
        v = ops.ggml_reshape_3d(ctx, v, hv, nkv, n)
        mask = at.mask_swa if swa else None
        cur, writes = common.attend(
            ctx, q, k, v, at, common.kv_cache(kv), 1.0 / math.sqrt(hd), mask=mask, sinks=w.get("attn_sinks")
        )
        cur = ops.ggml_mul_mat(ctx, w["attn_output"], cur)
        if self.value_scale not in (0.0, 1.0):  # (llama.cpp: f_attn_value_scale set only where not 1)
            cur = ops.ggml_scale(ctx, cur, self.value_scale)
        return cur, writes
