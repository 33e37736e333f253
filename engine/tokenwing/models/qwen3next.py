"""Qwen3-Next (`qwen3next`) and Qwen3.5 MoE (`qwen35moe`): gated DeltaNet linear attention in three of every four
layers, gated full attention in the others (llama.cpp: src/models/qwen3next.cpp, qwen35moe.cpp).

A layer: RMSNorm → attention → residual → post-attention RMSNorm → softmax top-k experts (renormalised) plus a
shared expert scaled by sigmoid(ffn_gate_inp_shexp · x) → residual.

Linear layers (`models/delta_net.py`): q, k and v from one projection (attn_qkv) through a short causal
convolution and SiLU, q and k L2-normalised; per value head a decay gate softplus(α + dt_bias) · ssm_a and a
write strength β = sigmoid(b); the gated delta rule over the layer's state; RMSNorm of each head's output times
silu(z), z from attn_gate; ssm_out. Qwen3-Next reads α and b from one interleaved projection (ssm_ba) and
repeats each key head for its group of value heads; Qwen3.5 has ssm_alpha and ssm_beta and lets the delta rule
share key heads across value heads h, h + H_k, … (llama.cpp's fused op, as its CPU backend runs it).

Full-attention layers: attn_q gives each head's query and an output gate side by side; per-head q/k RMSNorm,
partial RoPE (NEOX; Qwen3.5: multi-axis IMRoPE, text positions on three axes), attention over the KV cache,
output times sigmoid(gate), attn_output. The next-token-prediction block is neither loaded nor run.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenwing.compute.ggml_lib import ROPE_IMROPE, ROPE_NEOX, Tensor, ops
from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import KV, ValueType
from tokenwing.models import common, delta_net
from tokenwing.models.base import MoEModel
from tokenwing.models.factory import Factory, check_linear, common_kv, shared_ff
from tokenwing.models.hparams import HParams
from tokenwing.models.specs import Parts, TensorSpec
from tokenwing.models.weights import ModelWeights

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape


@dataclasses.dataclass(frozen=True)
class Linear:
    """The gated DeltaNet geometry (llama.cpp's ssm_* keys): key heads of size s, value heads of size s."""

    s: int  # ssm.state_size: a key and a value head's size
    k_heads: int  # ssm.group_count
    v_heads: int  # ssm.time_step_rank
    d_conv: int  # ssm.conv_kernel

    @classmethod
    def of(cls, hp: HParams) -> Linear:
        return cls(hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_conv)

    @property
    def key_dim(self) -> int:
        return self.s * self.k_heads

    @property
    def value_dim(self) -> int:
        return self.s * self.v_heads

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim


def gated_attention_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    """Full attention whose attn_q gives each head's query and output gate side by side, q/k RMSNorm."""
    p, e, hd = f"blk.{il}.", hp.n_embd, hp.head_dim
    q, kv = hp.n_head * hd, hp.n_head_kv * hd
    return [
        TensorSpec(p + "attn_norm.weight", (e,), "norm"),
        TensorSpec(p + "attn_q.weight", (e, 2 * q), "matrix"),
        TensorSpec(p + "attn_k.weight", (e, kv), "matrix"),
        TensorSpec(p + "attn_v.weight", (e, kv), "matrix"),
        TensorSpec(p + "attn_output.weight", (q, e), "matrix"),
        TensorSpec(p + "attn_q_norm.weight", (hd,), "norm"),
        TensorSpec(p + "attn_k_norm.weight", (hd,), "norm"),
    ]


def linear_tensors(hp: HParams, il: int, separate_alpha_beta: bool, joint: bool = False) -> list[TensorSpec]:
    """A gated DeltaNet layer (llama.cpp's names; ssm_a is -exp(A_log), as converted): q, k, v and the output
    gate from attn_qkv and attn_gate (`joint`: the older converter's one ssm_in), the short convolution, the
    decay and β/α (interleaved per key head in ssm_ba, or apart: `separate_alpha_beta`), the output norm."""
    p, e, lin = f"blk.{il}.", hp.n_embd, Linear.of(hp)
    out = [TensorSpec(p + "attn_norm.weight", (e,), "norm")]
    if joint:
        out.append(TensorSpec(p + "ssm_in.weight", (e, 2 * lin.key_dim + 2 * lin.value_dim), "matrix"))
    else:
        out += [
            TensorSpec(p + "attn_qkv.weight", (e, lin.conv_dim), "matrix"),
            TensorSpec(p + "attn_gate.weight", (e, lin.value_dim), "matrix"),
        ]
    out += [
        TensorSpec(p + "ssm_conv1d.weight", (lin.d_conv, lin.conv_dim), "vector"),
        TensorSpec(p + "ssm_dt.bias", (lin.v_heads,), "vector"),
        TensorSpec(p + "ssm_a", (lin.v_heads,), "decay_neg"),
    ]
    if separate_alpha_beta:
        out += [
            TensorSpec(p + "ssm_beta.weight", (e, lin.v_heads), "matrix"),
            TensorSpec(p + "ssm_alpha.weight", (e, lin.v_heads), "matrix"),
        ]
    else:
        out.append(TensorSpec(p + "ssm_ba.weight", (e, 2 * lin.v_heads), "matrix"))
    return [
        *out,
        TensorSpec(p + "ssm_norm.weight", (lin.s,), "norm"),
        TensorSpec(p + "ssm_out.weight", (lin.value_dim, e), "matrix"),
    ]


def qwen_next_kv(s: ModelShape, a: str) -> dict[str, KV]:
    """Qwen3-Next's keys (Qwen3.5's and Qwen3.8's too, under their names)."""
    kv = common_kv(s, a)
    kv[f"{a}.rope.dimension_count"] = KV.u32(s.rot)
    kv[f"{a}.expert_shared_feed_forward_length"] = KV.u32(shared_ff(s))
    kv[f"{a}.ssm.conv_kernel"] = KV.u32(s.ssm_d_conv)
    kv[f"{a}.ssm.state_size"] = KV.u32(s.ssm_d_state)
    kv[f"{a}.ssm.group_count"] = KV.u32(s.ssm_n_group)
    kv[f"{a}.ssm.time_step_rank"] = KV.u32(s.ssm_dt_rank)
    kv[f"{a}.ssm.inner_size"] = KV.u32(s.ssm_d_state * s.ssm_dt_rank)
    kv[f"{a}.full_attention_interval"] = KV.u32(s.full_attention_interval)
    if s.rope_sections:
        kv[f"{a}.rope.dimension_sections"] = KV.array(ValueType.INT32, s.rope_sections)
    return kv


def check_qwen_linear(s: ModelShape) -> None:
    """What llama.cpp takes of gated DeltaNet's sizes and the full layers' partial RoPE."""
    check_linear(s)
    if s.ssm_dt_rank % s.ssm_n_group:
        raise ValueError("the linear layers' value heads must be a multiple of their key heads")
    if not 0 < s.rot <= s.head_dim or s.rot % 2:
        raise ValueError("--n-rot must be even, positive and at most --head-dim")


class Qwen3Next(MoEModel):
    arch = "qwen3next"
    factory = Factory(
        "Qwen3-Next: gated DeltaNet in 3 of 4 layers, gated attention, partial RoPE, gated shared expert",
        lambda s: qwen_next_kv(s, "qwen3next"),
        check_qwen_linear,
        takes=frozenset({"n_rot", "legacy_ssm_in"}),
    )
    rope_mode = ROPE_NEOX
    ffn_norm = "post_attention_norm"
    shared_gated = True
    shared_experts = "required"
    recurrence = "interval"
    separate_alpha_beta = False  # Qwen3.5: ssm_alpha and ssm_beta instead of the interleaved ssm_ba
    repeat_key_heads = True  # Qwen3-Next: key head h serves value heads h·r … h·r + r - 1 (repeated in the graph)

    def __init__(self, hp: HParams, weights: ModelWeights, streamed: list[int]) -> None:
        super().__init__(hp, weights, streamed)
        self.lin = Linear.of(hp)
        f32 = np.float32
        self.kq_scale = float(f32(1.0) / np.sqrt(f32(hp.head_dim)))

    # -------------------------------------------------------------------------------------------- checks
    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        lin = Linear.of(hp)
        if any(hp.recurrent) and (
            min(lin.s, lin.k_heads, lin.v_heads) < 1 or lin.v_heads % lin.k_heads or lin.d_conv < 2
        ):
            raise BadInputError(
                f"{where}: the linear-attention sizes (ssm.state_size, group_count, time_step_rank, conv_kernel) "
                "must be positive, with value heads a multiple of key heads and a kernel of at least 2"
            )
        if any(hp.recurrent) and hp.ssm_d_inner != lin.value_dim:
            raise BadInputError(f"{where}: ssm.inner_size must be ssm.state_size × ssm.time_step_rank")
        if not all(hp.is_recurrent(il) for il in range(hp.n_layer)) and hp.head_dim_v != hp.head_dim:
            raise BadInputError(f"{where}: {hp.arch} needs value_length = key_length")
        super().check(hp, shapes, streamed, where)

    @classmethod
    def attention_tensors(cls, hp: HParams, il: int, parts: Parts) -> list[TensorSpec]:
        if hp.is_recurrent(il):
            return linear_tensors(hp, il, cls.separate_alpha_beta, "ssm_in" in parts.forms)
        return gated_attention_tensors(hp, il)

    @classmethod
    def file_parts(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int]) -> Parts:
        """The older converter's joint ssm_in where a layer has it (Qwen3-Next's files only)."""
        joint = not cls.separate_alpha_beta and any(f"blk.{il}.ssm_in.weight" in shapes for il in range(hp.n_layer))
        return dataclasses.replace(
            super().file_parts(hp, shapes, streamed), forms=frozenset({"ssm_in"} if joint else ())
        )

    # ------------------------------------------------------------------------------------------- caches
    @classmethod
    def kv_layer(cls, hp: HParams, il: int) -> common.KVSpec:
        """A KV cache in the full-attention layers only: a linear one keeps its recurrent state instead."""
        if hp.is_recurrent(il):
            return common.KVSpec(0, 0)
        return super().kv_layer(hp, il)

    @classmethod
    def layer_state(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], il: int) -> common.StateSpec | None:
        if not hp.is_recurrent(il):
            return None
        lin = Linear.of(hp)
        return common.StateSpec((lin.d_conv - 1, lin.conv_dim, 1), (lin.s, lin.s, lin.v_heads, 1))

    # --------------------------------------------------------------------------------------------- graph
    def attention(
        self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache
    ) -> tuple[Tensor, list[Tensor]]:
        if self.hp.is_recurrent(il):
            return self.linear_attention(ctx, il, x, at.n, common.recurrent_cache(kv))
        return self.gated_attention(ctx, il, x, at, common.kv_cache(kv))

    def gated_attention(
        self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.KVCache, mask: Tensor | None = None
    ) -> tuple[Tensor, list[Tensor]]:
        """`mask`: another mask than the placement's (qwen4exp's QSA picks)."""
        hp, w, n = self.hp, self.w[il], at.n
        hd, nh, eps = hp.head_dim, hp.n_head, hp.rms_eps
        qg = ops.ggml_mul_mat(ctx, w["attn_q"], x)  # per head: query, then gate
        f, row = int(qg.contents.nb[0]), int(qg.contents.nb[1])
        q = ops.ggml_view_3d(ctx, qg, hd, nh, n, 2 * hd * f, row, 0)
        gate = ops.ggml_view_3d(ctx, qg, hd, nh, n, 2 * hd * f, row, hd * f)
        k = ops.ggml_reshape_3d(ctx, ops.ggml_mul_mat(ctx, w["attn_k"], x), hd, hp.n_head_kv, n)
        v = ops.ggml_reshape_3d(ctx, ops.ggml_mul_mat(ctx, w["attn_v"], x), hd, hp.n_head_kv, n)
        q = common.rope(ctx, common.rms_norm(ctx, q, w["attn_q_norm"], eps), at.positions, self.rope)
        k = common.rope(ctx, common.rms_norm(ctx, k, w["attn_k_norm"], eps), at.positions, self.rope)
        cur, writes = common.attend(ctx, q, k, v, at, kv, self.kq_scale, mask)
        gate = ops.ggml_sigmoid(ctx, ops.ggml_cont_2d(ctx, gate, hd * nh, n))
        return ops.ggml_mul_mat(ctx, w["attn_output"], ops.ggml_mul(ctx, cur, gate)), writes

    def linear_attention(
        self, ctx: Any, il: int, x: Tensor, n: int, cache: common.RecurrentCache
    ) -> tuple[Tensor, list[Tensor]]:
        """Gated DeltaNet over n tokens, from and into the layer's state: [n_embd, n] and the state writes."""
        w, lin, eps = self.w[il], self.lin, self.hp.rms_eps
        qkv, z = self._qkvz(ctx, w, x, n)
        beta, g = self._beta_gate(ctx, w, x, n)
        conv, writes = delta_net.short_conv(ctx, cache, qkv, w["ssm_conv1d"])
        conv = ops.ggml_silu(ctx, conv)  # [conv_dim, n, 1]: q, k, v
        f = int(conv.contents.nb[0])
        row = f * lin.conv_dim
        q = ops.ggml_view_4d(ctx, conv, lin.s, lin.k_heads, n, 1, f * lin.s, row, row * n, 0)
        k = ops.ggml_view_4d(ctx, conv, lin.s, lin.k_heads, n, 1, f * lin.s, row, row * n, f * lin.key_dim)
        v = ops.ggml_view_4d(ctx, conv, lin.s, lin.v_heads, n, 1, f * lin.s, row, row * n, 2 * f * lin.key_dim)
        q, k = delta_net.l2_norm(ctx, q, eps), delta_net.l2_norm(ctx, k, eps)
        if self.repeat_key_heads and lin.v_heads != lin.k_heads:
            times = lin.v_heads // lin.k_heads
            q, k = delta_net.repeat_interleaved(ctx, q, times), delta_net.repeat_interleaved(ctx, k, times)
        out, state_writes = delta_net.delta_rule(ctx, q, k, v, g, beta, cache)
        z = ops.ggml_reshape_4d(ctx, z, lin.s, lin.v_heads, n, 1)
        out = self.output_gate(ctx, out, w["ssm_norm"], z, eps)
        out = ops.ggml_mul_mat(ctx, w["ssm_out"], ops.ggml_reshape_2d(ctx, out, lin.value_dim, n))
        return out, writes + state_writes

    def output_gate(self, ctx: Any, out: Tensor, weight: Tensor, z: Tensor, eps: float) -> Tensor:
        """The heads' output normed and gated by z: rms_norm · weight · silu(z) (qwen4exp: sigmoid(z))."""
        return delta_net.gated_norm(ctx, out, weight, z, eps)

    def _qkvz(self, ctx: Any, w: dict[str, Tensor], x: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """The convolution's input [conv_dim, n] (q, k, v of every head, in that order) and the output gate z."""
        if "attn_qkv" in w:
            return ops.ggml_mul_mat(ctx, w["attn_qkv"], x), ops.ggml_mul_mat(ctx, w["attn_gate"], x)
        # the older converter's ssm_in: per key head its q, k, then its value heads' v and z
        lin = self.lin
        r = lin.v_heads // lin.k_heads
        sizes = (lin.s, lin.s, lin.s * r, lin.s * r)
        mixed = ops.ggml_reshape_4d(ctx, ops.ggml_mul_mat(ctx, w["ssm_in"], x), sum(sizes), lin.k_heads, n, 1)
        nb = mixed.contents.nb
        f = int(nb[0])
        parts, off = [], 0
        for size in sizes:
            parts.append(ops.ggml_view_4d(ctx, mixed, size, lin.k_heads, n, 1, int(nb[1]), int(nb[2]), int(nb[3]), off))
            off += f * size
        q, k, v, z = parts
        z = ops.ggml_cont(ctx, z)
        flat = [
            ops.ggml_cont_3d(ctx, t, size * lin.k_heads, n, 1) for t, size in zip((q, k, v), sizes[:3], strict=True)
        ]
        qkv = ops.ggml_concat(ctx, ops.ggml_concat(ctx, flat[0], flat[1], 0), flat[2], 0)
        return ops.ggml_reshape_2d(ctx, qkv, lin.conv_dim, n), z

    def _beta_gate(self, ctx: Any, w: dict[str, Tensor], x: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """β = sigmoid(b) and the decay gate softplus(α + dt_bias) · ssm_a, each [1, v_heads, n, 1]."""
        lin = self.lin
        r = lin.v_heads // lin.k_heads
        ba = ops.ggml_reshape_4d(ctx, ops.ggml_mul_mat(ctx, w["ssm_ba"], x), 2 * r, lin.k_heads, n, 1)
        nb = ba.contents.nb
        b = ops.ggml_view_4d(ctx, ba, r, lin.k_heads, n, 1, int(nb[1]), int(nb[2]), int(nb[3]), 0)
        a = ops.ggml_view_4d(ctx, ba, r, lin.k_heads, n, 1, int(nb[1]), int(nb[2]), int(nb[3]), r * int(nb[0]))
        beta = ops.ggml_sigmoid(ctx, ops.ggml_cont(ctx, b))
        alpha = ops.ggml_cont_3d(ctx, a, lin.v_heads, n, 1)
        return self._finish_gates(ctx, w, beta, alpha, n)

    def _finish_gates(
        self, ctx: Any, w: dict[str, Tensor], beta: Tensor, alpha: Tensor, n: int
    ) -> tuple[Tensor, Tensor]:
        gate = ops.ggml_mul(ctx, ops.ggml_softplus(ctx, ops.ggml_add(ctx, alpha, w["ssm_dt.bias"])), w["ssm_a"])
        shape = (1, self.lin.v_heads, n, 1)
        return ops.ggml_reshape_4d(ctx, beta, *shape), ops.ggml_reshape_4d(ctx, gate, *shape)


def _check_qwen35moe(s: ModelShape) -> None:
    check_qwen_linear(s)
    if len(s.rope_sections) != 4 or 2 * sum(s.rope_sections) > s.rot:
        raise ValueError("qwen35moe's IMRoPE needs four section counts whose pairs fit in --n-rot")


class Qwen35MoE(Qwen3Next):
    arch = "qwen35moe"
    factory = Factory(
        "Qwen3.5 MoE: Qwen3-Next's layers with separate alpha/beta projections and IMRoPE",
        lambda s: qwen_next_kv(s, "qwen35moe"),
        _check_qwen35moe,
        takes=frozenset({"n_rot"}),
    )
    rope_mode = ROPE_IMROPE
    separate_alpha_beta = True
    repeat_key_heads = False  # ggml's delta rule shares key head h % H_k with value head h

    def __init__(self, hp: HParams, weights: ModelWeights, streamed: list[int]) -> None:
        super().__init__(hp, weights, streamed)
        self.rope = dataclasses.replace(self.rope, sections=hp.rope_sections)

    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        if len(hp.rope_sections) != 4 or sum(hp.rope_sections) * 2 > hp.n_rot:
            raise BadInputError(
                f"{where}: qwen35moe needs rope.dimension_sections: four counts of rotary pairs within "
                "rope.dimension_count"
            )
        super().check(hp, shapes, streamed, where)

    def _beta_gate(self, ctx: Any, w: dict[str, Tensor], x: Tensor, n: int) -> tuple[Tensor, Tensor]:
        lin = self.lin
        beta = ops.ggml_sigmoid(
            ctx, ops.ggml_reshape_4d(ctx, ops.ggml_mul_mat(ctx, w["ssm_beta"], x), 1, lin.v_heads, n, 1)
        )
        alpha = ops.ggml_reshape_3d(ctx, ops.ggml_mul_mat(ctx, w["ssm_alpha"], x), lin.v_heads, n, 1)
        return self._finish_gates(ctx, w, beta, alpha, n)
