"""Kimi K3 (`kimi-k3`): Kimi Delta Attention (KDA) and gated latent attention in one hybrid stack, a latent MoE,
the SiTU activation, and a residual stream that attends over earlier layers' inputs (llama.cpp:
src/models/kimi-k3.cpp; docs/families/kimi-k3.md walks through it).

The state between layers is the running sum plus a stack of checkpoints: every attn_res.block_size-th layer banks
its raw input and restarts the sum from its attention output. Before its attention and before its FFN a layer
reads a mix of the stack and the sum: a softmax over each one's RMS-normed dot product with the layer's score
vector (attn_res_score / ffn_res_score: the converter's res_norm · res_proj) weights the raw vectors
(`res_mix`). The head mixes them once more (output_res_score). Here the state is one row a token of
(1 + checkpoints) · n_embd floats: the sum, then the checkpoints in the order they were banked, then the slots
later layers fill (`state_width`).

A layer: res_mix → RMSNorm → KDA (q, k, v through short convolutions; the decay gate through the low-rank
ssm_f_a → ssm_f_b, lower_bound · sigmoid(-(ssm_a · (g + dt_bias))), or kimi-linear's softplus form where the file
has no lower bound; a full-rank output gate ssm_g) or nope-only MLA (the rope dims never rotated; the result
times sigmoid(attn_gate · x), per element) → the running sum → res_mix → RMSNorm → a dense SiTU FFN (leading
layers) or the latent MoE: a sigmoid router with a selection bias on the full-width input, the routed experts
(SiTU) on its projection ffn_routed_down, their weighted sum RMS-normed (ffn_routed_norm) and projected back up
(ffn_routed_up), plus a SiTU shared expert on the full-width input → the running sum. Linear layers are those
whose head_count_kv is 0. The caches are Ling 3.0's: a KDA layer's convolution and delta-rule state, an MLA
layer's latent and rope key.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenwing.compute.ggml_lib import F32, Tensor, ops
from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import KV, ValueType
from tokenwing.models import common, delta_net, mla, specs
from tokenwing.models.bailingmoe3 import KDA_KEYS, BailingMoE3, kda_keys, kda_tensors, ling_full_attention
from tokenwing.models.deepseek2 import check_mla
from tokenwing.models.factory import MLA_FIELDS, Factory, common_kv, mla_kv, sigmoid_routed_kv
from tokenwing.models.hparams import HParams
from tokenwing.models.keys import Key, read_keys, write_keys
from tokenwing.models.specs import Parts, TensorSpec
from tokenwing.models.weights import ModelWeights

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape


@dataclass(frozen=True)
class K3Keys:
    """Kimi K3's own keys: routed experts in a latent space of this width (0: n_embd), the cross-layer residual's
    block size (0: none) and SiTU's betas."""

    n_expert_latent: int
    attn_res_block: int
    situ_beta: float
    situ_linear_beta: float


# K3Keys' fields and their keys (models/keys.py): read here, written by the factory; llama.cpp requires the last
# three of a kimi-k3 file, and takes one without a latent width (its experts then at the hidden width)
KEYS: dict[str, Key] = {
    "n_expert_latent": Key("expert_latent_length", "u32", 0),
    "attn_res_block": Key("attn_res.block_size", "u32"),
    "situ_beta": Key("activation.situ_beta", "f32"),
    "situ_linear_beta": Key("activation.situ_linear_beta", "f32"),
}


def keys(hp: HParams, where: str = "the model") -> K3Keys:
    """The family's keys from the file's (`KEYS`), checked: one line naming the key otherwise."""
    return K3Keys(**read_keys(KEYS, hp, where))


def _kda(hp: HParams, il: int) -> list[TensorSpec]:
    """A KDA layer of Kimi K3: Ling's projections and convolutions, the decay gate through a low-rank pair
    (ssm_f_a → ssm_f_b), ssm_a as -exp(A_log) over the heads (1-D), and a full-rank output gate (ssm_g)."""
    p, e, hd = f"blk.{il}.", hp.n_embd, kda_keys(hp).head_dim
    d_inner = hd * hp.n_head
    kda = [t for t in kda_tensors(hp, il) if t.name.split(".")[2] not in ("ssm_f_a", "ssm_a", "ssm_g_a")]
    return [
        *kda,
        TensorSpec(p + "ssm_f_a.weight", (e, hd), "matrix"),
        TensorSpec(p + "ssm_f_b.weight", (hd, d_inner), "matrix"),
        TensorSpec(p + "ssm_a", (hp.n_head,), "decay_neg"),
        TensorSpec(p + "ssm_g.weight", (e, d_inner), "matrix"),
    ]


def _kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Kimi K3: head_count_kv per block (1 in MLA layers, 0 in KDA ones), MLA's
    sizes, the KDA keys (a lower bound only where set), routing, the latent width, the residual's block size and
    SiTU's betas."""
    a = "kimi-k3"
    kv = common_kv(s, a)
    kv.update(sigmoid_routed_kv(s, a))
    kv[f"{a}.attention.head_count_kv"] = KV.array(
        ValueType.UINT32, [1 if ling_full_attention(s, i) else 0 for i in range(s.n_layer)]
    )
    kv.update(mla_kv(s, a))
    kv[f"{a}.ssm.conv_kernel"] = KV.u32(s.ssm_d_conv)
    kda = {
        field: key
        for field, key in KDA_KEYS.items()
        if field == "head_dim" or (field == "gate_lower_bound" and math.isfinite(s.kda_gate_lower_bound))
    }
    kv |= write_keys(kda, a, {"head_dim": s.ssm_d_state, "gate_lower_bound": s.kda_gate_lower_bound})
    # the family's own keys (KEYS), from the shape's fields of the same names; no latent width where it has none
    own = {field: key for field, key in KEYS.items() if field != "n_expert_latent" or s.n_expert_latent}
    return kv | write_keys(own, a, {field: getattr(s, field) for field in own})


def _check(s: ModelShape) -> None:
    """What llama.cpp's Kimi K3 loader and graph take."""
    check_mla(s, shared_required=False)  # (its shared expert is optional)
    if s.ssm_d_conv < 2 or s.ssm_d_state < 1 or s.full_attention_interval < 1:
        raise ValueError("KDA needs a convolution of 2 or more, a positive head size and a full-attention interval")
    if s.situ_beta <= 0 or s.situ_linear_beta < 0 or s.attn_res_block < 0 or s.n_expert_latent < 0:
        raise ValueError(
            "--situ-beta must be positive; --situ-linear-beta, the block size and latent width not negative"
        )
    if s.kda_gate_lower_bound >= 0:
        raise ValueError("the KDA gate's lower bound must be negative (-inf: none, kimi-linear's softplus gate)")
    if s.n_mtp or s.n_expert_group or s.legacy_kv_b:
        raise ValueError("kimi-k3 has no next-token-prediction block, expert groups or combined attn_kv_b")


class KimiK3(BailingMoE3):
    arch = "kimi-k3"
    factory = Factory(
        "Kimi K3: KDA and gated nope-only MLA, cross-layer residual mixing, a latent MoE with a sigmoid router "
        "and selection bias, SiTU",
        _kv,
        _check,
        takes=MLA_FIELDS | {"n_dense_lead", "n_expert_latent", "attn_res_block", "situ_beta", "situ_linear_beta"},
    )
    shared_experts = "optional"
    shared_as_experts = True  # (expert_shared_count routed experts wide)

    def __init__(self, hp: HParams, weights: ModelWeights, streamed: list[int]) -> None:
        super().__init__(hp, weights, streamed)
        k = keys(hp)
        self.block = k.attn_res_block
        self.slots = self.state_width(hp) // hp.n_embd  # the running sum, then the checkpoints
        self.situ = (k.situ_beta, k.situ_linear_beta)

    # -------------------------------------------------------------------------------------------- checks
    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        if hp.gating == 0:
            raise BadInputError(f"{where}: {cls.arch}.expert_gating_func is missing from the metadata")
        if any(key.default is None and key.name not in hp.keys for key in KEYS.values()):
            raise BadInputError(
                f"{where}: {cls.arch}.attn_res.block_size, activation.situ_beta and activation.situ_linear_beta "
                "are required (llama.cpp stops without them too)"
            )
        if keys(hp, where).situ_beta <= 0:
            raise BadInputError(f"{where}: {cls.arch}.activation.situ_beta must be positive (SiTU divides by it)")
        if any(hp.recurrent) and (kda_keys(hp, where).head_dim < 1 or hp.ssm_d_conv < 2):
            raise BadInputError(f"{where}: KDA layers need kda.head_dim and ssm.conv_kernel (at least 2)")
        super(BailingMoE3, cls).check(hp, shapes, streamed, where)  # (the common checks, not Ling's: `tensors`)

    @classmethod
    def tensors(cls, hp: HParams, parts: Parts) -> list[TensorSpec]:
        """Kimi K3: KDA and gated nope-only MLA, the residual's score vectors, leading dense layers, a latent MoE
        (routed experts at n_expert_latent between ffn_routed_down and ffn_routed_norm/ffn_routed_up) with a sigmoid
        router and selection bias on the full width, a shared expert, an output head of its own (never tied)."""
        first, (norm, output) = specs.head(hp)
        last = [norm, dataclasses.replace(output, optional=False)]
        k = keys(hp)
        e, latent, ff, n = hp.n_embd, cls.expert_width(hp, 0), parts.ff_exp, hp.n_expert
        layers: list[TensorSpec] = []
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            layers += cls.attention_tensors(hp, il, parts)
            if k.attn_res_block:
                layers += [
                    TensorSpec(p + "attn_res_score.weight", (e,), "vector"),
                    TensorSpec(p + "ffn_res_score.weight", (e,), "vector"),
                ]
            if il not in parts.moe_layers:
                layers += specs.dense(hp, il, parts.ff_dense)
                continue
            layers += [
                TensorSpec(p + "ffn_norm.weight", (e,), "norm"),
                TensorSpec(p + "ffn_gate_inp.weight", (e, n), "router"),
                TensorSpec(p + "exp_probs_b.bias", (n,), "vector"),
                TensorSpec(p + "ffn_gate_exps.weight", (latent, ff, n), "expert"),
                TensorSpec(p + "ffn_up_exps.weight", (latent, ff, n), "expert"),
                TensorSpec(p + "ffn_down_exps.weight", (ff, latent, n), "expert"),
            ]
            if k.n_expert_latent:
                layers += [
                    TensorSpec(p + "ffn_routed_down.weight", (e, latent), "matrix"),
                    TensorSpec(p + "ffn_routed_norm.weight", (latent,), "norm", optional=True),
                    TensorSpec(p + "ffn_routed_up.weight", (latent, e), "matrix"),
                ]
            if parts.ff_shexp:
                layers += specs.shared(hp, il, parts.ff_shexp, gated=False)
        if k.attn_res_block:
            last.append(TensorSpec("output_res_score.weight", (e,), "vector"))
        return first + layers + last

    @classmethod
    def attention_tensors(cls, hp: HParams, il: int, parts: Parts) -> list[TensorSpec]:
        """KDA in the recurrent layers; elsewhere MLA (the converter always splits attn_kv_b) and, where the file
        has it, its gate."""
        if hp.is_recurrent(il):
            return _kda(hp, il)
        gate = TensorSpec(
            f"blk.{il}.attn_gate.weight", (hp.n_embd, hp.n_head * mla.Heads.of(hp).v), "matrix", optional=True
        )
        return [*mla.tensors(hp, il), gate]

    # -------------------------------------------------------------------------- the state between layers
    @classmethod
    def state_width(cls, hp: HParams) -> int:
        """The running sum and every checkpoint the layers bank (one per attn_res.block_size layers)."""
        block = keys(hp).attn_res_block
        return hp.n_embd * (1 + (-(-hp.n_layer // block) if block else 0))

    @classmethod
    def expert_width(cls, hp: HParams, il: int) -> int:
        return keys(hp).n_expert_latent or hp.n_embd

    def embed(self, ctx: Any, ids: Tensor) -> Tensor:
        x = super().embed(ctx, ids)
        if self.slots == 1:
            return x
        e, n = self.hp.n_embd, int(ids.contents.ne[0])
        # the slots no layer has banked yet: never read before a layer writes them, zero until then
        empty = ops.ggml_fill(ctx, ops.ggml_new_tensor_3d(ctx, F32, e, self.slots - 1, n), 0.0)
        return self._flat(ctx, ops.ggml_concat(ctx, ops.ggml_reshape_3d(ctx, x, e, 1, n), empty, 1))

    def _slots(self, ctx: Any, st: Tensor, first: int, count: int) -> Tensor:
        """Slots first … first + count - 1 of the state st [n_embd, slots, n], as a view [n_embd, count, n]."""
        nb = st.contents.nb
        return ops.ggml_view_3d(
            ctx, st, self.hp.n_embd, count, int(st.contents.ne[2]), int(nb[1]), int(nb[2]), first * int(nb[1])
        )

    def _split(self, ctx: Any, state: Tensor) -> tuple[Tensor, Tensor]:
        """The state [width, n] as [n_embd, slots, n], and its running sum (slot 0) as a contiguous [n_embd, n]."""
        e, n = self.hp.n_embd, int(state.contents.ne[1])
        st = ops.ggml_reshape_3d(ctx, state, e, self.slots, n)
        return st, ops.ggml_cont_2d(ctx, self._slots(ctx, st, 0, 1), e, n)

    def _flat(self, ctx: Any, st: Tensor) -> Tensor:
        return ops.ggml_reshape_2d(ctx, st, self.hp.n_embd * self.slots, int(st.contents.ne[2]))

    def _with_sum(self, ctx: Any, st: Tensor, total: Tensor) -> Tensor:
        """The state st with its running sum replaced by total [n_embd, n]."""
        e, n = self.hp.n_embd, int(st.contents.ne[2])
        head = ops.ggml_reshape_3d(ctx, total, e, 1, n)
        if self.slots == 1:
            return self._flat(ctx, head)
        return self._flat(ctx, ops.ggml_concat(ctx, head, self._slots(ctx, st, 1, self.slots - 1), 1))

    def res_mix(self, ctx: Any, cur: Tensor, stack: Tensor | None, score: Tensor) -> Tensor:
        """The mix a block reads: softmax over the scores of the checkpoints and of the running sum cur [n_embd, n]
        (each RMS-normed, times the score vector, summed), weighting the raw vectors; cur alone before the first
        checkpoint. llama.cpp's ops in its order (the checkpoints through ggml_dsv4_hc_pre, cur by a broadcast)."""
        if stack is None:
            return cur
        eps, k, n = self.hp.rms_eps, int(stack.contents.ne[1]), int(cur.contents.ne[1])
        sc_src = ops.ggml_sum_rows(ctx, ops.ggml_mul(ctx, ops.ggml_rms_norm(ctx, stack, eps), score))
        sc_src = ops.ggml_reshape_2d(ctx, sc_src, k, n)
        sc_cur = ops.ggml_sum_rows(ctx, ops.ggml_mul(ctx, ops.ggml_rms_norm(ctx, cur, eps), score))
        probs = ops.ggml_soft_max(ctx, ops.ggml_concat(ctx, sc_src, sc_cur, 0))  # [k + 1, n]
        row, f = int(probs.contents.nb[1]), int(probs.contents.nb[0])
        p_src = ops.ggml_cont(ctx, ops.ggml_view_2d(ctx, probs, k, n, row, 0))
        p_cur = ops.ggml_cont(ctx, ops.ggml_view_2d(ctx, probs, 1, n, row, f * k))
        return ops.ggml_add(ctx, ops.ggml_dsv4_hc_pre(ctx, stack, p_src), ops.ggml_mul(ctx, cur, p_cur))

    # --------------------------------------------------------------------------------------------- graph
    def layer(self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache) -> common.LayerOut:
        hp, w, n = self.hp, self.w[il], at.n
        st, total = self._split(ctx, x)
        mixing = self.block > 0
        banked = -(-il // self.block) if mixing else 0  # checkpoints banked before this layer
        stack = self._slots(ctx, st, 1, banked) if banked else None
        cur = self.res_mix(ctx, total, stack, w["attn_res_score"]) if mixing else total
        banks = mixing and il % self.block == 0
        if banks:  # the raw layer input (not the mix) is the new checkpoint; the sum restarts from the attention
            pushed = self._slots(ctx, st, 0, 1)
            stack = pushed if stack is None else ops.ggml_concat(ctx, stack, pushed, 1)
        attn, writes = self.attention(ctx, il, self.norm(ctx, cur, w["attn_norm"]), at, kv)
        total = attn if banks else ops.ggml_add(ctx, total, attn)
        cur = self.res_mix(ctx, total, stack, w["ffn_res_score"]) if mixing else total
        cur = self.norm(ctx, cur, w[self.ffn_norm])
        # the state short of the FFN's output: the sum, the checkpoints, the slots later layers fill
        parts = [ops.ggml_reshape_3d(ctx, total, hp.n_embd, 1, n)]
        rest = 1
        if banks:
            assert stack is not None
            parts.append(stack)
            rest = banked + 2
        if rest < self.slots:
            parts.append(self._slots(ctx, st, rest, self.slots - rest))
        state = parts[0]
        for part in parts[1:]:
            state = ops.ggml_concat(ctx, state, part, 1)
        residual = self._flat(ctx, state)
        if il not in self._moe:
            ffn = self._situ_ffn(ctx, w, cur, "")
            return common.LayerOut(writes, out=self.tail(ctx, il, ffn, None, residual, latent=False))
        logits = ops.ggml_mul_mat(ctx, w["ffn_gate_inp"], cur)  # (the router scores the full-width input)
        ids, weights = common.route(ctx, logits, self.router, w["exp_probs_b.bias"])
        routed_in = ops.ggml_mul_mat(ctx, w["ffn_routed_down"], cur) if "ffn_routed_down" in w else cur
        shared = self._situ_ffn(ctx, w, cur, "_shexp") if "ffn_gate_shexp" in w else None
        return common.LayerOut(writes, routed=common.Routed(routed_in, residual, ids, weights, shared))

    def _situ_ffn(self, ctx: Any, w: dict[str, Tensor], x: Tensor, suffix: str) -> Tensor:
        """A dense SiTU FFN: ffn_down(situ(ffn_gate · x, ffn_up · x)), of the dense layer or the shared expert."""
        gate = ops.ggml_mul_mat(ctx, w["ffn_gate" + suffix], x)
        up = ops.ggml_mul_mat(ctx, w["ffn_up" + suffix], x)
        return ops.ggml_mul_mat(ctx, w["ffn_down" + suffix], common.situ(ctx, gate, up, *self.situ))

    def tail(
        self, ctx: Any, il: int, experts: Tensor, shared: Tensor | None, residual: Tensor, latent: bool = True
    ) -> Tensor:
        """The experts' latent sum normed and projected up, plus the shared expert, added to the running sum."""
        w = self.w[il]
        out = experts
        if latent and "ffn_routed_norm" in w:
            out = self.norm(ctx, out, w["ffn_routed_norm"])
        if latent and "ffn_routed_up" in w:
            out = ops.ggml_mul_mat(ctx, w["ffn_routed_up"], out)
        if shared is not None:
            out = ops.ggml_add(ctx, out, shared)
        st, total = self._split(ctx, residual)
        return self._with_sum(ctx, st, ops.ggml_add(ctx, total, out))

    def tail_array(
        self, il: int, experts: np.ndarray, shared: np.ndarray | None, residual: np.ndarray
    ) -> np.ndarray | None:
        return None  # (a norm and a matrix product: the session computes `tail` in a graph)

    def router_input(self, ctx: Any, lo: common.LayerOut) -> Tensor:
        """The running sum (plus the shared expert): the part of the state that changes the most layer to layer."""
        r = lo.routed
        state = lo.out if r is None else r.residual
        assert state is not None
        total = self._split(ctx, state)[1]
        return total if r is None or r.shared is None else ops.ggml_add(ctx, total, r.shared)

    def head(self, ctx: Any, x: Tensor) -> Tensor:
        st, total = self._split(ctx, x)
        if self.block:
            total = self.res_mix(
                ctx, total, self._slots(ctx, st, 1, self.slots - 1), self.weights.get("output_res_score.weight")
            )
        return super().head(ctx, total)

    # ------------------------------------------------------------------------------------------ attention
    def attention(
        self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache
    ) -> tuple[Tensor, list[Tensor]]:
        hp, w = self.hp, self.w[il]
        if hp.is_recurrent(il):
            return self.kda(ctx, il, x, at.n, common.recurrent_cache(kv))
        cur, writes = mla.attention(ctx, hp, w, x, at, common.kv_cache(kv), None, self.kq_scale)
        if "attn_gate" in w:  # the attention output times sigmoid(attn_gate · x), element by element
            cur = ops.ggml_mul(ctx, cur, ops.ggml_sigmoid(ctx, ops.ggml_mul_mat(ctx, w["attn_gate"], x)))
        return ops.ggml_mul_mat(ctx, w["attn_output"], cur), writes

    def kda(self, ctx: Any, il: int, x: Tensor, n: int, cache: common.RecurrentCache) -> tuple[Tensor, list[Tensor]]:
        hp, w, k = self.hp, self.w[il], kda_keys(self.hp)
        hd, nh = k.head_dim, hp.n_head
        qkv, writes = delta_net.kda_qkv(ctx, w, x, cache, hp.ssm_d_conv, hd, nh)
        gate = ops.ggml_mul_mat(ctx, w["ssm_f_b"], ops.ggml_mul_mat(ctx, w["ssm_f_a"], x))
        gate = ops.ggml_add(ctx, gate, w["ssm_dt.bias"])
        decay = ops.ggml_reshape_3d(ctx, w["ssm_a"], 1, nh, 1)  # -exp(A_log), folded by the converter
        if k.gate_lower_bound > -math.inf:  # K3: lower_bound · sigmoid(exp(A_log) · (g + dt_bias))
            gate = ops.ggml_mul(ctx, ops.ggml_reshape_3d(ctx, gate, hd, nh, n), decay)
            gate = ops.ggml_scale(ctx, ops.ggml_sigmoid(ctx, ops.ggml_scale(ctx, gate, -1.0)), k.gate_lower_bound)
        else:  # kimi-linear's: -exp(A_log) · softplus(g + dt_bias)
            gate = ops.ggml_mul(ctx, ops.ggml_reshape_3d(ctx, ops.ggml_softplus(ctx, gate), hd, nh, n), decay)
        gate = ops.ggml_reshape_4d(ctx, gate, hd, nh, n, 1)
        beta = ops.ggml_sigmoid(ctx, ops.ggml_reshape_4d(ctx, ops.ggml_mul_mat(ctx, w["ssm_beta"], x), 1, nh, n, 1))
        out_gate = ops.ggml_mul_mat(ctx, w["ssm_g"], x)
        out, state_writes = delta_net.kda_out(ctx, w, qkv, gate, beta, out_gate, cache, hp.rms_eps)
        return out, writes + state_writes

    # ----------------------------------------------------------------------------------------------- FFN
    def expert_ffn(self, il: int) -> common.ExpertFFN:
        return common.ExpertFFN(situ=self.situ)

    def swiglu_limit(self, il: int) -> float:
        return 0.0
