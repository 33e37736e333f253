"""GLM-5 / GLM-5.1 / GLM-5.2 (`glm-dsa`): DeepSeek-V3's multi-head latent attention whose keys a lightning indexer
picks (DSA: each query attends to the `top_k` cached positions the indexer scores highest), as llama.cpp 0.3.36
computes it (src/models/glm-dsa.cpp; docs/families/glm-dsa.md).

The indexer of a layer: a query of `indexer_n_head` heads from the query latent (indexer.attn_q_b), one key head
from the layer input (indexer.attn_k, then a LayerNorm with bias), both roped on their first rope dims and rotated by
a Hadamard matrix; per-head weights from the input (indexer.proj, scaled by 1/√(heads · head)); the score of a key
is Σ_h weight_h · relu(q_h · k), its top-k unmasked in the attention's mask. The indexer's keys are cached beside
the MLA latent (the layer's K memory: the latent and rope key block, then the indexer's block). GLM-5.2's shared
layers reuse the picks of the last layer that ran its own indexer: that layer writes them to a buffer by position
(F32, exact for positions below 2^24), which they read — the prompt runs layer by layer over all its chunks, and
a decode graph expands a layer's writes before the next layer's reads, so a shared layer always reads its own
positions' picks. Each sequence (its caches' slot) has its own buffer; several sequences' decode tokens in one
graph each attend alone.

The rest is DeepSeek-V3's (`deepseek2`) without what llama.cpp does not read for this family: no YaRN log
multiplier, no expert groups; a sigmoid router by default, with the selection bias, shared expert and leading
dense layers. The next-token-prediction block is neither loaded nor run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenwing.compute.ggml_lib import F16, F32, I32, ROPE_NORM, Tensor, TensorArena, ops
from tokenwing.errors import BadInputError
from tokenwing.format.gguf_io import KV, ValueType
from tokenwing.models import common, mla
from tokenwing.models.base import MoEModel
from tokenwing.models.deepseek2 import DeepSeek2, check_mla
from tokenwing.models.factory import MLA_FIELDS, Factory, common_kv, mla_kv, sigmoid_routed_kv
from tokenwing.models.hparams import HParams
from tokenwing.models.keys import Key, read_keys, write_keys
from tokenwing.models.specs import Parts, TensorSpec
from tokenwing.models.weights import ModelWeights

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape

# GLM-5.2's indexer types where the file has no key and its context is a million tokens or more (llama.cpp's
# GLM_5_2_DEFAULT_INDEXER_TYPES, glm-dsa.cpp:6-27): layers 0 and 1, then every fourth from 2, run their own
_GLM_5_2_CONTEXT = 1048576
_GLM_5_2_TYPES = 78


# DSA's lightning indexer's keys (models/keys.py), glm-dsa's and qwen4exp's (QSA's indexer): its heads, head size
# and the keys it keeps per query, read here and written by both factories; GLM-5.2's per-layer types beside them
INDEXER_KEYS: dict[str, Key] = {
    "n_head": Key("attention.indexer.head_count", "u32", 0),
    "head_size": Key("attention.indexer.key_length", "u32", 0),
    "top_k": Key("attention.indexer.top_k", "u32", 0),
}


@dataclass(frozen=True)
class IndexerKeys:
    n_head: int
    head_size: int
    top_k: int
    types: tuple[bool, ...]  # per layer that runs: it runs its own indexer (GLM-5.2; () where the file has none)


def indexer_keys(hp: HParams, where: str = "the model") -> IndexerKeys:
    """The indexer's keys from the file's (`INDEXER_KEYS`, attention.indexer.types), checked: one line otherwise."""
    own = read_keys(INDEXER_KEYS, hp, where)
    return IndexerKeys(
        **own, types=_indexer_types(hp.keys.get("attention.indexer.types"), hp.n_layer, f"{where}: {hp.arch}")
    )


def _indexer_types(v: Any, n_layer: int, where: str) -> tuple[bool, ...]:
    """attention.indexer.types: one flag per layer that runs (llama.cpp throws on another length)."""
    if v is None:
        return ()
    flags = np.asarray(v).reshape(-1)  # (a BOOL array reads as numpy's)
    if flags.size != n_layer or flags.dtype.kind not in "biu" or not np.isin(flags, (0, 1)).all():
        raise BadInputError(f"{where}.attention.indexer.types must list one flag per block that runs")
    return tuple(bool(x) for x in flags)


def indexer_values(s: ModelShape) -> dict[str, int]:
    """`INDEXER_KEYS`' values, as the factory writes them from the shape's fields."""
    return {"n_head": s.indexer_n_head, "head_size": s.indexer_head_size, "top_k": s.indexer_top_k}


def indexer_full(hp: HParams, il: int) -> bool:
    """Whether layer il runs its own indexer (llama.cpp's is_indexer_full with glm-dsa's defaults, :59-66)."""
    if types := _indexer_types(hp.keys.get("attention.indexer.types"), hp.n_layer, f"the model: {hp.arch}"):
        return types[il]
    if hp.n_ctx_train < _GLM_5_2_CONTEXT:  # GLM-5, 5.1: every layer
        return True
    return il < _GLM_5_2_TYPES and (il < 2 or (il - 2) % 4 == 0)  # (the table's 78 entries; zeros after them)


def hadamard(n: int) -> np.ndarray:
    """llama.cpp's orthonormal Sylvester-Hadamard matrix (llama-kv-cache.cpp:21-59), F32 as it makes it."""
    h = np.array([[np.float32(1.0) / np.sqrt(np.float32(n))]], np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes GLM-5: DeepSeek-V2's keys (MLA as MQA over the latent, the sigmoid router,
    dense layers first), no rope scaling, the indexer's heads, head size and top-k, and GLM-5.2's per-layer
    indexer types (BOOL, one per block that runs) where the shape has them."""
    a = "glm-dsa"
    kv = common_kv(s, a)
    kv[f"{a}.attention.head_count_kv"] = KV.u32(1)
    kv.update(mla_kv(s, a))
    kv.update(sigmoid_routed_kv(s, a))
    kv |= write_keys(INDEXER_KEYS, a, indexer_values(s))
    if s.indexer_types:
        kv[f"{a}.attention.indexer.types"] = KV.array(ValueType.BOOL, [bool(t) for t in s.indexer_types])
    if s.n_mtp:
        kv[f"{a}.nextn_predict_layers"] = KV.u32(s.n_mtp)
    return kv


def _check(s: ModelShape) -> None:
    """What llama.cpp's GLM-5 loader and graph take (it throws or asserts on the rest)."""
    check_mla(s)
    if s.q_lora_rank <= 0 or s.legacy_kv_b or s.n_head_kv != 1:
        raise ValueError(
            "glm-dsa needs --q-lora-rank (the indexer's query comes from it), MLA's split attn_k_b/"
            "attn_v_b and one KV head (--n-head-kv 1)"
        )
    di = s.indexer_head_size
    if s.indexer_n_head < 1 or s.indexer_top_k < 1 or di < 64 or di & (di - 1):
        raise ValueError(
            "the indexer needs heads, a top-k and --indexer-head-size a power of two of 64 or more (llama.cpp "
            "multiplies its q and k by a Hadamard matrix of that width)"
        )
    if s.rot > di:
        raise ValueError("--n-rot must be at most --indexer-head-size (the indexer's head is [rope | nope])")
    if s.n_expert_group or s.n_group_used or s.yarn_factor:
        raise ValueError("llama.cpp's glm-dsa reads no expert groups and no YaRN keys")
    if s.indexer_types and (len(s.indexer_types) != s.n_layer or not set(s.indexer_types) <= {0, 1}):
        raise ValueError("--indexer-types needs one 0 or 1 per layer (1: the layer runs its own indexer)")
    if s.indexer_types and not s.indexer_types[0]:
        raise ValueError("layer 0 must run its own indexer (a shared layer reuses an earlier layer's top-k)")


class GlmDsa(MoEModel):
    arch = "glm-dsa"
    factory = Factory(
        "GLM-5 / GLM-5.2: MLA whose keys a lightning indexer picks (top-k tokens per query, shared across layers "
        "in GLM-5.2), sigmoid router with selection bias, shared expert",
        _kv,
        _check,
        takes=MLA_FIELDS | {"n_dense_lead", "indexer_n_head", "indexer_head_size", "indexer_top_k", "indexer_types"},
    )
    shared_experts = "required"
    shared_as_experts = True
    sigmoid_router = True  # llama.cpp's default for glm-dsa where the file has no expert_gating_func
    normalize_weights = False  # llama.cpp's default where the file has no expert_weights_norm
    routing_keys = True
    rope_mode = ROPE_NORM
    selection_bias = None  # where the file has exp_probs_b

    def __init__(self, hp: HParams, weights: ModelWeights, streamed: list[int]) -> None:
        super().__init__(hp, weights, streamed)
        self.rope = common.rope_of(hp, ROPE_NORM, 0.0)  # (llama.cpp reads no yarn_log_multiplier for glm-dsa)
        k_head = mla.Heads.of(hp).k
        # llama.cpp's kq_scale (glm-dsa.cpp:222-228) with its rope_yarn_log_mul of 0: mscale is the attention factor
        f32 = np.float32
        ln_factor = np.log(f32(1.0) / f32(self.rope.freq_scale))
        mscale = f32(self.rope.attn_factor) * (f32(1.0) + f32(0.1) * ln_factor)
        self.kq_scale = float(f32(mscale * mscale) / np.sqrt(f32(k_head)))
        di = indexer_keys(hp).head_size
        self._arena = TensorArena(64)
        self._hadamard = self._arena.wrap(hadamard(di), F32, (di, di))
        self._shared = not all(indexer_full(hp, il) for il in range(hp.n_layer))
        # (n_ctx, sequence) → [min(top_k, n_ctx), n_ctx] F32: the last full layer's picks by position
        self._picks: dict[tuple[int, int], Tensor] = {}
        self._weight_scale = float(np.float32(1.0) / np.sqrt(np.float32(di * indexer_keys(hp).n_head)))

    @classmethod
    def make_router(cls, hp: HParams, has_bias: bool = True) -> common.Router:
        # llama.cpp reads no expert groups for glm-dsa (glm-dsa.cpp:29-57): every expert competes
        return dataclasses.replace(super().make_router(hp, has_bias), groups=1, groups_used=1)

    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        k = indexer_keys(hp, where)
        di = k.head_size
        if k.n_head < 1 or k.top_k < 1 or di < 64 or di & (di - 1) or hp.n_rot > di:
            raise BadInputError(
                f"{where}: glm-dsa needs indexer heads, a top-k, and an indexer head that is a power of two of 64 or "
                "more and at least the rope dims (llama.cpp rotates it by a Hadamard matrix that wide)"
            )
        if not indexer_full(hp, 0):
            raise BadInputError(f"{where}: layer 0 must run its own indexer (attention.indexer.types)")
        if not hp.q_lora_rank or not hp.is_mla:
            raise BadInputError(f"{where}: glm-dsa needs q_lora_rank and MLA's attn_k_b/attn_v_b")
        mla.validate(hp, where, split=True)
        super().check(hp, shapes, streamed, where)

    @classmethod
    def attention_tensors(cls, hp: HParams, il: int, parts: Parts) -> list[TensorSpec]:
        """MLA's (models/mla.py), then the DSA indexer's in a layer that runs its own (GLM-5.2's shared layers have
        none; a next-token-prediction block has one): its query from the query latent, its one key head with a
        LayerNorm (weight and bias), its per-head weights."""
        out = mla.tensors(hp, il)
        if il < hp.n_layer and not indexer_full(hp, il):
            return out
        p, e, di, ni = f"blk.{il}.indexer.", hp.n_embd, indexer_keys(hp).head_size, indexer_keys(hp).n_head
        return [
            *out,
            TensorSpec(p + "k_norm.weight", (di,), "norm"),
            TensorSpec(p + "k_norm.bias", (di,), "vector"),
            TensorSpec(p + "proj.weight", (e, ni), "matrix"),
            TensorSpec(p + "attn_k.weight", (e, di), "matrix"),
            TensorSpec(p + "attn_q_b.weight", (hp.q_lora_rank, ni * di), "matrix"),
        ]

    @classmethod
    def mtp_tensors(cls, hp: HParams, il: int) -> list[TensorSpec]:
        return DeepSeek2.mtp_tensors(hp, il)  # (llama.cpp's blk.N.nextn.*, as DeepSeek's)

    @classmethod
    def kv_layer(cls, hp: HParams, il: int) -> common.KVSpec:
        """The MLA latent and rope key, then (a layer with its own indexer) the indexer's key: llama.cpp's MLA and
        indexer caches together (llama-kv-cache-dsa.cpp:14-54), in the cache's type."""
        lid = indexer_keys(hp).head_size if indexer_full(hp, il) else 0
        return common.KVSpec(hp.kv_lora_rank + hp.n_rot + lid, hp.kv_lora_rank, v_in_k=True)

    @classmethod
    def kv_bytes_per_token(cls, hp: HParams, elt: int = 2) -> int:
        """The caches' widths, and with GLM-5.2's shared layers the picks they read: 4 bytes for each of the top-k
        a position keeps (F32 whatever the cache's type; at most, as a context shorter than top-k keeps fewer)."""
        picks = 4 * indexer_keys(hp).top_k if not all(indexer_full(hp, il) for il in range(hp.n_layer)) else 0
        return super().kv_bytes_per_token(hp, elt) + picks

    # ----------------------------------------------------------------------------------------------- graph
    def attention(
        self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache
    ) -> tuple[Tensor, list[Tensor]]:
        cache = common.kv_cache(kv)
        if isinstance(cache, common.BatchKV):  # several sequences' tokens: each attends alone, over its own cache
            return common.attend_alone(ctx, x, at, cache, lambda xi, part, c: self.attention(ctx, il, xi, part, c))
        hp, w = self.hp, self.w[il]
        latent, di = hp.kv_lora_rank + hp.n_rot, indexer_keys(hp).head_size
        n_ctx, elt = int(cache.k.contents.ne[1]), cache.elt
        if not indexer_full(hp, il):  # GLM-5.2: the last full layer's picks at these positions
            picks = self._picks_buffer(ctx, n_ctx, at.n_kv, cache.index)
            rows = ops.ggml_get_rows(ctx, picks, ops.ggml_view_1d(ctx, at.positions, at.n, 0))
            top_k = ops.ggml_cpy(ctx, rows, ops.ggml_new_tensor_2d(ctx, I32, int(rows.contents.ne[0]), at.n))
            mask = common.picks_mask(ctx, top_k, at)
            cur, writes = mla.attention(ctx, hp, w, x, at, cache, self.rope, self.kq_scale, lambda qr: (mask, []))
            return ops.ggml_mul_mat(ctx, w["attn_output"], cur), writes
        # The layer's K memory holds two blocks: [latent + rope, n_ctx] then [indexer head, n_ctx], each of
        # contiguous rows (so the MLA attention reads its block as any cache)
        mla_k = ops.ggml_view_2d(ctx, cache.k, latent, n_ctx, latent * elt, 0)
        lid_k = ops.ggml_view_2d(ctx, cache.k, di, n_ctx, di * elt, latent * n_ctx * elt)
        mla_kv = dataclasses.replace(cache, k=mla_k)

        def select(qr: Tensor) -> tuple[Tensor, list[Tensor]]:
            return self._select(ctx, il, x, qr, at, lid_k, elt, cache.index)

        cur, writes = mla.attention(ctx, hp, w, x, at, mla_kv, self.rope, self.kq_scale, select)
        return ops.ggml_mul_mat(ctx, w["attn_output"], cur), writes

    def _select(
        self, ctx: Any, il: int, x: Tensor, qr: Tensor, at: common.Placement, lid_k: Tensor, elt: int, seq: int
    ) -> tuple[Tensor, list[Tensor]]:
        """The lightning indexer (glm-dsa.cpp:263-345) and the mask that unmasks its picks (llama-graph.cpp:
        3068-3095): the attention mask and the indexer key's cache write."""
        hp, w, n = self.hp, self.w[il], at.n
        di, ni = indexer_keys(hp).head_size, indexer_keys(hp).n_head
        q = ops.ggml_mul_mat(ctx, w["indexer.attn_q_b"], qr)
        q = common.rope(ctx, ops.ggml_reshape_3d(ctx, q, di, ni, n), at.positions, self.rope)  # [rope | nope]
        k = ops.ggml_mul_mat(ctx, w["indexer.attn_k"], x)
        # LayerNorm with llama.cpp's f_norm_eps, which glm-dsa never reads: 0
        k = ops.ggml_add(
            ctx, ops.ggml_mul(ctx, ops.ggml_norm(ctx, k, 0.0), w["indexer.k_norm"]), w["indexer.k_norm.bias"]
        )
        k = common.rope(ctx, ops.ggml_reshape_3d(ctx, k, di, 1, n), at.positions, self.rope)
        q = ops.ggml_mul_mat(ctx, self._hadamard, q)
        k = ops.ggml_mul_mat(ctx, self._hadamard, k)
        write = ops.ggml_set_rows(ctx, lid_k, ops.ggml_reshape_2d(ctx, k, di, n), at.k_rows)
        weights = ops.ggml_scale(ctx, ops.ggml_mul_mat(ctx, w["indexer.proj"], x), self._weight_scale)
        keys = ops.ggml_view_4d(ctx, lid_k, di, 1, at.n_kv, 1, di * elt, di * elt, di * elt * at.n_kv, 0)
        mask16 = ops.ggml_cpy(ctx, at.mask, ops.ggml_new_tensor_2d(ctx, F16, at.n_kv, n))  # (the fused op's F16 mask)
        scores = ops.ggml_lightning_indexer(ctx, q, keys, weights, mask16)  # [n_kv, n]
        top_k = ops.ggml_cont(ctx, ops.ggml_top_k(ctx, scores, min(at.n_kv, indexer_keys(hp).top_k)))  # I32 [k, n]
        writes = [write]
        if self._shared:  # kept by position for the shared layers after this one
            count = int(top_k.contents.ne[0])
            buf = self._picks_buffer(ctx, int(lid_k.contents.ne[1]), at.n_kv, seq)
            as_f32 = ops.ggml_cpy(ctx, top_k, ops.ggml_new_tensor_2d(ctx, F32, count, n))
            writes.append(ops.ggml_set_rows(ctx, buf, as_f32, at.k_rows))
        return common.picks_mask(ctx, top_k, at), writes

    def _picks_buffer(self, ctx: Any, n_ctx: int, n_kv: int, seq: int) -> Tensor:
        """The picks by position of sequence `seq` (its caches' slot), [k, n_ctx] of the buffer for this context
        (k = min(top_k, n_kv): the picks of a graph over n_kv keys)."""
        k_max = min(indexer_keys(self.hp).top_k, n_ctx)
        if (n_ctx, seq) not in self._picks:
            data = np.zeros((n_ctx, k_max), np.float32)
            self._picks[(n_ctx, seq)] = self._arena.wrap(data, F32, (k_max, n_ctx))
        buf = self._picks[(n_ctx, seq)]
        return ops.ggml_view_2d(ctx, buf, min(k_max, n_kv), n_ctx, 4 * k_max, 0)
