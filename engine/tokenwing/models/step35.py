"""Step-3.5-Flash (`step35`): StepFun's 196B / 11B-active MoE model (llama.cpp: src/models/step35.cpp).

A layer: RMSNorm → attention → residual → RMSNorm → a dense SwiGLU FFN (the leading layers: those without a
router, as llama.cpp tells them) or a sigmoid router (llama.cpp's default where the file has no
expert_gating_func) whose top-k adds the selection bias where the file has one, weights normalised and scaled as
the file says → SwiGLU experts plus the shared expert, always → residual. The file's per-layer swiglu_clamp_exp and
swiglu_clamp_shexp limit the routed experts' and the shared expert's (or a dense FFN's) SwiGLU where set.

Attention is hybrid, all of it per layer: the file's sliding_window_pattern marks the sliding-window layers (Step
3.5: three of four), which attend over the last attention.sliding_window positions and rotate by
rope.freq_base_swa (10,000: llama.cpp's default) unscaled; attention.head_count and head_count_kv are lists (the
sliding-window layers have more query heads: 96 against 64). q, k, v from their own projections; per-head q/k
RMSNorm where the file has them; NEOX RoPE on rope.dimension_count / 2 dims in the full layers (llama.cpp halves it:
"full_attention layer only use half of the RoPE dimensions"), with the file's rope_freqs factors where it has
them, and on rope.dimension_count_swa (default: the whole rope.dimension_count) in the sliding-window ones; attention
at 1/√key_length; then, where the file has attn_gate, each head's output times sigmoid(attn_gate · x) of the
layer's normed input, before the output projection.

Sliding-window layers keep a full-context cache masked to the window, as gpt-oss's, Gemma 4's and MiMo's do
(exact; llama.cpp's iSWA cache keeps only the window). The next-token-prediction blocks after the last layer are
kept in the file, never run, as every family's.
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

# The family's own keys (models/keys.py: read here, written by the factory from the same table); the per-layer
# heads, the window and its pattern, and the SwiGLU limits are shared keys (`read_hparams`)
KEYS: dict[str, Key] = {
    "rope_base_swa": Key("rope.freq_base_swa", "f32", 10000.0),  # (llama.cpp's default: llama-hparams.h)
    "n_rot_swa": Key("rope.dimension_count_swa", "u32", 0),  # (0: rope.dimension_count, llama.cpp's default)
}
SWIGLU_EPS = 1e-6  # a limit at or below this is none (llama.cpp's build_ffn / build_moe_ffn)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Per layer: whether it attends over the window, its query heads, its KV heads and the dims it rotates."""

    swa: tuple[bool, ...]
    heads: tuple[int, ...]
    head_kv: tuple[int, ...]
    n_rot: tuple[int, ...]

    @property
    def n_rot_max(self) -> int:
        return max(self.n_rot)


def layout(hp: HParams, where: str = "the model") -> Layout:
    """The window pattern (one flag per layer: llama.cpp's step35 loader requires the list), the per-layer heads
    and rotary dims, checked; one line naming the key otherwise."""
    pattern = hp.swa_pattern
    if not isinstance(pattern, tuple) or len(pattern) < hp.n_layer:
        raise BadInputError(f"{where}: {hp.arch}.attention.sliding_window_pattern must have one flag per layer")
    swa = tuple(pattern[: hp.n_layer])
    heads = per_layer(hp, "attention.head_count", hp.n_head)
    head_kv = per_layer(hp, "attention.head_count_kv", hp.n_head_kv)
    if len(head_kv) < hp.n_layer or min(head_kv) <= 0 or any(q % k for q, k in zip(heads, head_kv, strict=True)):
        raise BadInputError(f"{where}: {hp.arch}.attention.head_count_kv must divide head_count in every layer")
    if any(swa) and hp.sliding_window <= 0:
        raise BadInputError(f"{where}: {hp.arch}'s sliding-window layers need attention.sliding_window")
    n_rot_swa = read_keys(KEYS, hp, where)["n_rot_swa"] or hp.n_rot
    n_rot_full = hp.n_rot // 2  # (llama.cpp: the full layers rotate half of rope.dimension_count)
    if n_rot_full % 2 or not 0 < n_rot_swa <= hp.head_dim or n_rot_swa % 2:
        raise BadInputError(
            f"{where}: {hp.arch}'s rotary dims (half of rope.dimension_count in the full layers, "
            "rope.dimension_count_swa in the others) must be even, positive and at most the head"
        )
    return Layout(swa, heads, head_kv, tuple(n_rot_swa if s else n_rot_full for s in swa))


def full_layer(s: ModelShape, il: int) -> bool:
    """The factory's pattern, Step-3.5-Flash's layer_types: a full layer, then full_attention_interval - 1
    sliding-window ones (Step 3.5: 1 of 4)."""
    return il % s.full_attention_interval == 0


def full_heads(s: ModelShape) -> int:
    """The full layers' query heads: two thirds of the sliding-window layers' (Step 3.5: 64 against 96), a multiple
    of their KV heads."""
    kv = s.head_kv_full or s.n_head_kv
    return max(kv, s.n_head * 2 // 3 // kv * kv)


def _kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Step-3.5-Flash (Step35Model): query and KV heads and the window pattern per
    block (BOOL flags), the window, whole heads as rope.dimension_count (the full layers rotate half of it), both
    rope bases, the dense layers' and the shared expert's widths, routing (normalised, scaled) and, where
    the shape sets one, a SwiGLU limit in the last layer (Step 3.5's limits sit in its last layers)."""
    a = "step35"
    kv = common_kv(s, a)
    full = [full_layer(s, il) for il in range(s.n_block)]
    kv_full = s.head_kv_full or s.n_head_kv
    kv[f"{a}.attention.head_count"] = KV.array(ValueType.UINT32, [full_heads(s) if f else s.n_head for f in full])
    kv[f"{a}.attention.head_count_kv"] = KV.array(ValueType.UINT32, [kv_full if f else s.n_head_kv for f in full])
    kv[f"{a}.attention.sliding_window_pattern"] = KV.array(ValueType.BOOL, [not f for f in full])
    kv[f"{a}.attention.sliding_window"] = KV.u32(s.sliding_window)
    kv[f"{a}.rope.dimension_count"] = KV.u32(s.rot)
    # (no expert_gating_func: the converter writes none, llama.cpp's step35 loader then takes sigmoid)
    kv[f"{a}.feed_forward_length"] = KV.u32(s.n_ff_dense)
    kv[f"{a}.leading_dense_block_count"] = KV.u32(s.n_dense_lead)
    kv[f"{a}.expert_shared_feed_forward_length"] = KV.u32(s.n_ff_shexp)
    kv[f"{a}.expert_weights_scale"] = KV.f32(s.expert_weights_scale)
    kv[f"{a}.expert_weights_norm"] = KV.boolean(True)
    if s.swiglu_limit:
        limits = [s.swiglu_limit if il == s.n_layer - 1 else 0.0 for il in range(s.n_block)]
        kv[f"{a}.swiglu_clamp_exp"] = KV.array(ValueType.FLOAT32, limits)
        kv[f"{a}.swiglu_clamp_shexp"] = KV.array(ValueType.FLOAT32, limits)
    return kv | write_keys(KEYS, a, {"rope_base_swa": 10000.0, "n_rot_swa": s.rot})


def _check(s: ModelShape) -> None:
    """What llama.cpp's step35 loader and graph take."""
    kv_full = s.head_kv_full or s.n_head_kv
    if s.n_head % s.n_head_kv or full_heads(s) % kv_full:
        raise ValueError("step35's query heads must be a multiple of the KV heads in both kinds of layer")
    if s.rot > s.head_dim or s.rot % 4:
        raise ValueError(
            "step35's --n-rot must be a multiple of 4 (the full layers rotate half) and at most --head-dim"
        )
    if s.sliding_window <= 0 or s.full_attention_interval < 2:
        raise ValueError("step35 needs a positive --sliding-window and a --full-attention-interval of 2 or more")
    if s.n_shared_exp != 1:
        raise ValueError("step35 runs one shared expert in every MoE layer: --n-shared-exp 1")


class Step35(MoEModel):
    arch = "step35"
    factory = Factory(
        "Step-3.5-Flash: hybrid sliding-window and full attention with per-layer query and KV heads, half the RoPE "
        "dims in full layers, q/k RMSNorm, a head-wise sigmoid attention gate, dense leading layers, sigmoid "
        "router with selection bias, shared expert, SwiGLU limits",
        _kv,
        _check,
        takes=frozenset({"n_dense_lead", "n_rot", "n_shared_exp"}),
    )
    rope_mode = ROPE_NEOX
    shared_experts = "required"  # (llama.cpp's graph adds the shared expert in every MoE layer)
    sigmoid_router = True  # (llama.cpp's default for step35 where the file has no expert_gating_func)
    normalize_weights = False  # (llama.cpp's default where the file has no expert_weights_norm)
    routing_keys = True
    selection_bias = None  # (exp_probs_b: TENSOR_NOT_REQUIRED)

    def __init__(self, hp: HParams, weights: ModelWeights, streamed: list[int]) -> None:
        super().__init__(hp, weights, streamed)
        self.layout = layout(hp)
        own = read_keys(KEYS, hp, "the model")
        # Per layer its RoPE: the full layers' the file's scaling on half the dims; the sliding-window layers' their
        # base, unscaled (llama.cpp: rope_freq_scale_train_swa 1)
        swa = dataclasses.replace(self.rope, base=own["rope_base_swa"], freq_scale=1.0)
        self.ropes = [
            dataclasses.replace(swa if s else self.rope, n_rot=r)
            for s, r in zip(self.layout.swa, self.layout.n_rot, strict=True)
        ]

    @property
    def window(self) -> int:
        return self.hp.sliding_window if any(self.layout.swa) else 0

    # ------------------------------------------------------------------------------------------- tensors
    @classmethod
    def tensors(cls, hp: HParams, parts: Parts) -> list[TensorSpec]:
        """llama.cpp's loader (load_block_trunk): the RoPE factors once (optional), then per layer its own heads'
        q, k, v and output, q/k norms and the head-wise gate (both optional), then a dense FFN or the router, its
        selection bias, the experts and the shared expert; the output required."""
        lay, e, d = layout(hp), hp.n_embd, hp.head_dim
        first, last = specs.head(hp)
        out = [*first, TensorSpec("rope_freqs.weight", (lay.n_rot_max // 2,), "norm", optional=True)]
        for il in range(hp.n_layer):
            p, nh, nkv = f"blk.{il}.", lay.heads[il], lay.head_kv[il]
            out += [
                TensorSpec(p + "attn_norm.weight", (e,), "norm"),
                TensorSpec(p + "attn_q_norm.weight", (d,), "norm", optional=True),
                TensorSpec(p + "attn_k_norm.weight", (d,), "norm", optional=True),
                TensorSpec(p + "attn_q.weight", (e, nh * d), "matrix"),
                TensorSpec(p + "attn_k.weight", (e, nkv * d), "matrix"),
                TensorSpec(p + "attn_v.weight", (e, nkv * hp.head_dim_v), "matrix"),
                TensorSpec(p + "attn_output.weight", (nh * hp.head_dim_v, e), "matrix"),
                TensorSpec(p + "attn_gate.weight", (e, nh), "matrix", optional=True),
            ]
            out += cls.ffn_tensors(hp, il, parts)
        return [*out, last[0], dataclasses.replace(last[1], optional=False)]

    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        layout(hp, where)
        if hp.head_dim_v != hp.head_dim:  # (llama.cpp's graph reshapes the gated output by the key's head size)
            raise BadInputError(f"{where}: {cls.arch}'s key and value heads must be of one size")
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
        """step35.cpp's order: q, k, v; per-head q/k norms; NEOX RoPE of the layer's kind (the factors in full
        layers); attention at 1/√key_length; the head-wise sigmoid gate of x; the output projection."""
        hp, w, n, d = self.hp, self.w[il], at.n, self.hp.head_dim
        nh, nkv, swa = self.layout.heads[il], self.layout.head_kv[il], self.layout.swa[il]
        q = ops.ggml_reshape_3d(ctx, ops.ggml_mul_mat(ctx, w["attn_q"], x), d, nh, n)
        k = ops.ggml_reshape_3d(ctx, ops.ggml_mul_mat(ctx, w["attn_k"], x), d, nkv, n)
        v = ops.ggml_reshape_3d(ctx, ops.ggml_mul_mat(ctx, w["attn_v"], x), hp.head_dim_v, nkv, n)
        if "attn_q_norm" in w:
            q = common.rms_norm(ctx, q, w["attn_q_norm"], hp.rms_eps)
        if "attn_k_norm" in w:
            k = common.rms_norm(ctx, k, w["attn_k_norm"], hp.rms_eps)
        has_factors = not swa and self.weights.has("rope_freqs.weight")
        factors = self.weights.get("rope_freqs.weight") if has_factors else None
        q, k = self._rope(ctx, q, at.positions, il, factors), self._rope(ctx, k, at.positions, il, factors)
        mask = at.mask_swa if swa else None
        cur, writes = common.attend(ctx, q, k, v, at, common.kv_cache(kv), 1.0 / math.sqrt(d), mask=mask)
        if "attn_gate" in w:
            gate = ops.ggml_reshape_3d(ctx, ops.ggml_sigmoid(ctx, ops.ggml_mul_mat(ctx, w["attn_gate"], x)), 1, nh, n)
            cur = ops.ggml_reshape_2d(
                ctx, ops.ggml_mul(ctx, ops.ggml_reshape_3d(ctx, cur, hp.head_dim_v, nh, n), gate), hp.head_dim_v * nh, n
            )
        return ops.ggml_mul_mat(ctx, w["attn_output"], cur), writes

    def _rope(self, ctx: Any, x: Tensor, positions: Tensor, il: int, factors: Tensor | None) -> Tensor:
        r = self.ropes[il]
        scaling = (r.n_ctx_orig, r.base, r.freq_scale, r.ext_factor, r.attn_factor, r.beta_fast, r.beta_slow)
        return ops.ggml_rope_ext(ctx, x, positions, factors, r.n_rot, r.mode, *scaling)

    # ----------------------------------------------------------------------------------------------- FFN
    def expert_ffn(self, il: int) -> common.ExpertFFN:
        limit = self.hp.swiglu_limit_exp[il] if il < len(self.hp.swiglu_limit_exp) else 0.0
        return common.ExpertFFN(limit=limit) if limit > SWIGLU_EPS else common.SWIGLU

    def swiglu_limit(self, il: int) -> float:
        return self.hp.swiglu_limit_shexp[il] if il < len(self.hp.swiglu_limit_shexp) else 0.0
