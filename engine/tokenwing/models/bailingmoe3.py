"""Ling 3.0 (`bailingmoe3`): Kimi Delta Attention (KDA) in five of every six layers, gated multi-head latent
attention in the others (llama.cpp: src/models/bailingmoe3.cpp).

A layer: RMSNorm → attention → residual → RMSNorm → a dense FFN (leading layers) or a sigmoid router with a
per-expert selection bias (top-k, weights normalised and scaled as the file says) plus a shared expert →
residual. The file may set SwiGLU limits per layer for the routed experts and for the shared expert (or dense
FFN): min(silu(gate), L) · clamp(up, ±L).

KDA layers (`models/delta_net.py`): q, k and v each through their own projection and short causal convolution
(one state of d_conv - 1 inputs per projection), SiLU, q and k L2-normalised; a decay gate per channel,
gate_lower_bound · sigmoid((ssm_f_a · x + dt_bias) · ssm_a), and a write strength β = sigmoid(ssm_beta · x) per
head; the gated delta rule over the layer's state; RMSNorm of each head's output times sigmoid(ssm_g_a · x);
attn_output. MLA layers (`models/mla.py`): latent attention with kq_scale 1/√(qk head), the result scaled per head
by sigmoid(attn_gate · x) before attn_output. Linear layers are those whose head_count_kv is 0. The
next-token-prediction block is neither loaded nor run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenwing.compute.ggml_lib import ROPE_NORM, Tensor, ops
from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import KV, ValueType
from tokenwing.models import common, delta_net, mla
from tokenwing.models.bailingmoe2 import BailingMoE2
from tokenwing.models.base import MoEModel
from tokenwing.models.deepseek2 import check_mla
from tokenwing.models.factory import (
    MLA_FIELDS,
    Factory,
    check_linear,
    common_kv,
    mla_kv,
    shared_ff,
    sigmoid_routed_kv,
    yarn_kv,
)
from tokenwing.models.hparams import HParams
from tokenwing.models.keys import Key, read_keys, write_keys
from tokenwing.models.specs import Parts, TensorSpec
from tokenwing.models.weights import ModelWeights

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape


def ling_full_attention(s: ModelShape, i: int) -> bool:
    """Ling 3.0's layer pattern (llama.cpp's converter): MLA in each layer_group_size-th layer, in the layers after
    the last whole group, and in the next-token-prediction blocks; KDA in the others."""
    g = s.full_attention_interval
    return i >= s.n_layer or (i + 1) % g == 0 or i >= s.n_layer // g * g


# The KDA layers' own keys (models/keys.py), Ling 3.0's and Kimi K3's: read here, written by both factories (Kimi's
# without safe_gate, and without the gate's floor where it has none: then llama.cpp takes kimi-linear's softplus gate)
KDA_KEYS: dict[str, Key] = {
    "head_dim": Key("kda.head_dim", "u32", 0),  # every KDA head, q, k and v alike
    "safe_gate": Key("kda.safe_gate", "bool", False),
    "gate_lower_bound": Key("kda.gate_lower_bound", "f32", -math.inf),  # the decay gate's floor (negative)
}


@dataclass(frozen=True)
class KdaKeys:
    head_dim: int
    safe_gate: bool
    gate_lower_bound: float  # -inf where the file has none


def kda_keys(hp: HParams, where: str = "the model") -> KdaKeys:
    """The KDA keys from the file's (`KDA_KEYS`), checked: one line naming the key otherwise."""
    return KdaKeys(**read_keys(KDA_KEYS, hp, where))


def kda_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    """A Kimi Delta Attention layer of Ling 3.0: q, k, v each with its own short convolution (4-D, as converted),
    a per-channel decay gate (ssm_f_a, dt bias, ssm_a = exp(A_log)), β, and a sigmoid output gate (ssm_g_a)."""
    p, e, hd, nh = f"blk.{il}.", hp.n_embd, kda_keys(hp).head_dim, hp.n_head
    d_inner = hd * nh
    out = [TensorSpec(p + "attn_norm.weight", (e,), "norm")]
    for x in "qkv":
        out.append(TensorSpec(f"{p}attn_{x}.weight", (e, d_inner), "matrix"))
    for x in "qkv":
        out.append(TensorSpec(f"{p}ssm_conv1d_{x}.weight", (hp.ssm_d_conv, 1, d_inner, 1), "vector"))
    return [
        *out,
        TensorSpec(p + "ssm_f_a.weight", (e, d_inner), "matrix"),
        TensorSpec(p + "ssm_beta.weight", (e, nh), "matrix"),
        TensorSpec(p + "ssm_a", (1, nh), "decay_pos"),
        TensorSpec(p + "ssm_dt.bias", (d_inner,), "vector"),
        TensorSpec(p + "ssm_g_a.weight", (e, d_inner), "matrix"),
        TensorSpec(p + "ssm_norm.weight", (hd,), "norm"),
        TensorSpec(p + "attn_output.weight", (d_inner, e), "matrix"),
    ]


def _kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Ling 3.0: head_count_kv per block (0 in KDA layers), MLA's sizes, the KDA
    keys, routing and, where set, SwiGLU limits per layer."""
    a = "bailingmoe3"
    kv = common_kv(s, a)
    kv.update(sigmoid_routed_kv(s, a))
    kv[f"{a}.expert_shared_feed_forward_length"] = KV.u32(shared_ff(s))
    heads_kv = [1 if ling_full_attention(s, i) else 0 for i in range(s.n_block)]
    kv[f"{a}.attention.head_count_kv"] = KV.array(ValueType.UINT32, heads_kv)
    kv.update(mla_kv(s, a))
    kv[f"{a}.ssm.conv_kernel"] = KV.u32(s.ssm_d_conv)
    kv |= write_keys(
        KDA_KEYS, a, {"head_dim": s.ssm_d_state, "safe_gate": True, "gate_lower_bound": s.kda_gate_lower_bound}
    )
    if s.swiglu_limit:
        limits = [s.swiglu_limit if i == s.n_layer - 1 else 0.0 for i in range(s.n_block)]
        kv[f"{a}.swiglu_clamp_exp"] = KV.array(ValueType.FLOAT32, limits)
        kv[f"{a}.swiglu_clamp_shexp"] = KV.array(ValueType.FLOAT32, limits)
    kv.update(yarn_kv(s, a))
    if s.n_mtp:
        kv[f"{a}.nextn_predict_layers"] = KV.u32(s.n_mtp)
    return kv


def _check(s: ModelShape) -> None:
    check_mla(s)
    check_linear(s)
    if not s.kda_gate_lower_bound < 0:
        raise ValueError("bailingmoe3's KDA gate lower bound must be negative")


class BailingMoE3(MoEModel):
    arch = "bailingmoe3"
    factory = Factory(
        "Ling 3.0: KDA linear attention and gated MLA, sigmoid router with selection bias, shared expert",
        _kv,
        _check,
        takes=MLA_FIELDS | {"n_dense_lead"},
    )
    rope_mode = ROPE_NORM  # (files of the VL model carry rope sections: not run here)
    shared_experts = "required"
    routing_keys = True
    selection_bias = True
    normalize_weights = False  # llama.cpp's default where the file has no expert_weights_norm
    recurrence = "kv_heads"

    def __init__(self, hp: HParams, weights: ModelWeights, streamed: list[int]) -> None:
        super().__init__(hp, weights, streamed)
        f32 = np.float32
        self.kq_scale = float(f32(1.0) / np.sqrt(f32(mla.Heads.of(hp).k)))

    # -------------------------------------------------------------------------------------------- checks
    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        if hp.gating == 0:
            raise BadInputError(f"{where}: bailingmoe3.expert_gating_func is missing from the metadata")
        if hp.rope_sections and any(hp.rope_sections):
            raise BadInputError(f"{where}: a bailingmoe3 file with multi-axis RoPE (the VL model) is not run")
        if any(hp.recurrent):
            k = kda_keys(hp, where)
            if k.head_dim < 1 or hp.ssm_d_conv < 2:
                raise BadInputError(f"{where}: KDA layers need kda.head_dim and ssm.conv_kernel (at least 2)")
            if not -math.inf < k.gate_lower_bound < 0:  # (-inf: the file has none)
                raise BadInputError(f"{where}: kda.gate_lower_bound must be negative")
        super().check(hp, shapes, streamed, where)

    @classmethod
    def attention_tensors(cls, hp: HParams, il: int, parts: Parts) -> list[TensorSpec]:
        """KDA in the recurrent layers; elsewhere (the next-token-prediction block too) MLA and its sigmoid gate."""
        if hp.is_recurrent(il):
            return kda_tensors(hp, il)
        return [*mla.tensors(hp, il), TensorSpec(f"blk.{il}.attn_gate.weight", (hp.n_embd, hp.n_head), "matrix")]

    @classmethod
    def mtp_tensors(cls, hp: HParams, il: int) -> list[TensorSpec]:
        return BailingMoE2.mtp_tensors(hp, il)  # (Ling 2.0's: the same next-token-prediction block)

    # ------------------------------------------------------------------------------------------- caches
    @classmethod
    def kv_layer(cls, hp: HParams, il: int) -> common.KVSpec:
        """MLA's latent in the full-attention layers; a KDA layer keeps its recurrent state instead."""
        return common.KVSpec(0, 0) if hp.is_recurrent(il) else mla.kv_spec(hp)

    @classmethod
    def layer_state(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], il: int) -> common.StateSpec | None:
        if not hp.is_recurrent(il):
            return None
        hd = kda_keys(hp).head_dim
        # the three convolutions' inputs (q, k, v: llama.cpp's order), then one hd × hd matrix per head
        return common.StateSpec((hp.ssm_d_conv - 1, hd * hp.n_head, 3), (hd, hd, hp.n_head, 1))

    # --------------------------------------------------------------------------------------------- graph
    def attention(
        self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache
    ) -> tuple[Tensor, list[Tensor]]:
        hp, w, n = self.hp, self.w[il], at.n
        if hp.is_recurrent(il):
            return self.kda(ctx, il, x, n, common.recurrent_cache(kv))
        cur, writes = mla.attention(ctx, hp, w, x, at, common.kv_cache(kv), self.rope, self.kq_scale)
        v_head = mla.Heads.of(hp).v
        gate = ops.ggml_sigmoid(
            ctx, ops.ggml_reshape_3d(ctx, ops.ggml_mul_mat(ctx, w["attn_gate"], x), 1, hp.n_head, n)
        )
        cur = ops.ggml_mul(ctx, ops.ggml_reshape_3d(ctx, cur, v_head, hp.n_head, n), gate)
        return ops.ggml_mul_mat(ctx, w["attn_output"], ops.ggml_cont_2d(ctx, cur, v_head * hp.n_head, n)), writes

    def kda(self, ctx: Any, il: int, x: Tensor, n: int, cache: common.RecurrentCache) -> tuple[Tensor, list[Tensor]]:
        """Kimi Delta Attention over n tokens, from and into the layer's state: [n_embd, n] and the state writes."""
        hp, w, k = self.hp, self.w[il], kda_keys(self.hp)
        hd, nh = k.head_dim, hp.n_head
        qkv, writes = delta_net.kda_qkv(ctx, w, x, cache, hp.ssm_d_conv, hd, nh)
        gate = ops.ggml_add(ctx, ops.ggml_mul_mat(ctx, w["ssm_f_a"], x), w["ssm_dt.bias"])
        gate = ops.ggml_mul(
            ctx, ops.ggml_reshape_3d(ctx, gate, hd, nh, n), ops.ggml_reshape_3d(ctx, w["ssm_a"], 1, nh, 1)
        )
        gate = ops.ggml_scale(ctx, ops.ggml_sigmoid(ctx, gate), k.gate_lower_bound)
        gate = ops.ggml_reshape_4d(ctx, gate, hd, nh, n, 1)
        beta = ops.ggml_mul_mat(ctx, w["ssm_beta"], x)
        beta = ops.ggml_sigmoid(ctx, ops.ggml_reshape_4d(ctx, beta, 1, nh, n, 1))
        out_gate = ops.ggml_mul_mat(ctx, w["ssm_g_a"], x)
        out, state_writes = delta_net.kda_out(ctx, w, qkv, gate, beta, out_gate, cache, hp.rms_eps)
        return out, writes + state_writes

    # ----------------------------------------------------------------------------------------------- FFN
    def expert_ffn(self, il: int) -> common.ExpertFFN:
        limit = self.hp.swiglu_limit_exp[il] if il < len(self.hp.swiglu_limit_exp) else 0.0
        return common.ExpertFFN(limit=limit) if limit > 1e-6 else common.SWIGLU

    def swiglu_limit(self, il: int) -> float:
        return self.hp.swiglu_limit_shexp[il] if il < len(self.hp.swiglu_limit_shexp) else 0.0
