"""DeepSeek-V3 / V3.1, Kimi K2, DeepSeek-V2(-Lite) (`deepseek2`): multi-head latent attention (`models/mla.py`;
llama.cpp: src/models/deepseek2.cpp), or the older converter's attn_kv_b.

YaRN with its attention factor (kq_scale = mscale² / √head), NORM RoPE on the rope dims only, a sigmoid (or
softmax) router whose top-k adds a per-expert selection bias within the best expert groups, weights normalised
and scaled, leading dense layers and shared experts. The next-token-prediction block is neither loaded nor run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenwing.compute.ggml_lib import ROPE_NORM, Tensor, ops
from tokenwing.models import common, mla
from tokenwing.models.base import MoEModel
from tokenwing.models.hparams import HParams
from tokenwing.models.specs import Parts, TensorSpec
from tokenwing.models.weights import ModelWeights


class DeepSeek2(MoEModel):
    arch = "deepseek2"
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
