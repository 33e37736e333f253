"""DeepSeek-V3 / V3.1, Kimi K2, DeepSeek-V2(-Lite) (`deepseek2`): multi-head latent attention (`models/mla.py`;
llama.cpp: src/models/deepseek2.cpp), or the older converter's attn_kv_b.

YaRN with its attention factor (kq_scale = mscale² / √head), NORM RoPE on the rope dims only, a sigmoid (or
softmax) router whose top-k adds a per-expert selection bias within the best expert groups, weights normalised
and scaled, leading dense layers and shared experts. The next-token-prediction block is neither loaded nor run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tokenwing.compute.ggml_lib import ROPE_NORM, Tensor, ops
from tokenwing.format.gguf_io import KV
from tokenwing.models import common, mla
from tokenwing.models.base import MoEModel
from tokenwing.models.factory import MLA_FIELDS, Factory, check_groups, common_kv, mla_kv, sigmoid_routed_kv, yarn_kv
from tokenwing.models.hparams import HParams
from tokenwing.models.specs import Parts, TensorSpec
from tokenwing.models.weights import ModelWeights

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape


def deepseek2_kv(s: ModelShape) -> dict[str, KV]:
    """DeepSeek-V3's keys: with the split attn_k_b/attn_v_b, MLA is MQA over the latent (one KV head of
    kv_lora_rank + rope dims) and the per-head sizes move to *_mla; older files describe the MHA form."""
    a = "deepseek2"
    kv = common_kv(s, a)
    if s.legacy_kv_b:
        kv[f"{a}.attention.head_count_kv"] = KV.u32(s.n_head)
        kv[f"{a}.attention.value_length"] = KV.u32(s.v_dim)
    else:
        kv[f"{a}.attention.head_count_kv"] = KV.u32(1)
    kv.update(mla_kv(s, a))
    kv.update(sigmoid_routed_kv(s, a))
    kv.update(yarn_kv(s, a))
    if s.yarn_factor:
        kv[f"{a}.rope.scaling.yarn_log_multiplier"] = KV.f32(s.yarn_log_mul)
    if s.n_mtp:
        kv[f"{a}.nextn_predict_layers"] = KV.u32(s.n_mtp)
    return kv


# Layer counts for which llama.cpp's deepseek2 loader assumes a "lite" model (DeepSeek-V2-Lite and kin) and does
# not read q_lora_rank: with a q_lora_rank it would look for attn_q; without one, other counts fail to load.
_LITE_LAYERS = (26, 27)


def _is_lite(s: ModelShape) -> bool:
    return s.n_layer in _LITE_LAYERS or (s.n_layer == 48 and s.vocab_size == 128256)


def check_mla(s: ModelShape, shared_required: bool = True, lite: bool = False) -> None:
    """What llama.cpp takes of MLA (the families built on deepseek2's loader): its ranks, its rope dims, a shared
    expert (where `shared_required`), one MTP block at most, the lite models' layer counts (where `lite`: loaded
    by deepseek2's rules), routing groups."""
    if s.kv_lora_rank <= 0:
        raise ValueError(f"{s.arch} needs --kv-lora-rank")
    if not 0 < s.rot < s.head_dim or s.rot % 2:
        raise ValueError(f"{s.arch}'s --n-rot (qk_rope_head_dim) must be even, positive and below --head-dim")
    if s.n_shared_exp < 1 and shared_required:
        raise ValueError(f"{s.arch} runs a shared expert in every MoE layer: --n-shared-exp must be at least 1")
    if s.n_mtp > 1:
        raise ValueError("llama.cpp's converter writes one next-token-prediction block: --n-mtp must be 0 or 1")
    if lite:
        _check_lite(s)
    check_groups(s)


def _check_lite(s: ModelShape) -> None:
    if s.q_lora_rank and _is_lite(s):
        raise ValueError(
            f"llama.cpp reads a {s.n_layer}-layer deepseek2 as a lite model without q_lora_rank: "
            "choose another --n-layer or --q-lora-rank 0"
        )
    if not s.q_lora_rank and not _is_lite(s):
        raise ValueError(
            "llama.cpp loads deepseek2 without q_lora_rank (DeepSeek-V2-Lite's plain attn_q) only with "
            f"{' or '.join(map(str, _LITE_LAYERS))} layers: set --n-layer accordingly or give --q-lora-rank"
        )


def check_deepseek2(s: ModelShape) -> None:
    """deepseek2's loader's rules (mistral4's too)."""
    check_mla(s, lite=True)


# The shape's fields deepseek2's loader reads (mistral4's too).
DEEPSEEK2_FIELDS = MLA_FIELDS | {"n_dense_lead", "legacy_kv_b"}


class DeepSeek2(MoEModel):
    arch = "deepseek2"
    factory = Factory(
        "DeepSeek-V3 / Kimi K2: MLA, YaRN, group-limited sigmoid router with selection bias, shared expert",
        deepseek2_kv,
        check_deepseek2,
        takes=DEEPSEEK2_FIELDS,
        odd_head_dim=True,
    )
    shared_experts = "required"
    normalize_weights = False  # llama.cpp's default where the file has no expert_weights_norm
    routing_keys = True
    rope_mode = ROPE_NORM
    selection_bias = None  # DeepSeek-V3 has exp_probs_b, V2 has not

    def __init__(self, hp: HParams, weights: ModelWeights, streamed: list[int]) -> None:
        super().__init__(hp, weights, streamed)
        # the converter writes yarn_log_multiplier as 0.1 × mscale_all_dim; llama.cpp undoes that on load
        log_mul = hp.rope_yarn_log_mul / 0.1
        self.rope = common.rope_of(hp, ROPE_NORM, log_mul, mscale_from_all_dims=True)
        k_head = mla.Heads.of(hp).k  # no-rope + rope dims of a query head
        # llama.cpp pre-scales the attention scores by the YaRN mscale (float32, as it computes it)
        f32 = np.float32
        ln_factor = np.log(f32(1.0) / f32(self.rope.freq_scale))
        attn_factor_org = f32(self.rope.attn_factor) * (f32(1.0) + f32(0.1) * ln_factor)
        mscale = attn_factor_org * (f32(1.0) + f32(0.1) * f32(log_mul) * ln_factor)
        self.kq_scale = float(f32(mscale * mscale) / np.sqrt(f32(k_head)))

    shared_as_experts = True

    @classmethod
    def attention_tensors(cls, hp: HParams, il: int, parts: Parts) -> list[TensorSpec]:
        return mla.tensors(hp, il)

    @classmethod
    def mtp_tensors(cls, hp: HParams, il: int) -> list[TensorSpec]:
        """llama.cpp's `blk.N.nextn.*`: the projection of [embedding, hidden], their norms, its own head."""
        p, e, v = f"blk.{il}.nextn.", hp.n_embd, hp.vocab_size
        return [
            TensorSpec(p + "eh_proj.weight", (2 * e, e), "matrix"),
            TensorSpec(p + "enorm.weight", (e,), "norm"),
            TensorSpec(p + "hnorm.weight", (e,), "norm"),
            TensorSpec(p + "embed_tokens.weight", (e, v), "embd"),
            TensorSpec(p + "shared_head_head.weight", (e, v), "matrix"),
            TensorSpec(p + "shared_head_norm.weight", (e,), "norm"),
        ]

    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        mla.validate(hp, where)
        super().check(hp, shapes, streamed, where)

    @classmethod
    def kv_layer(cls, hp: HParams, il: int) -> common.KVSpec:
        return mla.kv_spec(hp)

    def attention(
        self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache
    ) -> tuple[Tensor, list[Tensor]]:
        w = self.w[il]
        cur, writes = mla.attention(ctx, self.hp, w, x, at, common.kv_cache(kv), self.rope, self.kq_scale)
        return ops.ggml_mul_mat(ctx, w["attn_output"], cur), writes
