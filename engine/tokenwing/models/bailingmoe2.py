"""Ling 2.0 (`bailingmoe2`): Ling-mini-2.0 (16B, 1.4B active), Ling-flash-2.0 (100B, 6.1B active) and the Ring 2.0
reasoning models of the same shape.

A layer: RMSNorm → attention (GQA from one fused projection, attn_qkv, whose rows are the query's, the key's and
the value's in turn; q and k RMS-normalised per head; NEOX RoPE on the first rope.dimension_count dims of each head,
half of them in Ling 2.0) → residual → RMSNorm → a dense SwiGLU FFN in the leading_dense_block_count first layers,
else routed SwiGLU experts plus the shared expert: the router's scoring function is the file's (sigmoid in Ling
2.0), its top-k adds the per-expert selection bias where the file has one, within the best expert groups where the
file has groups (Ling 2.0: 8, using 4), the weights normalised and scaled as the file says → residual. The
next-token-prediction blocks after the last layer are kept in the file, neither loaded nor run (llama.cpp:
src/models/bailingmoe2.cpp; its keys are the shared ones `read_hparams` reads, none of the family's own).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import KV
from tokenwing.models.base import MoEModel
from tokenwing.models.factory import Factory, check_groups, common_kv, groups_kv, sigmoid_routed_kv
from tokenwing.models.hparams import HParams
from tokenwing.models.specs import Parts, TensorSpec

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape


def _kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Ling 2.0 (BailingMoeV2Model): rotary dims, dense layers first, the shared
    expert's width, routing (scale, norm, sigmoid, groups where set), the vocabulary size, the MTP block count."""
    a = "bailingmoe2"
    kv = common_kv(s, a)
    kv.update(sigmoid_routed_kv(s, a))
    kv[f"{a}.rope.dimension_count"] = KV.u32(s.rot)
    kv[f"{a}.vocab_size"] = KV.u32(s.vocab_size)
    # (per shared expert: llama.cpp multiplies it by expert_shared_count)
    kv[f"{a}.expert_shared_feed_forward_length"] = KV.u32(s.n_ff_shexp)
    kv.update(groups_kv(s, a))
    kv[f"{a}.nextn_predict_layers"] = KV.u32(s.n_mtp)
    return kv


def _check(s: ModelShape) -> None:
    """What llama.cpp's Ling 2.0 loader and graph take."""
    if s.n_head * s.head_dim != s.n_embd:
        raise ValueError("bailingmoe2's query heads fill the hidden size: --n-head x --head-dim must be --n-embd")
    if s.q_lora_rank or s.kv_lora_rank or s.v_head_dim or s.legacy_kv_b:
        raise ValueError("bailingmoe2 has no MLA ranks or head splits")
    if not 0 < s.rot <= s.head_dim or s.rot % 2:
        raise ValueError("bailingmoe2's --n-rot must be even, positive and at most --head-dim")
    if s.n_shared_exp < 1:
        raise ValueError("bailingmoe2 runs a shared expert in every MoE layer: --n-shared-exp must be at least 1")
    if s.n_mtp > 1:
        raise ValueError("llama.cpp's converter writes at most one next-token-prediction block: --n-mtp 0 or 1")
    check_groups(s)


class BailingMoE2(MoEModel):
    arch = "bailingmoe2"
    factory = Factory(
        "Ling 2.0: GQA from a fused QKV with q/k RMSNorm, partial RoPE, group-limited sigmoid router with "
        "selection bias, shared expert",
        _kv,
        _check,
        takes=frozenset({"n_dense_lead", "n_rot", "n_mtp", "n_expert_group", "n_group_used"}),
    )
    qk_norm = True
    shared_experts = "required"  # (llama.cpp reads expert_shared_count as required and loads the shared tensors)
    routing_keys = True
    normalize_weights = False  # llama.cpp's default where the file has no expert_weights_norm
    selection_bias = None  # (exp_probs_b is optional in llama.cpp's loader)

    @classmethod
    def attention_tensors(cls, hp: HParams, il: int, parts: Parts) -> list[TensorSpec]:
        """GQA from one fused projection (the query's rows, the key's, the value's) with per-head q/k norms."""
        p, e = f"blk.{il}.", hp.n_embd
        q, kv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        return [
            TensorSpec(p + "attn_norm.weight", (e,), "norm"),
            TensorSpec(p + "attn_qkv.weight", (e, q + 2 * kv), "matrix"),
            TensorSpec(p + "attn_output.weight", (q, e), "matrix"),
            TensorSpec(p + "attn_q_norm.weight", (hp.head_dim,), "norm"),
            TensorSpec(p + "attn_k_norm.weight", (hp.head_dim,), "norm"),
        ]

    @classmethod
    def tensors(cls, hp: HParams, parts: Parts) -> list[TensorSpec]:
        """The default block's list; output.weight required, as llama.cpp's loader has it."""
        return [dataclasses.replace(t, optional=False) for t in super().tensors(hp, parts)]

    @classmethod
    def mtp_tensors(cls, hp: HParams, il: int) -> list[TensorSpec]:
        """A Ling next-token-prediction block's own tensors (llama.cpp's optional ones left out)."""
        p, e = f"blk.{il}.", hp.n_embd
        return [
            TensorSpec(p + "nextn.eh_proj.weight", (2 * e, e), "matrix"),
            TensorSpec(p + "nextn.enorm.weight", (e,), "norm"),
            TensorSpec(p + "nextn.hnorm.weight", (e,), "norm"),
            TensorSpec(p + "layer_output_norm.weight", (e,), "norm"),
        ]

    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        if hp.gating == 0:  # (llama.cpp requires the key: it refuses such a file too)
            raise BadInputError(f"{where}: {cls.arch}.expert_gating_func is missing from the metadata")
        if hp.n_head * hp.head_dim != hp.n_embd:
            # llama.cpp's loader sizes attn_qkv's query part as embedding_length and its graph as the heads'
            raise BadInputError(f"{where}: {cls.arch}'s query heads must fill embedding_length")
        if set(streamed) != set(range(hp.n_dense_lead, hp.n_layer)):
            raise BadInputError(f"{where}: the layers with experts are not those after leading_dense_block_count")
        super().check(hp, shapes, streamed, where)
