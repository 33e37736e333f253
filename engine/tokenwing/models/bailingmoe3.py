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
from typing import Any

import numpy as np

from tokenwing.compute.ggml_lib import ROPE_NORM, Tensor, ops
from tokenwing.errors import BadInputError
from tokenwing.models import common, delta_net, mla
from tokenwing.models.base import MoEModel, TensorCheck
from tokenwing.models.hparams import HParams
from tokenwing.models.weights import ModelWeights


class BailingMoE3(MoEModel):
    arch = "bailingmoe3"
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
            if hp.kda_head_dim < 1 or hp.ssm_d_conv < 2:
                raise BadInputError(f"{where}: KDA layers need kda.head_dim and ssm.conv_kernel (at least 2)")
            if not -math.inf < hp.kda_gate_lower_bound < 0:  # (-inf: the file has none)
                raise BadInputError(f"{where}: kda.gate_lower_bound must be negative")
        super().check(hp, shapes, streamed, where)

    @classmethod
    def check_attention(cls, c: TensorCheck, il: int) -> None:
        hp, p, e = c.hp, f"blk.{il}.", c.hp.n_embd
        if not hp.is_recurrent(il):
            mla.check(c, il, split=True)
            c.need(p + "attn_gate.weight", (e, hp.n_head))
            return
        d_inner = hp.kda_head_dim * hp.n_head
        gates = {"ssm_f_a.weight": (e, d_inner), "ssm_a": (1, hp.n_head), "ssm_g_a.weight": (e, d_inner)}
        delta_net.check_kda(c, il, gates)

    # ------------------------------------------------------------------------------------------- caches
    @classmethod
    def kv_layer(cls, hp: HParams, il: int) -> common.KVSpec:
        """MLA's latent in the full-attention layers; a KDA layer keeps its recurrent state instead."""
        return common.KVSpec(0, 0) if hp.is_recurrent(il) else mla.kv_spec(hp)

    @classmethod
    def layer_state(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], il: int) -> common.StateSpec | None:
        if not hp.is_recurrent(il):
            return None
        hd = hp.kda_head_dim
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
        hp, w = self.hp, self.w[il]
        hd, nh = hp.kda_head_dim, hp.n_head
        qkv, writes = delta_net.kda_qkv(ctx, w, x, cache, hp.ssm_d_conv, hd, nh)
        gate = ops.ggml_add(ctx, ops.ggml_mul_mat(ctx, w["ssm_f_a"], x), w["ssm_dt.bias"])
        gate = ops.ggml_mul(
            ctx, ops.ggml_reshape_3d(ctx, gate, hd, nh, n), ops.ggml_reshape_3d(ctx, w["ssm_a"], 1, nh, 1)
        )
        gate = ops.ggml_scale(ctx, ops.ggml_sigmoid(ctx, gate), hp.kda_gate_lower_bound)
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
