"""Multi-head latent attention (llama.cpp: the MLA parts of src/models/deepseek2.cpp and bailingmoe3.cpp), shared
by DeepSeek-V2/V3 and Kimi K2 (`deepseek2`) and the full-attention layers of Ling 3.0 (`bailingmoe3`).

Queries through a low-rank pair (attn_q_a → RMSNorm → attn_q_b; a plain attn_q on the lite models), keys and
values through one compressed latent of kv_lora_rank values plus the rope dims shared by every head
(attn_kv_a_mqa → the latent's RMSNorm; rope on its own part). The cache holds that latent and the roped key per
position — kv_lora_rank + rope values per layer, ~70 KB per token on DeepSeek-V3 instead of ~5 MB — and
attention runs on it directly: each head's no-rope query is absorbed into the latent space by attn_k_b, and the
result is decompressed into the value heads by attn_v_b. Files of the older converter carry one attn_kv_b
instead; they decompress the latent into full keys and values per head, with a cache of those (llama.cpp's
non-MLA path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenwing.compute.ggml_lib import Tensor, ops
from tokenwing.errors import BadInputError
from tokenwing.models import common
from tokenwing.models.base import TensorCheck
from tokenwing.models.hparams import HParams
from tokenwing.models.specs import TensorSpec


@dataclass(frozen=True)
class Heads:
    """MLA's per-head sizes: a query/key head (no-rope + rope dims) and a value head once decompressed."""

    k: int
    v: int

    @classmethod
    def of(cls, hp: HParams) -> Heads:
        if hp.is_mla:
            return cls(hp.head_dim_k_mla, hp.head_dim_v_mla)
        return cls(hp.head_dim, hp.head_dim_v)

    def nope(self, hp: HParams) -> int:
        return self.k - hp.n_rot


def validate(hp: HParams, where: str, split: bool = False) -> None:
    """The MLA geometry the keys give is one llama.cpp computes; `split`: only the attn_k_b/attn_v_b form."""
    nope, rank = Heads.of(hp).nope(hp), hp.kv_lora_rank
    if nope < 1 or rank < 1:
        raise BadInputError(f"{where}: kv_lora_rank and the no-rope part of the key heads must be positive")
    if hp.is_mla:
        if hp.n_head_kv != 1 or hp.head_dim != rank + hp.n_rot:
            raise BadInputError(f"{where}: an MLA cache needs head_count_kv 1 and key_length kv_lora_rank + rope dims")
    elif split:
        raise BadInputError(f"{where}: {hp.arch} needs key_length_mla and value_length_mla (MLA's split form)")
    elif hp.n_head_kv != hp.n_head:
        raise BadInputError(f"{where}: a model without MLA keys needs head_count_kv = head_count")


def tensors(hp: HParams, il: int) -> list[TensorSpec]:
    """Layer il's attention tensors as llama.cpp's converter writes them: the query through a low-rank pair (or a
    plain attn_q without q_lora_rank), K/V from one compressed latent plus the shared rotary key, and attn_kv_b split
    into per-head attn_k_b (transposed) and attn_v_b, or kept whole (older files, without MLA's head sizes)."""
    p, e = f"blk.{il}.", hp.n_embd
    heads = Heads.of(hp)
    nope, rank, q = heads.nope(hp), hp.kv_lora_rank, hp.n_head * heads.k
    out = [TensorSpec(p + "attn_norm.weight", (e,), "norm")]
    if hp.q_lora_rank:
        out += [
            TensorSpec(p + "attn_q_a.weight", (e, hp.q_lora_rank), "matrix"),
            TensorSpec(p + "attn_q_a_norm.weight", (hp.q_lora_rank,), "norm"),
            TensorSpec(p + "attn_q_b.weight", (hp.q_lora_rank, q), "matrix"),
        ]
    else:
        out.append(TensorSpec(p + "attn_q.weight", (e, q), "matrix"))
    out += [
        TensorSpec(p + "attn_kv_a_mqa.weight", (e, rank + hp.n_rot), "matrix"),
        TensorSpec(p + "attn_kv_a_norm.weight", (rank,), "norm"),
    ]
    if hp.is_mla:
        out += [
            TensorSpec(p + "attn_k_b.weight", (nope, rank, hp.n_head), "matrix"),
            TensorSpec(p + "attn_v_b.weight", (rank, heads.v, hp.n_head), "matrix"),
        ]
    else:
        out.append(TensorSpec(p + "attn_kv_b.weight", (rank, hp.n_head * (nope + heads.v)), "matrix"))
    return [*out, TensorSpec(p + "attn_output.weight", (hp.n_head * heads.v, e), "matrix")]


def check(c: TensorCheck, il: int, split: bool = False) -> None:
    """The attention tensors of layer il (`tensors`); `split`: only the attn_k_b/attn_v_b form."""
    validate(c.hp, c.where, split)
    for t in tensors(c.hp, il):
        c.need(t.name, t.shape)


def kv_spec(hp: HParams) -> common.KVSpec:
    if hp.is_mla:  # the compressed latent and the roped key: V is the latent, the start of each K row
        return common.KVSpec(hp.kv_lora_rank + hp.n_rot, hp.kv_lora_rank, v_in_k=True)
    heads = Heads.of(hp)
    return common.KVSpec(hp.n_head * heads.k, hp.n_head * heads.v)


def attention(
    ctx: Any,
    hp: HParams,
    w: dict[str, Tensor],
    x: Tensor,
    at: common.Placement,
    kv: common.KVCache,
    r: common.Rope | None,
    kq_scale: float,
    select: Callable[[Tensor], tuple[Tensor, list[Tensor]]] | None = None,
) -> tuple[Tensor, list[Tensor]]:
    """The attention of the normed input x over the cache, [v_head · n_head, n] before attn_output, and the
    cache writes (`common.attend`). `r` None: the rope dims are used as they are, never rotated (Kimi K3's MLA is
    nope-only: its converter asserts it, and llama.cpp builds no position input for it). `select`: DSA's choice
    of keys (GLM-5): from the normed query latent, the attention mask and the cache writes it makes first."""
    n, rank, rot, nh = at.n, hp.kv_lora_rank, hp.n_rot, hp.n_head
    heads = Heads.of(hp)
    nope = heads.nope(hp)
    mask: Tensor | None = None
    writes_first: list[Tensor] = []
    if "attn_q_a" in w:
        qr = common.rms_norm(ctx, ops.ggml_mul_mat(ctx, w["attn_q_a"], x), w["attn_q_a_norm"], hp.rms_eps)
        if select is not None:
            mask, writes_first = select(qr)
        q = ops.ggml_mul_mat(ctx, w["attn_q_b"], qr)
    else:
        q = ops.ggml_mul_mat(ctx, w["attn_q"], x)
    q = ops.ggml_reshape_3d(ctx, q, heads.k, nh, n)
    latent_pe = ops.ggml_mul_mat(ctx, w["attn_kv_a_mqa"], x)  # [rank + rot, n]
    row, f = int(latent_pe.contents.nb[1]), int(latent_pe.contents.nb[0])
    latent = ops.ggml_view_2d(ctx, latent_pe, rank, n, row, 0)
    k_pe = ops.ggml_view_3d(ctx, latent_pe, rot, 1, n, row, row, f * rank)
    if r is not None:
        k_pe = common.rope(ctx, k_pe, at.positions, r)
    latent = common.rms_norm(ctx, latent, w["attn_kv_a_norm"], hp.rms_eps)
    elt, nb1, nb2 = int(q.contents.nb[0]), int(q.contents.nb[1]), int(q.contents.nb[2])
    q_nope = ops.ggml_view_3d(ctx, q, nope, nh, n, nb1, nb2, 0)
    q_pe = ops.ggml_view_3d(ctx, q, rot, nh, n, nb1, nb2, elt * nope)
    if r is not None:
        q_pe = common.rope(ctx, q_pe, at.positions, r)
    if hp.is_mla:
        # each head's no-rope query into the latent space: attention over the cache as one shared KV head
        absorbed = ops.ggml_mul_mat(ctx, w["attn_k_b"], ops.ggml_permute(ctx, q_nope, 0, 2, 1, 3))
        q_all = ops.ggml_concat(ctx, ops.ggml_permute(ctx, absorbed, 0, 2, 1, 3), q_pe, 0)
        k_all = ops.ggml_concat(ctx, ops.ggml_reshape_3d(ctx, latent, rank, 1, n), k_pe, 0)
        cur, writes = common.attend(ctx, q_all, k_all, None, at, kv, kq_scale, mask, v_up=w["attn_v_b"])
    else:
        # the older form: the latent decompressed into every head's no-rope key and its value
        kv_full = ops.ggml_mul_mat(ctx, w["attn_kv_b"], latent)  # [nh · (nope + v), n]
        head = f * (nope + heads.v)
        k_nope = ops.ggml_view_3d(ctx, kv_full, nope, nh, n, head, head * nh, 0)
        v = ops.ggml_cont(ctx, ops.ggml_view_3d(ctx, kv_full, heads.v, nh, n, head, head * nh, f * nope))
        q_all = ops.ggml_concat(ctx, q_nope, q_pe, 0)
        k_all = ops.ggml_concat(ctx, k_nope, ops.ggml_repeat_4d(ctx, k_pe, rot, nh, n, 1), 0)
        cur, writes = common.attend(ctx, q_all, k_all, v, at, kv, kq_scale)
    return cur, writes_first + writes
