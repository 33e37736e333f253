"""DeepSeek-V3 / V3.1, Kimi K2, DeepSeek-V2(-Lite) (`deepseek2`): multi-head latent attention.

Attention (llama.cpp: src/models/deepseek2.cpp): queries through a low-rank pair (attn_q_a → RMSNorm →
attn_q_b; a plain attn_q on the lite models), keys and values through one compressed latent of kv_lora_rank
values plus the rope dims shared by every head (attn_kv_a_mqa → the latent's RMSNorm; rope on its own part).
The cache holds that latent and the roped key per position — kv_lora_rank + rope values per layer, ~70 KB per
token on DeepSeek-V3 instead of ~5 MB — and attention runs on it directly: each head's no-rope query is
absorbed into the latent space by attn_k_b, and the result is decompressed into the value heads by attn_v_b.
Files of the older converter carry one attn_kv_b instead; they decompress the latent into full keys and values
per head, with a cache of those (llama.cpp's non-MLA path).

YaRN with its attention factor (kq_scale = mscale² / √head), NORM RoPE on the rope dims only, a sigmoid (or
softmax) router whose top-k adds a per-expert selection bias within the best expert groups, weights normalised
and scaled, leading dense layers and shared experts. The next-token-prediction block is neither loaded nor run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenwing.compute.ggml_lib import ROPE_NORM, Tensor, ops
from tokenwing.errors import BadInputError
from tokenwing.models import common
from tokenwing.models.base import MoEModel, TensorCheck
from tokenwing.models.hparams import HParams
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
        self.k_head = hp.head_dim_k_mla if hp.is_mla else hp.head_dim  # no-rope + rope dims of a query head
        self.v_head = hp.head_dim_v_mla if hp.is_mla else hp.head_dim_v
        self.nope = self.k_head - hp.n_rot
        # llama.cpp pre-scales the attention scores by the YaRN mscale (float32, as it computes it)
        f32 = np.float32
        ln_factor = np.log(f32(1.0) / f32(self.rope.freq_scale))
        attn_factor_org = f32(self.rope.attn_factor) * (f32(1.0) + f32(0.1) * ln_factor)
        mscale = attn_factor_org * (f32(1.0) + f32(0.1) * f32(log_mul) * ln_factor)
        self.kq_scale = float(f32(mscale * mscale) / np.sqrt(f32(self.k_head)))

    @classmethod
    def check_attention(cls, c: TensorCheck, il: int) -> None:
        hp, p, e = c.hp, f"blk.{il}.", c.hp.n_embd
        k_head = hp.head_dim_k_mla if hp.is_mla else hp.head_dim
        v_head = hp.head_dim_v_mla if hp.is_mla else hp.head_dim_v
        nope, rank = k_head - hp.n_rot, hp.kv_lora_rank
        if nope < 1 or rank < 1:
            raise BadInputError(f"{c.where}: kv_lora_rank and the no-rope part of the key heads must be positive")
        c.need(p + "attn_norm.weight", (e,))
        if hp.q_lora_rank:
            c.need(p + "attn_q_a.weight", (e, hp.q_lora_rank))
            c.need(p + "attn_q_a_norm.weight", (hp.q_lora_rank,))
            c.need(p + "attn_q_b.weight", (hp.q_lora_rank, hp.n_head * k_head))
        else:
            c.need(p + "attn_q.weight", (e, hp.n_head * k_head))
        c.need(p + "attn_kv_a_mqa.weight", (e, rank + hp.n_rot))
        c.need(p + "attn_kv_a_norm.weight", (rank,))
        if hp.is_mla:
            if hp.n_head_kv != 1 or hp.head_dim != rank + hp.n_rot:
                raise BadInputError(
                    f"{c.where}: an MLA cache needs head_count_kv 1 and key_length kv_lora_rank + rope dims"
                )
            c.need(p + "attn_k_b.weight", (nope, rank, hp.n_head))
            c.need(p + "attn_v_b.weight", (rank, v_head, hp.n_head))
        else:
            if hp.n_head_kv != hp.n_head:
                raise BadInputError(f"{c.where}: a model without MLA keys needs head_count_kv = head_count")
            c.need(p + "attn_kv_b.weight", (rank, hp.n_head * (nope + v_head)))
        c.need(p + "attn_output.weight", (hp.n_head * v_head, e))

    def kv_spec(self, il: int) -> common.KVSpec:
        hp = self.hp
        if hp.is_mla:  # the compressed latent and the roped key: V is the latent, the start of each K row
            return common.KVSpec(hp.kv_lora_rank + hp.n_rot, hp.kv_lora_rank, v_in_k=True)
        return common.KVSpec(hp.n_head * self.k_head, hp.n_head * self.v_head)

    def attention(
        self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.KVCache
    ) -> tuple[Tensor, list[Tensor]]:
        hp, w, n = self.hp, self.w[il], at.n
        rank, rot, nh = hp.kv_lora_rank, hp.n_rot, hp.n_head
        if "attn_q_a" in w:
            q = ops.ggml_mul_mat(ctx, w["attn_q_a"], x)
            q = ops.ggml_mul_mat(ctx, w["attn_q_b"], self.norm(ctx, q, w["attn_q_a_norm"]))
        else:
            q = ops.ggml_mul_mat(ctx, w["attn_q"], x)
        q = ops.ggml_reshape_3d(ctx, q, self.k_head, nh, n)
        latent_pe = ops.ggml_mul_mat(ctx, w["attn_kv_a_mqa"], x)  # [rank + rot, n]
        row, f = int(latent_pe.contents.nb[1]), int(latent_pe.contents.nb[0])
        latent = ops.ggml_view_2d(ctx, latent_pe, rank, n, row, 0)
        k_pe = ops.ggml_view_3d(ctx, latent_pe, rot, 1, n, row, row, f * rank)
        k_pe = common.rope(ctx, k_pe, at.positions, self.rope)
        latent = self.norm(ctx, latent, w["attn_kv_a_norm"])
        elt = int(q.contents.nb[0])
        q_nope = ops.ggml_view_3d(ctx, q, self.nope, nh, n, int(q.contents.nb[1]), int(q.contents.nb[2]), 0)
        q_pe = ops.ggml_view_3d(ctx, q, rot, nh, n, int(q.contents.nb[1]), int(q.contents.nb[2]), elt * self.nope)
        q_pe = common.rope(ctx, q_pe, at.positions, self.rope)
        if hp.is_mla:
            # each head's no-rope query into the latent space: attention over the cache as one shared KV head
            absorbed = ops.ggml_mul_mat(ctx, w["attn_k_b"], ops.ggml_permute(ctx, q_nope, 0, 2, 1, 3))
            q_all = ops.ggml_concat(ctx, ops.ggml_permute(ctx, absorbed, 0, 2, 1, 3), q_pe, 0)
            k_all = ops.ggml_concat(ctx, ops.ggml_reshape_3d(ctx, latent, rank, 1, n), k_pe, 0)
            cur, writes = common.attend(ctx, q_all, k_all, None, at, kv, self.kq_scale, v_up=w["attn_v_b"])
        else:
            # the older form: the latent decompressed into every head's no-rope key and its value
            kv_full = ops.ggml_mul_mat(ctx, w["attn_kv_b"], latent)  # [nh · (nope + v), n]
            head = f * (self.nope + self.v_head)
            k_nope = ops.ggml_view_3d(ctx, kv_full, self.nope, nh, n, head, head * nh, 0)
            v = ops.ggml_cont(ctx, ops.ggml_view_3d(ctx, kv_full, self.v_head, nh, n, head, head * nh, f * self.nope))
            q_all = ops.ggml_concat(ctx, q_nope, q_pe, 0)
            k_all = ops.ggml_concat(ctx, k_nope, ops.ggml_repeat_4d(ctx, k_pe, rot, nh, n, 1), 0)
            cur, writes = common.attend(ctx, q_all, k_all, v, at, kv, self.kq_scale)
        return ops.ggml_mul_mat(ctx, w["attn_output"], cur), writes
