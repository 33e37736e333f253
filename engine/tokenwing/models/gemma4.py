"""Gemma 4 (`gemma4`): Gemma 4 26B-A4B, its MoE model (llama.cpp: src/models/gemma4.cpp).

The token embedding scaled by sqrt(n_embd). A layer: RMSNorm → attention → RMSNorm (post_attention_norm) →
residual. Attention: per-head q/k RMSNorm, V RMS-normalised without a weight (V is the key projection where the layer
has no attn_v: Gemma 4's full layers), NEOX RoPE, a softmax scale of 1. Sliding-window layers (the file's per-layer
pattern) have their own head size, KV head count, rotary dims and rope base and attend over the window; full layers
rotate by the file's rope_freqs factors (1e30 for the pairs left unrotated: "proportional" RoPE). The FFN: a dense
GELU-gated FFN (ffn_norm → FFN); in a layer with a router, that FFN (post_ffw_norm_1 after it) plus the routed
GELU-gated experts on pre_ffw_norm_2's output (post_ffw_norm_2 after them), routed by a softmax over the router
applied to rms_norm(x) / sqrt(n_embd) · ffn_gate_inp.scale, the top-k weights normalised and each expert's output
scaled by ffn_down_exps.scale → post_ffw_norm → residual → × layer_output_scale where the file has one. The head:
output norm, output matrix (or the tied embedding), logits soft-capped by final_logit_softcapping (30 where the file
has none, as llama.cpp).

Not run (refused in one line): per-layer embeddings and KV shared across layers (Gemma 4 E2B / E4B, dense models).
Sliding-window layers keep a full-context cache masked to the window, as gpt-oss's do (exact; llama.cpp's iSWA cache
keeps only the window).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenwing.compute.ggml_lib import ROPE_NEOX, Tensor, ops
from tokenwing.errors import BadInputError, UnsupportedError
from tokenwing.format.gguf_io import KV, ValueType
from tokenwing.models import common, specs
from tokenwing.models.base import MoEModel, TensorCheck
from tokenwing.models.factory import Factory, common_kv, gate_up
from tokenwing.models.hparams import HParams, per_layer
from tokenwing.models.keys import Key, read_keys, write_keys
from tokenwing.models.specs import Parts, TensorSpec
from tokenwing.models.weights import ModelWeights

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape


@dataclass(frozen=True)
class Keys:
    """Gemma 4's own keys as llama.cpp's loader reads them (gemma4.cpp load_arch_hparams and the shared SWA keys)."""

    swa: tuple[bool, ...]  # attention.sliding_window_pattern: per layer, whether it attends over the window
    head_kv: tuple[int, ...]  # attention.head_count_kv per layer (the full layers have fewer)
    head_dim_swa: int  # attention.key_length_swa (= value_length_swa); the full layers' is key_length
    n_rot_swa: int  # rope.dimension_count_swa (default: rope.dimension_count)
    rope_base_swa: float  # rope.freq_base_swa (default 10000, llama.cpp's)
    softcap: float  # final_logit_softcapping (default 30, llama.cpp's; 0: none)
    n_embd_per_layer: int  # embedding_length_per_layer_input (E2B/E4B: per-layer embeddings)
    shared_kv_layers: int  # attention.shared_kv_layers: last layers reusing earlier layers' KV (E2B/E4B)

    def head_dim(self, hp: HParams, il: int) -> int:
        return self.head_dim_swa if self.swa[il] else hp.head_dim


# The family's own keys (models/keys.py: read here, written by the factory from the same table), by Keys field; 0 in
# key_length_swa and rope.dimension_count_swa: the full layers' (llama.cpp's defaults where the file has none)
KEYS: dict[str, Key] = {
    "head_dim_swa": Key("attention.key_length_swa", "u32", 0),
    "head_dim_v_swa": Key("attention.value_length_swa", "u32", 0),
    "n_rot_swa": Key("rope.dimension_count_swa", "u32", 0),
    "rope_base_swa": Key("rope.freq_base_swa", "f32", 10000.0),
    "softcap": Key("final_logit_softcapping", "f32", 30.0),
    "n_embd_per_layer": Key("embedding_length_per_layer_input", "u32"),
    "shared_kv_layers": Key("attention.shared_kv_layers", "u32", 0),
}


def keys(hp: HParams, where: str = "the model") -> Keys:
    """The family's keys from the file's (hp.keys), checked; one line naming the key otherwise. Its per-layer KV
    heads and window pattern are shared keys (`read_hparams` reads them; the heads' per-layer list is kept here)."""
    own = read_keys(KEYS, hp, where)
    pattern = hp.swa_pattern
    if not isinstance(pattern, tuple) or len(pattern) < hp.n_layer:
        raise BadInputError(f"{where}: gemma4.attention.sliding_window_pattern must have one flag per layer")
    head_kv = per_layer(hp, "attention.head_count_kv", hp.n_head_kv)
    if len(head_kv) < hp.n_layer or min(head_kv) <= 0 or any(hp.n_head % h for h in head_kv):
        raise BadInputError(f"{where}: gemma4.attention.head_count_kv must divide head_count in every layer")
    head_dim_swa = own.pop("head_dim_swa") or hp.head_dim
    if (own.pop("head_dim_v_swa") or head_dim_swa) != head_dim_swa or hp.head_dim_v != hp.head_dim:
        raise BadInputError(f"{where}: gemma4's key and value heads must be of one size (llama.cpp requires it)")
    own["n_rot_swa"] = own["n_rot_swa"] or hp.n_rot
    if not 0 < own["n_rot_swa"] <= head_dim_swa or own["n_rot_swa"] % 2:
        raise BadInputError(f"{where}: gemma4.rope.dimension_count_swa must be even, positive, at most the head")
    out = Keys(swa=tuple(pattern[: hp.n_layer]), head_kv=head_kv, head_dim_swa=head_dim_swa, **own)
    if any(out.swa) and hp.sliding_window <= 0:
        raise BadInputError(f"{where}: gemma4's sliding-window layers need attention.sliding_window")
    if out.n_embd_per_layer or out.shared_kv_layers:
        raise UnsupportedError(
            f"{where}: per-layer embeddings and shared KV layers (Gemma 4 E2B / E4B) are not run yet; "
            "Gemma 4 26B-A4B is"
        )
    return out


def _kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Gemma 4 (Gemma4Model): the full layers' head size as key_length and the
    sliding-window layers' as key_length_swa, KV heads and the window pattern per layer, both rotary counts (the
    full layers' whole head: rope_freqs leaves pairs unrotated), both rope bases, the soft-cap, the dense FFN's
    width, and no per-layer embeddings or shared KV layers (26B-A4B)."""
    a = "gemma4"
    kv = common_kv(s, a)
    full = [(i + 1) % s.full_attention_interval == 0 for i in range(s.n_block)]
    hd_full, kv_full = s.head_dim_full or 2 * s.head_dim, s.head_kv_full or max(1, s.n_head_kv // 2)
    kv[f"{a}.attention.key_length"] = KV.u32(hd_full)
    kv[f"{a}.attention.value_length"] = KV.u32(hd_full)
    kv[f"{a}.attention.head_count_kv"] = KV.array(ValueType.UINT32, [kv_full if f else s.n_head_kv for f in full])
    kv[f"{a}.attention.sliding_window_pattern"] = KV.array(ValueType.BOOL, [not f for f in full])
    kv[f"{a}.attention.sliding_window"] = KV.u32(s.sliding_window)
    kv[f"{a}.rope.dimension_count"] = KV.u32(hd_full)
    kv[f"{a}.feed_forward_length"] = KV.u32(s.n_ff_dense)
    own = {"head_dim_swa": s.head_dim, "head_dim_v_swa": s.head_dim, "n_rot_swa": s.rot, "rope_base_swa": 10000.0}
    own |= {"softcap": 30.0, "n_embd_per_layer": 0, "shared_kv_layers": 0}
    return kv | write_keys(KEYS, a, own)


def _tensors(s: ModelShape, hp: HParams, parts: Parts) -> list[TensorSpec]:
    """The family's list, its gate and up experts fused where the shape says (`gate_up`)."""
    return gate_up(s, Gemma4.tensors(hp, parts))


class Gemma4(MoEModel):
    arch = "gemma4"
    factory = Factory(
        "Gemma 4 (26B-A4B): sliding-window and full layers of their own head sizes, per-layer norms, a dense GELU "
        "FFN beside GELU experts, logit soft-capping",
        _kv,
        tensors=_tensors,
        takes=frozenset({"n_dense_lead", "n_rot", "fused_gate_up"}),
    )
    rope_mode = ROPE_NEOX
    normalize_weights = True  # (llama.cpp's gemma4 graph: softmax, weights normalised, scale 1)

    def __init__(self, hp: HParams, weights: ModelWeights, streamed: list[int]) -> None:
        super().__init__(hp, weights, streamed)
        self.keys = keys(hp)
        self.swa = self.keys.swa
        # The sliding-window layers' RoPE: their rotary dims and base, unscaled (llama.cpp: freq_scale_train_swa 1)
        self.rope_swa = dataclasses.replace(
            self.rope, n_rot=self.keys.n_rot_swa, base=self.keys.rope_base_swa, freq_scale=1.0
        )

    @property
    def window(self) -> int:
        return self.hp.sliding_window if any(self.swa) else 0

    # ------------------------------------------------------------------------------------------- tensors
    @classmethod
    def tensors(cls, hp: HParams, parts: Parts) -> list[TensorSpec]:
        """Every tensor of a Gemma 4 file as llama.cpp's loader creates it (llama.cpp: load_arch_tensors). attn_v is
        listed for the sliding-window layers, optional (26B-A4B's full layers have none: V is the key projection);
        ffn_down_exps.scale and layer_output_scale are optional in llama.cpp and written by the factory."""
        k, e, n, ff = keys(hp), hp.n_embd, hp.n_expert, parts.ff_dense
        first, last = specs.head(hp)
        out = list(first)
        if not all(k.swa):  # (llama.cpp creates it with the first full layer: a file without one has none)
            out.append(TensorSpec("rope_freqs.weight", (hp.head_dim // 2,), "rope_freqs"))
        for il in range(hp.n_layer):
            p, hd = f"blk.{il}.", k.head_dim(hp, il)
            q, kv = hp.n_head * hd, k.head_kv[il] * hd
            out += [
                TensorSpec(p + "attn_norm.weight", (e,), "norm"),
                TensorSpec(p + "attn_q.weight", (e, q), "matrix"),
                TensorSpec(p + "attn_k.weight", (e, kv), "matrix"),
            ]
            if k.swa[il]:
                out.append(TensorSpec(p + "attn_v.weight", (e, kv), "matrix", optional=True))
            out += [
                TensorSpec(p + "attn_output.weight", (q, e), "matrix"),
                TensorSpec(p + "attn_q_norm.weight", (hd,), "norm"),
                TensorSpec(p + "attn_k_norm.weight", (hd,), "norm"),
                TensorSpec(p + "post_attention_norm.weight", (e,), "norm"),
                TensorSpec(p + "layer_output_scale.weight", (1,), "norm", optional=True),
                TensorSpec(p + "ffn_norm.weight", (e,), "norm"),
                TensorSpec(p + "ffn_gate.weight", (e, ff), "matrix"),
                TensorSpec(p + "ffn_up.weight", (e, ff), "matrix"),
                TensorSpec(p + "ffn_down.weight", (ff, e), "matrix"),
                TensorSpec(p + "post_ffw_norm.weight", (e,), "norm"),
            ]
            if il in parts.moe_layers:
                fe = parts.ff_exp
                out += [
                    TensorSpec(p + "ffn_gate_inp.weight", (e, n), "router"),
                    TensorSpec(p + "ffn_gate_inp.scale", (e,), "norm"),
                    TensorSpec(p + "pre_ffw_norm_2.weight", (e,), "norm"),
                    TensorSpec(p + "post_ffw_norm_1.weight", (e,), "norm"),
                    TensorSpec(p + "post_ffw_norm_2.weight", (e,), "norm"),
                    TensorSpec(p + "ffn_gate_exps.weight", (e, fe, n), "expert"),
                    TensorSpec(p + "ffn_up_exps.weight", (e, fe, n), "expert"),
                    TensorSpec(p + "ffn_down_exps.weight", (fe, e, n), "expert"),
                    TensorSpec(p + "ffn_down_exps.scale", (n,), "norm", optional=True),
                ]
        return out + last

    @classmethod
    def file_parts(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int]) -> Parts:
        """Every layer has the dense FFN (its width the first layer's); those with experts are the repack's."""
        return Parts(moe_layers=frozenset(streamed), ff_dense=shapes.get("blk.0.ffn_gate.weight", (0, 0))[-1])

    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        k = keys(hp, where)
        super().check(hp, shapes, streamed, where)
        c = TensorCheck(hp, shapes, where)
        for il in range(hp.n_layer):  # (a full layer's attn_v is not listed: checked where a file has one)
            name = f"blk.{il}.attn_v.weight"
            if not k.swa[il] and c.has(name):
                c.need(name, (hp.n_embd, k.head_kv[il] * hp.head_dim))

    @classmethod
    def kv_layer(cls, hp: HParams, il: int) -> common.KVSpec:
        """K and V of the layer's own KV heads at its own head size (a sliding-window layer's cache is full-context,
        masked to the window)."""
        k = keys(hp)
        width = k.head_dim(hp, il) * k.head_kv[il]
        return common.KVSpec(width, width)

    # --------------------------------------------------------------------------------------------- graph
    def embed(self, ctx: Any, ids: Tensor) -> Tensor:
        x = ops.ggml_get_rows(ctx, self.weights.get("token_embd.weight"), ids)
        return ops.ggml_scale(ctx, x, float(np.sqrt(np.float32(self.hp.n_embd))))

    def layer(self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache) -> common.LayerOut:
        w = self.w[il]
        attn, writes = self.attention(ctx, il, self.norm(ctx, x, w["attn_norm"]), at, kv)
        attn_out = ops.ggml_add(ctx, self.norm(ctx, attn, w["post_attention_norm"]), x)
        mlp = self._ffn(ctx, w, self.norm(ctx, attn_out, w["ffn_norm"]))
        if il not in self._moe:
            return common.LayerOut(writes, out=self._finish(ctx, il, mlp, attn_out))
        shared = self.norm(ctx, mlp, w["post_ffw_norm_1"])
        return common.LayerOut(writes, routed=self.routed(ctx, il, attn_out, attn_out, shared))

    def attention(
        self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache
    ) -> tuple[Tensor, list[Tensor]]:
        hp, w, n, swa = self.hp, self.w[il], at.n, self.swa[il]
        hd, nkv = self.keys.head_dim(hp, il), self.keys.head_kv[il]
        rope, factors = (self.rope_swa, None) if swa else (self.rope, self.weights.get("rope_freqs.weight"))
        q = ops.ggml_reshape_3d(ctx, ops.ggml_mul_mat(ctx, w["attn_q"], x), hd, hp.n_head, n)
        q = _rope(ctx, self.norm(ctx, q, w["attn_q_norm"]), at.positions, rope, factors)
        k_proj = ops.ggml_mul_mat(ctx, w["attn_k"], x)
        v_proj = ops.ggml_mul_mat(ctx, w["attn_v"], x) if "attn_v" in w else k_proj  # (V is K's projection)
        k = self.norm(ctx, ops.ggml_reshape_3d(ctx, k_proj, hd, nkv, n), w["attn_k_norm"])
        v = ops.ggml_rms_norm(ctx, ops.ggml_reshape_3d(ctx, v_proj, hd, nkv, n), hp.rms_eps)
        k = _rope(ctx, k, at.positions, rope, factors)
        mask = at.mask_swa if swa else None
        cur, writes = common.attend(ctx, q, k, v, at, common.kv_cache(kv), 1.0, mask=mask)
        return ops.ggml_mul_mat(ctx, w["attn_output"], cur), writes

    def _ffn(self, ctx: Any, w: dict[str, Tensor], x: Tensor) -> Tensor:
        """The dense GELU-gated FFN (llama.cpp's build_ffn with LLM_FFN_GELU, LLM_FFN_PAR)."""
        g, u = ops.ggml_mul_mat(ctx, w["ffn_gate"], x), ops.ggml_mul_mat(ctx, w["ffn_up"], x)
        return ops.ggml_mul_mat(ctx, w["ffn_down"], ops.ggml_geglu_split(ctx, g, u))

    def routed(self, ctx: Any, il: int, cur: Tensor, residual: Tensor, shared: Tensor | None) -> common.Routed:
        """The router on rms_norm(attn_out) / sqrt(n_embd) · ffn_gate_inp.scale; the experts on pre_ffw_norm_2's
        output; each selected expert's weight times its ffn_down_exps.scale (llama.cpp scales the expert's output
        by it, then by the weight: the same product up to rounding)."""
        w, n = self.w[il], int(cur.contents.ne[1])
        tmp = ops.ggml_rms_norm(ctx, cur, self.hp.rms_eps)
        tmp = ops.ggml_scale(ctx, tmp, float(np.float32(1.0) / np.sqrt(np.float32(self.hp.n_embd))))
        tmp = ops.ggml_mul(ctx, tmp, w["ffn_gate_inp.scale"])
        ids, weights = common.route(ctx, ops.ggml_mul_mat(ctx, w["ffn_gate_inp"], tmp), self.router)
        if "ffn_down_exps.scale" in w:
            k = self.router.k
            e = self.hp.n_expert  # (llama.cpp's build_lora_mm_id: the scales repeated per token, then picked)
            per = ops.ggml_repeat_4d(ctx, ops.ggml_reshape_3d(ctx, w["ffn_down_exps.scale"], 1, e, 1), 1, e, n, 1)
            picked = ops.ggml_get_rows(ctx, per, ids)  # [1, k, n]
            weights = ops.ggml_mul(ctx, weights, ops.ggml_reshape_2d(ctx, picked, k, n))
        experts_in = self.norm(ctx, cur, w["pre_ffw_norm_2"])
        return common.Routed(experts_in, residual, ids, weights, shared)

    def expert_ffn(self, il: int) -> common.ExpertFFN:
        return common.ExpertFFN(gelu=True)

    def tail(self, ctx: Any, il: int, experts: Tensor, shared: Tensor | None, residual: Tensor) -> Tensor:
        """post_ffw_norm_2 on the experts' sum, added to the normed dense FFN, then as a dense layer ends."""
        assert shared is not None
        moe = self.norm(ctx, experts, self.w[il]["post_ffw_norm_2"])
        return self._finish(ctx, il, ops.ggml_add(ctx, shared, moe), residual)

    def tail_array(
        self, il: int, experts: np.ndarray, shared: np.ndarray | None, residual: np.ndarray
    ) -> np.ndarray | None:
        return None  # (norms: the tail runs in a graph)

    def _finish(self, ctx: Any, il: int, ffn: Tensor, attn_out: Tensor) -> Tensor:
        """post_ffw_norm, the residual, then the layer's output scale where the file has one."""
        w = self.w[il]
        out = ops.ggml_add(ctx, self.norm(ctx, ffn, w["post_ffw_norm"]), attn_out)
        return ops.ggml_mul(ctx, out, w["layer_output_scale"]) if "layer_output_scale" in w else out

    def head(self, ctx: Any, x: Tensor) -> Tensor:
        logits = super().head(ctx, x)
        cap = self.keys.softcap
        if not cap:
            return logits
        logits = ops.ggml_scale(ctx, logits, float(np.float32(1.0) / np.float32(cap)))
        return ops.ggml_scale(ctx, ops.ggml_tanh(ctx, logits), cap)

    def router_norm(self, il: int) -> Tensor:
        """The lookahead's norm before the router: the router's own scale (its 1/sqrt(n_embd) ranks alike)."""
        return self.w[il]["ffn_gate_inp.scale"]


def _rope(ctx: Any, x: Tensor, positions: Tensor, r: common.Rope, factors: Tensor | None) -> Tensor:
    """NEOX RoPE with the full layers' frequency factors (llama.cpp passes rope_freqs to ggml_rope_ext there)."""
    scaling = (r.n_ctx_orig, r.base, r.freq_scale, r.ext_factor, r.attn_factor, r.beta_fast, r.beta_slow)
    return ops.ggml_rope_ext(ctx, x, positions, factors, r.n_rot, r.mode, *scaling)
