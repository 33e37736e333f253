"""Hy3 (`hy_v3`): Tencent's HY V3 MoE (tencent/Hy3, HYV3ForCausalLM; llama.cpp names its 48-layer form 30B-A3B).

A layer: RMSNorm → attention (GQA from separate q, k, v projections without biases; q and k RMS-normalised per head,
then NEOX RoPE over the whole head) → residual → RMSNorm → a dense SwiGLU FFN where the layer has no router (the
leading first_k_dense_replace layers: llama.cpp tells them by the missing ffn_gate_inp, the converter writes no
leading_dense_block_count), else routed SwiGLU experts, chosen by a sigmoid router whose top-k adds the per-expert
selection bias where the file has one, weighted as expert_weights_norm / expert_weights_scale say, plus one ungated
shared expert of expert_shared_feed_forward_length (moe_intermediate_size × num_shared_experts) → residual. The
next-token-prediction blocks after the last layer (a whole block plus nextn.{eh_proj,enorm,hnorm} and the block's
final norm as nextn.shared_head_norm) are kept in the file, neither loaded nor run. No sliding window, no sinks, no
partial rotary (llama.cpp: src/models/hy-v3.cpp; its keys are the shared ones `read_hparams` reads). Its vocabulary
is a GPT-2-style BPE (the converter's `_set_vocab_gpt2`); the factory's files take the factory's default one.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import KV
from tokenwing.models.base import MoEModel
from tokenwing.models.factory import Factory, common_kv
from tokenwing.models.hparams import HParams
from tokenwing.models.specs import Parts, TensorSpec

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape


def _kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Hy3 (HYV3Model): the dense layers' width, the shared expert's (per layer, not
    per shared expert: llama.cpp takes it as it is), a sigmoid router whose top-k weights are normalised and scaled,
    the MTP block count where there is one; no leading_dense_block_count (the tensors tell)."""
    a = "hy_v3"
    kv = common_kv(s, a)
    kv[f"{a}.feed_forward_length"] = KV.u32(s.n_ff_dense)
    kv[f"{a}.rope.dimension_count"] = KV.u32(s.head_dim)
    kv[f"{a}.expert_shared_feed_forward_length"] = KV.u32(s.n_ff_shexp * s.n_shared_exp)
    kv[f"{a}.expert_weights_norm"] = KV.boolean(True)
    kv[f"{a}.expert_weights_scale"] = KV.f32(s.expert_weights_scale)
    kv[f"{a}.expert_gating_func"] = KV.u32(2)  # sigmoid
    if s.n_mtp:
        kv[f"{a}.nextn_predict_layers"] = KV.u32(s.n_mtp)
    return kv


def _check(s: ModelShape) -> None:
    """What llama.cpp's Hy3 loader and graph take."""
    if s.n_rot and s.n_rot != s.head_dim:
        raise ValueError("hy_v3 rotates whole heads (llama.cpp asserts n_rot == head size): leave --n-rot unset")
    if s.n_shared_exp < 1:
        raise ValueError("hy_v3 runs a shared expert in every MoE layer: --n-shared-exp must be at least 1")


class HyV3(MoEModel):
    arch = "hy_v3"
    factory = Factory(
        "Hy3: GQA with q/k RMSNorm, leading dense layers, sigmoid router with selection bias, ungated shared expert",
        _kv,
        _check,
        takes=frozenset({"n_dense_lead", "n_mtp"}),
    )
    qk_norm = True
    # (llama.cpp loads the shared expert as optional but its graph always runs it: a file without one is computed
    # as no Hy3 is, so there is no reference for it)
    shared_experts = "required"
    sigmoid_router = True  # llama.cpp's default where the file has no expert_gating_func
    routing_keys = True
    normalize_weights = False  # llama.cpp's default where the file has no expert_weights_norm
    selection_bias = None  # (exp_probs_b is optional in llama.cpp's loader)
    bias_tensor = "exp_probs_b"  # (llama.cpp's loader names it without the .bias the other families' files have)

    @classmethod
    def ffn_tensors(cls, hp: HParams, il: int, parts: Parts) -> list[TensorSpec]:
        """The default block's FFN, its selection bias under the name llama.cpp's Hy3 loader reads."""
        return [
            dataclasses.replace(t, name=f"blk.{il}.{cls.bias_tensor}") if t.name.endswith(".exp_probs_b.bias") else t
            for t in super().ffn_tensors(hp, il, parts)
        ]

    @classmethod
    def mtp_tensors(cls, hp: HParams, il: int) -> list[TensorSpec]:
        """A Hy3 next-token-prediction block's own tensors (its final norm: optional in llama.cpp's loader)."""
        p, e = f"blk.{il}.", hp.n_embd
        return [
            TensorSpec(p + "nextn.eh_proj.weight", (2 * e, e), "matrix"),
            TensorSpec(p + "nextn.enorm.weight", (e,), "norm"),
            TensorSpec(p + "nextn.hnorm.weight", (e,), "norm"),
            TensorSpec(p + "nextn.shared_head_norm.weight", (e,), "norm", optional=True),
        ]

    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        if hp.n_rot != hp.head_dim or (hp.head_dim_v or hp.head_dim) != hp.head_dim:  # (llama.cpp's graph asserts)
            raise BadInputError(
                f"{where}: {cls.arch} rotates whole heads of one size: rope.dimension_count and value_length must be "
                "key_length"
            )
        if usual := next((n for n in shapes if n.endswith(".exp_probs_b.bias")), None):
            # (llama.cpp's loader finds one tensor too many and refuses the file: no reference for it)
            raise BadInputError(f"{where}: {usual}: {cls.arch}'s selection bias is named blk.N.exp_probs_b")
        super().check(hp, shapes, streamed, where)
