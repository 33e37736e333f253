"""DeepSeek V4 (`deepseek4`) as llama.cpp 0.3.36 computes it (src/models/deepseek4.cpp; the study with file and
line of every step: docs/families/deepseek4.md).

* The residual is `hc_mult` (4) streams. Each sublayer reads them through `hc_pre` (an RMS-normed mix, sigmoid
  weights per stream) and writes them back through `hc_post` (its output times 2·sigmoid per stream, plus the
  streams mixed by a Sinkhorn-normalised matrix). The state between layers is the streams, then the FFN's post and
  comb mixes (the tail needs them after the experts) and the token id (the hash layers route by it):
  hc·E + hc + hc² + 1 floats a token.
* Attention: a low-rank query RMS-normed per head without a weight, one key/value head (keys are values), per-head
  sinks, rope on the last n_rot dims of a head; the output de-roped at the query position, then projected in
  o_group_count groups of rank o_lora_rank. Every layer attends over the sliding window of its raw keys; a CSA
  layer (ratio 4) also over blocks of 4 tokens pooled by a learned softmax (overlapping windows of 8) of which
  its lightning indexer picks the top-k, an HCA layer (ratio 128) over every completed block of 128.
* FFN: sqrt(softplus) router with a selection bias (the first hash_layer_count layers: the experts a table gives
  for the token id), weights normalised and scaled; SwiGLU with the gate clamped before the SiLU; one shared
  expert.

The cache of a layer: K holds the raw keys of every position (llama-cpp-python's swa_full layout: the window is a
mask), then the layer's compressed blocks (and the indexer's) in the same memory; the state holds the F32 rows
of the compressors' last positions (8 for CSA, 128 for HCA), which a block that completes in a later chunk or
decode step pools. A prompt's graph is built for its positions: which blocks complete in it is known, its masks and
indices are constants. A decode step's graph is reused over a window of positions (runtime/token_graph.py): those
become inputs written before each run (`set_inputs`), and each compressor pools the block in progress at every step,
written to that block's row, which no query sees until the block completes and its step writes it again — the same
ops on the same rows then, so the same bits as a graph built for the position.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenwing.compute.ggml_lib import F16, F32, I32, ROPE_NORM, Tensor, ops, to_numpy
from tokenwing.errors import BadInputError, UnsupportedError
from tokenwing.format.gguf_io import KV, ValueType
from tokenwing.models import common, specs
from tokenwing.models.base import MoEModel
from tokenwing.models.factory import Factory, common_kv, yarn_kv
from tokenwing.models.hparams import HParams
from tokenwing.models.keys import Key, read_keys, write_keys
from tokenwing.models.specs import Parts, TensorSpec
from tokenwing.models.weights import ModelWeights

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape

CSA, HCA = 4, 128  # the compression ratios llama.cpp runs (0: the window only)
RING_TOKENS = 512  # the most tokens a graph may hold beside the window in the raw keys' ring (llama.cpp's n_ubatch)
ROUTER_FLOOR = 6.103515625e-5  # the normalised weights' sum is clamped here (llama-graph.cpp build_moe_ffn)

Fill = Callable[[int], np.ndarray]  # a graph's position-dependent data, from its first position
# that data as a tensor of the graph being built; the key (every parameter the fill depends on, but the position)
# lets a reused decode graph's layers share one input where their data are equal (`_data`)
Data = Callable[[Fill, tuple[object, ...]], Tensor]
_GTYPES = {np.dtype(np.float32): F32, np.dtype(np.float16): F16, np.dtype(np.int32): I32}


@dataclass(frozen=True)
class Dsv4Keys:
    """DeepSeek V4's keys as llama.cpp reads them (deepseek4.cpp load_arch_hparams; docs/families/deepseek4.md §1)."""

    compress_ratios: tuple[int, ...]  # per layer that runs: 0 (the window only), 4 (CSA) or 128 (HCA)
    compress_rope_base: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    hash_layer_count: int
    indexer_n_head: int
    indexer_head_size: int
    indexer_top_k: int
    o_group_count: int
    o_lora_rank: int


# Dsv4Keys' fields and their keys (all required by llama.cpp, CSA layers or not): read here, written by the factory
KEYS: dict[str, Key] = {
    "compress_ratios": Key("attention.compress_ratios", "i32[]"),
    "compress_rope_base": Key("attention.compress_rope_freq_base", "f32"),
    "hc_mult": Key("hyper_connection.count", "u32"),
    "hc_sinkhorn_iters": Key("hyper_connection.sinkhorn_iterations", "u32"),
    "hc_eps": Key("hyper_connection.epsilon", "f32"),
    "hash_layer_count": Key("hash_layer_count", "u32"),
    "indexer_n_head": Key("attention.indexer.head_count", "u32"),
    "indexer_head_size": Key("attention.indexer.key_length", "u32"),
    "indexer_top_k": Key("attention.indexer.top_k", "u32"),
    "o_group_count": Key("attention.output_group_count", "u32"),
    "o_lora_rank": Key("attention.output_lora_rank", "u32"),
}


def keys(hp: HParams, where: str = "the model") -> Dsv4Keys:
    """The family's keys from the file's (`KEYS`), checked: one line naming the key otherwise."""
    values = read_keys(KEYS, hp, where)
    ratios = values["compress_ratios"]
    if len(ratios) < hp.n_layer or any(r not in (0, CSA, HCA) for r in ratios[: hp.n_layer]):
        raise BadInputError(
            f"{where}: deepseek4.attention.compress_ratios must give every block a ratio of 0, 4 or 128"
        )
    return Dsv4Keys(**{**values, "compress_ratios": ratios[: hp.n_layer]})


def state_rows(ratio: int) -> int:
    """Rows a compressor keeps between graphs: two blocks for CSA's overlapping windows, one for HCA."""
    return 2 * ratio if ratio == CSA else ratio


def ring_rows(hp: HParams) -> int:
    """Raw key rows a layer keeps: the window plus the most tokens a graph writes at once, padded to 256 as
    llama.cpp pads its window cache (pad256(n_swa + n_ubatch)): every key a graph's queries see is still there
    after the graph's own writes."""
    return -(-(hp.sliding_window + RING_TOKENS) // 256) * 256


def carried_rings(hp: HParams, il: int) -> list[tuple[int, int]]:
    """(width, rows) of each carried ring of layer il's compressors, in their order in the state."""
    k = keys(hp)
    ratio, d, di = k.compress_ratios[il], hp.head_dim, k.indexer_head_size
    if ratio == CSA:
        return [(2 * d, state_rows(CSA))] * 2 + [(2 * di, state_rows(CSA))] * 2
    if ratio == HCA:
        return [(d, HCA)] * 2
    return [(1, 1)]  # (no compressor: one unused float)


def blocks(n_ctx: int, ratio: int) -> int:
    """Compressed blocks a context can complete (block b completes at position (b + 1) · ratio - 1)."""
    return n_ctx // ratio


def dsv4_compress_ratios(s: ModelShape) -> tuple[int, ...]:
    """Each layer's KV compression: `s.compress_ratios`, or DeepSeek V4's pattern (two window-only layers, then CSA
    (4) and HCA (128) in turn; fewer window-only layers in a model too short for all three kinds)."""
    if s.compress_ratios:
        return s.compress_ratios
    lead = 2 if s.n_layer >= 4 else 1 if s.n_layer == 3 else 0
    return tuple(0 if i < lead else (4, 128)[(i - lead) % 2] for i in range(s.n_layer))


def _hyper_connections(hp: HParams, prefix: str, n_mix: int, n_scale: int) -> list[TensorSpec]:
    return [
        TensorSpec(f"{prefix}_fn.weight", (keys(hp).hc_mult * hp.n_embd, n_mix), "mixer"),
        TensorSpec(f"{prefix}_base.weight", (n_mix,), "vector"),
        TensorSpec(f"{prefix}_scale.weight", (n_scale,), "vector"),
    ]


def _kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes DeepSeek V4: MQA over one KV head of head_dim, sqrt-softplus routing
    (gating func 4), SwiGLU limits per layer, the compression ratios (one more than the blocks: the config lists
    its MTP block's too, written here as 0), the indexer, output groups, hyper-connections and hash layers."""
    a = "deepseek4"
    kv = common_kv(s, a)
    kv[f"{a}.vocab_size"] = KV.u32(s.vocab_size)
    kv[f"{a}.rope.dimension_count"] = KV.u32(s.rot)
    kv[f"{a}.attention.q_lora_rank"] = KV.u32(s.q_lora_rank)
    kv[f"{a}.attention.sliding_window"] = KV.u32(s.sliding_window)
    kv[f"{a}.expert_gating_func"] = KV.u32(4)  # sqrtsoftplus
    kv[f"{a}.expert_shared_count"] = KV.u32(s.n_shared_exp)
    kv[f"{a}.expert_weights_scale"] = KV.f32(s.expert_weights_scale)
    kv[f"{a}.expert_weights_norm"] = KV.boolean(True)
    kv[f"{a}.swiglu_clamp_exp"] = KV.array(ValueType.FLOAT32, [s.swiglu_limit] * s.n_layer)
    kv[f"{a}.swiglu_clamp_shexp"] = KV.array(ValueType.FLOAT32, [s.swiglu_limit] * s.n_layer)
    # the family's own keys (KEYS), from the shape's fields of the same names
    own = {field: getattr(s, field) for field in KEYS}
    kv.update(write_keys(KEYS, a, {**own, "compress_ratios": [*dsv4_compress_ratios(s), 0]}))
    kv[f"{a}.embedding_length_out"] = KV.u32(s.hc_mult * s.n_embd)
    kv.update(yarn_kv(s, a))
    return kv


def _check(s: ModelShape) -> None:
    """What llama.cpp's DeepSeek V4 loader and graph take (it throws, asserts or misreads on the rest)."""
    if s.hc_mult != 4:
        raise ValueError("llama.cpp's deepseek4 graph mixes exactly 4 hyper-connection streams: --hc-mult must be 4")
    if s.hc_sinkhorn_iters < 1 or s.hc_eps <= 0:
        raise ValueError("--hc-sinkhorn-iters must be at least 1 and --hc-eps positive")
    if s.n_head_kv != 1:
        raise ValueError("deepseek4 attends with one key/value head shared by all query heads: --n-head-kv 1")
    if s.q_lora_rank <= 0 or s.kv_lora_rank or s.legacy_kv_b or s.v_head_dim not in (0, s.head_dim):
        raise ValueError("deepseek4 needs --q-lora-rank and keeps its keys as values (no kv rank or value head size)")
    if not 0 < s.rot <= min(s.head_dim, s.indexer_head_size) or s.rot % 2:
        raise ValueError("deepseek4's --n-rot must be even, positive and at most --head-dim and --indexer-head-size")
    if s.indexer_n_head < 1 or s.indexer_top_k < 1 or s.indexer_head_size % 64:
        raise ValueError(
            "the indexer needs heads and a top-k, and --indexer-head-size a multiple of 64 (llama.cpp rotates its "
            "keys by a Hadamard matrix of 64 or more)"
        )
    if s.o_group_count < 1 or s.o_lora_rank < 1 or s.n_head % s.o_group_count:
        raise ValueError("--n-head must be a multiple of --o-group-count, and --o-lora-rank positive")
    ratios = dsv4_compress_ratios(s)
    if len(ratios) != s.n_layer or not set(ratios) <= {0, 4, 128}:
        raise ValueError("--compress-ratios needs one ratio per layer, each 0, 4 or 128 (llama.cpp's only ratios)")
    if 4 not in ratios:
        # llama.cpp sizes the indexer's Hadamard rotation from its cache's head size, 0 without a CSA layer, and
        # dies dividing by it (SIGFPE while creating the context)
        raise ValueError("deepseek4 needs at least one CSA layer (compress ratio 4) for llama.cpp to load it")
    if not 0 <= s.hash_layer_count <= s.n_layer:
        raise ValueError("--hash-layer-count must be between 0 and --n-layer")
    if s.n_shared_exp < 1 or s.n_mtp or s.n_expert_group or s.n_group_used:
        raise ValueError(
            "deepseek4 runs one shared expert in every layer (--n-shared-exp 1 or more), routes without expert "
            "groups, and its MTP block is a file of its own (--n-mtp 0)"
        )
    if s.sliding_window < 1 or s.swiglu_limit < 0:
        raise ValueError("deepseek4 needs a positive --sliding-window and a --swiglu-limit of 0 (none) or more")


class DeepSeek4(MoEModel):
    arch = "deepseek4"
    factory = Factory(
        "DeepSeek V4: hyper-connections, compressed sparse attention with a lightning indexer, grouped output, "
        "hash-routed first layers, sqrt-softplus router, clamped SwiGLU",
        _kv,
        _check,
        takes=frozenset(
            {"q_lora_rank", "n_rot", "v_head_dim", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "compress_ratios"}
            | {"compress_rope_base", "o_group_count", "o_lora_rank", "hash_layer_count"}
            | {"indexer_n_head", "indexer_head_size", "indexer_top_k"}
        ),
    )
    rope_mode = ROPE_NORM
    shared_experts = "required"
    shared_as_experts = True  # (expert_shared_count routed experts wide)
    graph_nodes = 400  # (measured: ~160-250 a layer, a CSA layer's compressors and indexer the most)
    routing_keys = True
    selection_bias = None

    def __init__(self, hp: HParams, weights: ModelWeights, streamed: list[int]) -> None:
        super().__init__(hp, weights, streamed)
        k = self.k = keys(hp)
        self.hc = k.hc_mult
        self._tables: dict[int, np.ndarray] | None = None  # the hash layers' token → experts tables
        self._states: dict[int, _Parts] = {}  # the parts of the states built lately, by their tag (`_state`)
        self._serial = 0
        # a reused decode graph's position-dependent inputs and how each is filled, by its placement's id
        # (`set_inputs`): kept while the graph holds the placement
        self._inputs: dict[int, _Inputs] = {}
        # rope: a compressing layer takes compress_rope_freq_base with the file's YaRN; a window-only layer the plain
        # base, unscaled (deepseek4.cpp:902-909); the attention factor cancels ggml's YaRN magnitude (:11-17)
        yarn = hp.rope_scaling == "yarn"
        fs = hp.rope_freq_scale if hp.rope_scaling != "none" else 1.0
        ext = 1.0 if yarn else 0.0
        attn = (
            1.0
            if ext == 0.0
            else float(np.float32(1.0) / (np.float32(1.0) + np.float32(0.1) * np.log(np.float32(1.0) / np.float32(fs))))
        )
        orig = hp.n_ctx_orig or hp.n_ctx_train
        self.rope_compress = common.Rope(hp.n_rot, ROPE_NORM, orig, k.compress_rope_base, fs, ext, attn, 32.0, 1.0)
        self.rope_window = common.Rope(hp.n_rot, ROPE_NORM, 0, hp.rope_base, 1.0, 0.0, 1.0, 0.0, 0.0)

    # -------------------------------------------------------------------------------------------- checks
    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        k = keys(hp, where)
        if hp.gating != 4:
            raise BadInputError(
                f"{where}: deepseek4.expert_gating_func must be 4 (sqrt-softplus), as llama.cpp requires"
            )
        if hp.expert_weights_norm is None:
            raise BadInputError(f"{where}: deepseek4.expert_weights_norm is missing from the metadata")
        if hp.sliding_window < 1:
            raise BadInputError(f"{where}: deepseek4.attention.sliding_window is missing (every layer has a window)")
        if k.hc_mult != 4:
            raise UnsupportedError(f"{where}: {k.hc_mult} hyper-connection streams (llama.cpp runs 4 only)")
        if hp.n_head_kv != 1 or hp.head_dim_v != hp.head_dim:
            raise BadInputError(f"{where}: deepseek4 has one key/value head whose keys are its values")
        if k.o_group_count < 1 or hp.n_head % k.o_group_count:
            raise BadInputError(f"{where}: the heads must split evenly into attention.output_group_count groups")
        if CSA in k.compress_ratios and (k.indexer_n_head < 1 or k.indexer_head_size < hp.n_rot or k.indexer_top_k < 1):
            raise BadInputError(f"{where}: a CSA layer needs the indexer's head count, key length and top-k")
        if any(il not in streamed for il in range(hp.n_layer)):
            raise BadInputError(f"{where}: every deepseek4 layer has routed experts")
        super().check(hp, shapes, streamed, where)  # (`tensors`: the whole list)

    @classmethod
    def tensors(cls, hp: HParams, parts: Parts) -> list[TensorSpec]:
        """DeepSeek V4: hc_mult residual streams mixed around each attention and FFN (per sublayer: a pre weight per
        stream, a post weight per stream and a stream-to-stream matrix, (2 + hc) * hc mixes), compressed sparse
        attention, a sqrt-softplus router with a selection bias (the hash layers: a token-id table instead), routed
        plus shared experts; the streams are merged for the head by their own mixes, its output never tied. No MTP
        block: the converter writes it to a file of its own."""
        k = keys(hp)
        first, (norm, output) = specs.head(hp)
        hc, mix = k.hc_mult, (2 + k.hc_mult) * k.hc_mult
        unbiased = dataclasses.replace(parts, exp_bias=False)
        layers: list[TensorSpec] = []
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            layers += cls.attention_tensors(hp, il, parts)
            layers += _hyper_connections(hp, p + "hc_attn", mix, 3)
            layers += _hyper_connections(hp, p + "hc_ffn", mix, 3)
            layers += specs.routed(hp, il, unbiased)
            if il < k.hash_layer_count:
                ids = TensorSpec(p + "ffn_gate_tid2eid.weight", (hp.n_expert_used, hp.vocab_size), "expert_ids")
                layers.append(dataclasses.replace(ids, id_range=hp.n_expert))
            else:
                layers.append(TensorSpec(p + "exp_probs_b.bias", (hp.n_expert,), "vector"))
            layers += specs.shared(hp, il, parts.ff_shexp, gated=False)
        last = [norm, dataclasses.replace(output, optional=False)]
        return first + layers + last + _hyper_connections(hp, "output_hc", hc, 1)

    @classmethod
    def attention_tensors(cls, hp: HParams, il: int, parts: Parts) -> list[TensorSpec]:
        """DeepSeek V4's attention (llama.cpp's names): a low-rank query, one shared key/value head, per-head sinks,
        an output projection in o_group_count groups of rank o_lora_rank (attn_output_a as converted: 2-D, llama.cpp
        makes it 3-D); a compressing layer adds its compressor (the CSA layers' (ratio 4) state is twice as wide: two
        overlapping windows) and a CSA layer the lightning indexer with its own compressor."""
        k, p = keys(hp), f"blk.{il}."
        e, d, q, h = hp.n_embd, hp.head_dim, hp.q_lora_rank, hp.n_head
        g, o = k.o_group_count, k.o_lora_rank
        out = [
            TensorSpec(p + "attn_norm.weight", (e,), "norm"),
            TensorSpec(p + "attn_sinks.weight", (h,), "vector"),
            TensorSpec(p + "attn_q_a.weight", (e, q), "matrix"),
            TensorSpec(p + "attn_q_a_norm.weight", (q,), "norm"),
            TensorSpec(p + "attn_q_b.weight", (q, h * d), "matrix"),
            TensorSpec(p + "attn_kv.weight", (e, d), "matrix"),
            TensorSpec(p + "attn_kv_a_norm.weight", (d,), "norm"),
            TensorSpec(p + "attn_output_a.weight", (h * d // g, o * g), "matrix"),
            TensorSpec(p + "attn_output_b.weight", (g * o, e), "matrix"),
        ]
        ratio = k.compress_ratios[il]
        if ratio:
            width = (2 if ratio == CSA else 1) * d
            out += [
                TensorSpec(p + "attn_compressor_kv.weight", (e, width), "matrix"),
                TensorSpec(p + "attn_compressor_gate.weight", (e, width), "matrix"),
                TensorSpec(p + "attn_compressor_ape.weight", (width, ratio), "vector"),
                TensorSpec(p + "attn_compressor_norm.weight", (d,), "norm"),
            ]
        if ratio == CSA:
            di, ih = k.indexer_head_size, k.indexer_n_head
            out += [
                TensorSpec(p + "indexer.proj.weight", (e, ih), "matrix"),
                TensorSpec(p + "indexer.attn_q_b.weight", (q, ih * di), "matrix"),
                TensorSpec(p + "indexer_compressor_kv.weight", (e, 2 * di), "matrix"),
                TensorSpec(p + "indexer_compressor_gate.weight", (e, 2 * di), "matrix"),
                TensorSpec(p + "indexer_compressor_ape.weight", (2 * di, ratio), "vector"),
                TensorSpec(p + "indexer_compressor_norm.weight", (di,), "norm"),
            ]
        return out

    @classmethod
    def make_router(cls, hp: HParams, has_bias: bool = True) -> common.Router:
        # (the lookahead's: it ranks by sqrt(softplus) + bias as the graph selects, and weighs its reads by the
        # sigmoid's probabilities; the layers route in their graphs, `_route`)
        return common.Router(hp.n_expert_used, True, True, hp.expert_weights_scale, True, sqrt_softplus=True)

    def known_experts(self, token: int) -> dict[int, list[int]]:
        """The hash layers' experts: row `token` of each one's ffn_gate_tid2eid (what the graph selects too)."""
        if self._tables is None:
            n = min(self.k.hash_layer_count, self.hp.n_layer)
            self._tables = {il: to_numpy(self.w[il]["ffn_gate_tid2eid"]) for il in range(n)}
        return {il: table[token].tolist() for il, table in self._tables.items()}

    def router_bias_name(self, il: int) -> str | None:
        return None if il < self.k.hash_layer_count else f"blk.{il}.exp_probs_b.bias"

    # ---------------------------------------------------------------------------------------------- cache
    @classmethod
    def kv_layer(cls, hp: HParams, il: int) -> common.KVSpec:
        """What grows with the context: a compressing layer's blocks (D wide, every `ratio` positions) and a CSA
        layer's indexer blocks (Di wide, every 4), in one K memory of ⌈D/ratio⌉ (+ ⌈Di/4⌉) elements a position
        (`_Blocks` lays them out); none in a window-only layer (its keys are in the state's ring)."""
        k, d = keys(hp), hp.head_dim
        ratio = k.compress_ratios[il]
        if not ratio:
            return common.KVSpec(0, 0)
        width = -(-d // ratio) + (-(-k.indexer_head_size // CSA) if ratio == CSA else 0)
        return common.KVSpec(width, 0, v_in_k=True)

    @classmethod
    def kv_bytes_per_token(cls, hp: HParams, elt: int = 2) -> int:
        """The study's §3 formula: elt · (N4 · (D + Di) / 4 + N128 · D / 128), each layer's rounded up to whole
        elements a position (6,880 bytes on V4 Flash at F16). The raw keys' window ring is fixed in size, part of
        the state (`state_spec`)."""
        return sum(cls.kv_layer(hp, il).bytes_per_position(elt) for il in range(hp.n_layer))

    @property
    def ring(self) -> int:
        return ring_rows(self.hp)

    @classmethod
    def layer_state(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], il: int) -> common.StateSpec | None:
        """F32 (llama.cpp keeps the compressors' rows in F32; the raw keys it keeps in the cache's type): `conv` the
        raw keys' ring [D, ring] (a slot per position modulo the ring); `state` the compressors' last rows, kv then
        score ([2D, 8] each, then the indexer's [2Di, 8] each, in a CSA layer; [D, 128] each in an HCA layer)."""
        return common.StateSpec((hp.head_dim, ring_rows(hp)), (sum(w * r for w, r in carried_rings(hp, il)),))

    # -------------------------------------------------------------------------- the state between layers
    @classmethod
    def state_width(cls, hp: HParams) -> int:
        hc = keys(hp).hc_mult
        return hc * hp.n_embd + hc + hc * hc + 1

    def _part(self, ctx: Any, x: Tensor, first: int, width: int) -> Tensor:
        """Floats first … first + width - 1 of every token's state x [state_width, n], as a view [width, n]."""
        n, row = int(x.contents.ne[1]), int(x.contents.nb[1])
        return ops.ggml_view_2d(ctx, x, width, n, row, 4 * first)

    def _streams(self, ctx: Any, x: Tensor) -> Tensor:
        """The streams of the state, contiguous [n_embd, hc, n]."""
        parts = self._parts_of(x)
        if parts is not None:
            return parts.streams
        e, n = self.hp.n_embd, int(x.contents.ne[1])
        return ops.ggml_cont_3d(ctx, self._part(ctx, x, 0, self.hc * e), e, self.hc, n)

    def _tid(self, ctx: Any, x: Tensor) -> Tensor:
        """The token ids of the state, contiguous F32 [1, n]."""
        parts = self._parts_of(x)
        if parts is not None:
            return parts.tid
        return ops.ggml_cont(ctx, self._part(ctx, x, self.state_width(self.hp) - 1, 1))

    def embed(self, ctx: Any, ids: Tensor) -> Tensor:
        e, hc, n = self.hp.n_embd, self.hc, int(ids.contents.ne[0])
        x = ops.ggml_get_rows(ctx, self.weights.get("token_embd.weight"), ids)
        streams = ops.ggml_repeat_4d(ctx, ops.ggml_reshape_3d(ctx, x, e, 1, n), e, hc, n, 1)
        mixes = ops.ggml_fill(ctx, ops.ggml_new_tensor_2d(ctx, F32, hc + hc * hc, n), 0.0)
        tid = ops.ggml_reshape_2d(ctx, ops.ggml_cast(ctx, ids, F32), 1, n)  # (ids < 2^24: exact as floats)
        return self._state(ctx, _Parts(streams, tid), mixes)

    def _state(self, ctx: Any, parts: _Parts, mixes: Tensor) -> Tensor:
        """The state [state_width, n] of the streams, mixes and token ids, copied into one tensor (what the runtime
        keeps between layer graphs); tagged by name with its parts, which the same graph's readers take instead of
        copying them out again (`_parts_of`). A decode step as one graph then never computes the state: 9 copies a
        layer fewer, each a node the threads meet at a barrier (the bench model's step: 1306 nodes not views →
        1219 with the raw keys' gathers; llama.cpp's 1178)."""
        n = int(parts.tid.contents.ne[1])
        flat = ops.ggml_reshape_2d(ctx, parts.streams, self.hc * self.hp.n_embd, n)
        state = ops.ggml_concat(ctx, ops.ggml_concat(ctx, flat, mixes, 0), parts.tid, 0)
        self._serial += 1
        ops.ggml_set_name(state, _TAG + str(self._serial).encode())
        self._states[self._serial] = parts
        if len(self._states) > _STATES_KEPT:  # (the oldest half: their graphs are long built)
            for key in list(self._states)[: _STATES_KEPT // 2]:
                del self._states[key]
        return state

    def _parts_of(self, x: Tensor) -> _Parts | None:
        """The parts of a state `_state` made in this graph, by its name (a tensor of a graph built later is named
        afresh: ggml clears a new tensor's name); None for any other tensor (an input: the layer graphs' state)."""
        name = bytes(x.contents.name)
        serial = name[len(_TAG) :]
        if not name.startswith(_TAG) or not serial.isdigit():  # (a view of it is named "… (view)": not its parts)
            return None
        return self._states.get(int(serial))

    def _hc_pre(self, ctx: Any, x: Tensor, fn: Tensor, scale: Tensor, base: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """A sublayer's input from the streams x [n_embd, hc, n], and its post [hc, n] and comb [hc, hc, n] mixes
        (build_hc_pre, deepseek4.cpp:353-409, with the fused comb and pre as llama.cpp takes them on the CPU)."""
        hc, n, eps = self.hc, int(x.contents.ne[2]), self.k.hc_eps
        flat = ops.ggml_reshape_2d(ctx, x, hc * self.hp.n_embd, n)
        mixes = ops.ggml_mul_mat(ctx, fn, ops.ggml_rms_norm(ctx, flat, self.hp.rms_eps))
        row = int(mixes.contents.nb[1])

        def affine(first: int, scale_at: int) -> Tensor:
            part = ops.ggml_view_2d(ctx, mixes, hc, n, row, 4 * first)
            part = ops.ggml_mul(ctx, part, ops.ggml_view_1d(ctx, scale, 1, 4 * scale_at))
            return ops.ggml_add(ctx, part, ops.ggml_view_1d(ctx, base, hc, 4 * first))

        pre = ops.ggml_scale_bias(ctx, ops.ggml_sigmoid(ctx, affine(0, 0)), 1.0, eps)
        post = ops.ggml_scale(ctx, ops.ggml_sigmoid(ctx, affine(hc, 1)), 2.0)
        comb = ops.ggml_dsv4_hc_comb(ctx, mixes, scale, base, eps, self.k.hc_sinkhorn_iters)
        return ops.ggml_dsv4_hc_pre(ctx, x, pre), post, comb

    # --------------------------------------------------------------------------------------------- graph
    def layer(self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache) -> common.LayerOut:
        w, n = self.w[il], at.n
        if at.pos0 is None and il == 0:  # (a reused graph's placement: its layers' inputs from here)
            if id(at) not in self._inputs:
                weakref.finalize(at, self._inputs.pop, id(at), None)
            self._inputs[id(at)] = _Inputs()
        hc = self.hc
        streams, tid = self._streams(ctx, x), self._tid(ctx, x)
        cur, post, comb = self._hc_pre(ctx, streams, w["hc_attn_fn"], w["hc_attn_scale"], w["hc_attn_base"])
        attn, writes = self.attention(ctx, il, self.norm(ctx, cur, w["attn_norm"]), at, kv)
        streams = ops.ggml_dsv4_hc_post(ctx, attn, streams, post, comb)
        cur, post, comb = self._hc_pre(ctx, streams, w["hc_ffn_fn"], w["hc_ffn_scale"], w["hc_ffn_base"])
        cur = self.norm(ctx, cur, w["ffn_norm"])
        mixes = ops.ggml_concat(ctx, post, ops.ggml_reshape_2d(ctx, comb, hc * hc, n), 0)
        residual = self._state(ctx, _Parts(streams, tid, post, comb), mixes)
        ids, weights = self._route(ctx, il, cur, tid)
        shared = self._shared(ctx, il, cur)
        return common.LayerOut(writes, routed=common.Routed(cur, residual, ids, weights, shared))

    def _route(self, ctx: Any, il: int, cur: Tensor, tid: Tensor) -> tuple[Tensor, Tensor]:
        """sqrt(softplus) probabilities; the top-k of probabilities + bias, or the token id's row of the hash
        table; their unbiased probabilities, normalised (sum clamped) and scaled (llama-graph.cpp build_moe_ffn)."""
        hp, w, n, k = self.hp, self.w[il], int(cur.contents.ne[1]), self.hp.n_expert_used
        logits = ops.ggml_mul_mat(ctx, w["ffn_gate_inp"], cur)
        ops.ggml_prec_set_acc(logits, ops.GGML_PREC_F32)
        probs = ops.ggml_sqrt(ctx, ops.ggml_softplus(ctx, logits))
        if il < self.k.hash_layer_count:
            rows = ops.ggml_cast(ctx, tid, I32)
            ids = ops.ggml_get_rows(ctx, w["ffn_gate_tid2eid"], ops.ggml_view_1d(ctx, rows, n, 0))
        else:
            ids = ops.ggml_argsort_top_k(ctx, ops.ggml_add(ctx, probs, w["exp_probs_b.bias"]), k)
        ids = ops.ggml_cont(ctx, ids)
        picked = ops.ggml_get_rows(ctx, ops.ggml_reshape_3d(ctx, probs, 1, hp.n_expert, n), ids)
        weights = ops.ggml_reshape_2d(ctx, picked, k, n)
        if hp.expert_weights_norm:
            total = ops.ggml_clamp(ctx, ops.ggml_sum_rows(ctx, weights), ROUTER_FLOOR, math.inf)
            weights = ops.ggml_div(ctx, weights, total)
        if hp.expert_weights_scale not in (0.0, 1.0):
            weights = ops.ggml_scale(ctx, weights, hp.expert_weights_scale)
        return ids, weights

    def _shared(self, ctx: Any, il: int, cur: Tensor) -> Tensor:
        w = self.w[il]
        gate = ops.ggml_mul_mat(ctx, w["ffn_gate_shexp"], cur)
        up = ops.ggml_mul_mat(ctx, w["ffn_up_shexp"], cur)
        limit = self.swiglu_limit(il)
        act = ops.ggml_swiglu_clamp(ctx, gate, up, limit) if limit > 1e-6 else ops.ggml_swiglu_split(ctx, gate, up)
        return ops.ggml_mul_mat(ctx, w["ffn_down_shexp"], act)

    def tail(self, ctx: Any, il: int, experts: Tensor, shared: Tensor | None, residual: Tensor) -> Tensor:
        """The FFN's output (experts + shared) mixed into the streams by the post and comb the layer left in the
        state (hc_post, deepseek4.cpp:1323)."""
        e, hc, n = self.hp.n_embd, self.hc, int(residual.contents.ne[1])
        out = experts if shared is None else ops.ggml_add(ctx, experts, shared)
        parts = self._parts_of(residual)
        if parts is not None and parts.post is not None and parts.comb is not None:  # (the layer's graph: its parts)
            streams = ops.ggml_dsv4_hc_post(ctx, out, parts.streams, parts.post, parts.comb)
            mixes = ops.ggml_concat(ctx, parts.post, ops.ggml_reshape_2d(ctx, parts.comb, hc * hc, n), 0)
            return self._state(ctx, _Parts(streams, parts.tid), mixes)
        streams = self._streams(ctx, residual)
        post = ops.ggml_cont(ctx, self._part(ctx, residual, hc * e, hc))
        comb = ops.ggml_cont_3d(ctx, self._part(ctx, residual, hc * e + hc, hc * hc), hc, hc, n)
        streams = ops.ggml_dsv4_hc_post(ctx, out, streams, post, comb)
        rest = self._part(ctx, residual, hc * e, hc + hc * hc + 1)
        flat = ops.ggml_reshape_2d(ctx, streams, hc * e, n)
        return ops.ggml_concat(ctx, flat, rest, 0)

    def tail_array(
        self, il: int, experts: np.ndarray, shared: np.ndarray | None, residual: np.ndarray
    ) -> np.ndarray | None:
        return None  # (hc_post: the session computes `tail` in a graph)

    def router_input(self, ctx: Any, lo: common.LayerOut) -> Tensor:
        """The streams' mean plus the shared expert: what the lookahead's later routers score."""
        r = lo.routed
        assert r is not None
        streams = self._streams(ctx, r.residual)
        e, n = self.hp.n_embd, int(streams.contents.ne[2])
        mean = ops.ggml_scale(
            ctx, ops.ggml_sum_rows(ctx, ops.ggml_cont(ctx, ops.ggml_permute(ctx, streams, 1, 0, 2, 3))), 1.0 / self.hc
        )
        mean = ops.ggml_reshape_2d(ctx, mean, e, n)
        return mean if r.shared is None else ops.ggml_add(ctx, mean, r.shared)

    def head(self, ctx: Any, x: Tensor) -> Tensor:
        """hc_head: the streams weighted by sigmoid of their own mixes (+ eps), then the output norm and matrix."""
        hc, n = self.hc, int(x.contents.ne[1])
        streams = self._streams(ctx, x)
        flat = ops.ggml_reshape_2d(ctx, streams, hc * self.hp.n_embd, n)
        fn, scale, base = (self.weights.get(f"output_hc_{part}.weight") for part in ("fn", "scale", "base"))
        mixes = ops.ggml_mul_mat(ctx, fn, ops.ggml_rms_norm(ctx, flat, self.hp.rms_eps))
        pre = ops.ggml_add(ctx, ops.ggml_mul(ctx, mixes, scale), base)
        pre = ops.ggml_scale_bias(ctx, ops.ggml_sigmoid(ctx, pre), 1.0, self.k.hc_eps)
        cur = self.norm(ctx, ops.ggml_dsv4_hc_pre(ctx, streams, pre), self.weights.get("output_norm.weight"))
        return ops.ggml_mul_mat(ctx, self.weights.get("output.weight"), cur)

    def expert_ffn(self, il: int) -> common.ExpertFFN:
        return common.ExpertFFN(
            limit=self.hp.swiglu_limit_exp[il] if self.hp.swiglu_limit_exp else 0.0, clamp_gate=True
        )

    def swiglu_limit(self, il: int) -> float:
        limits = self.hp.swiglu_limit_shexp or self.hp.swiglu_limit_exp
        return limits[il] if limits else 0.0

    @property
    def window(self) -> int:
        return 0  # (the layers mask their own ring of raw keys: `_raw_mask`)

    # ---------------------------------------------------------------------------------- reused decode graphs
    def _data(self, ctx: Any, at: common.Placement, fill: Fill, key: tuple[object, ...]) -> Tensor:
        """Data that depends on the graph's first position: a constant of a graph built for its positions, else an
        input of a reused decode graph (one token), written before each run (`set_inputs`): one for all the layers
        whose data have the same key (the window's mask and slots are every layer's, a block mask every layer's of
        its ratio). Filled in numpy for every token, a layer each, they took 0.58 ms of a 36 ms step on the bench
        model (134 inputs); 0.09 ms shared (18)."""
        if at.pos0 is not None:
            return _data(ctx, fill(at.pos0))
        inputs = self._inputs[id(at)]
        t = inputs.keyed.get(key)
        if t is None:
            a = fill(0)
            t = inputs.keyed[key] = _new(ctx, _GTYPES[a.dtype], tuple(reversed(a.shape)))
            ops.ggml_set_input(t)
            inputs.fills.append((t, fill))
        return t

    def set_inputs(self, at: common.Placement, pos: int) -> None:
        """A reused decode graph's position-dependent inputs, for its token at `pos` (runtime/token_graph.py)."""
        inputs = self._inputs.get(id(at))
        for t, fill in inputs.fills if inputs is not None else []:
            if t.contents.data:  # (an input no node reads is not allocated)
                a = np.ascontiguousarray(fill(pos))
                ctypes.memmove(t.contents.data, a.ctypes.data, a.nbytes)

    def one_graph_at(self, pos: int, n_ctx: int) -> bool:
        """Whether a reused decode graph may run the token at `pos`: each compressor writes the row of the block
        in progress, which exists unless the context ends before that block could complete."""
        return all(pos // r < blocks(n_ctx, r) for r in set(self.k.compress_ratios) if r)

    # ------------------------------------------------------------------------------------------ attention
    def attention(
        self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache
    ) -> tuple[Tensor, list[Tensor]]:
        hp, w, k = self.hp, self.w[il], self.k
        d, h, n = hp.head_dim, hp.n_head, at.n
        if at.pos0 is None and n != 1:
            raise UnsupportedError("a deepseek4 graph of several tokens is built for its positions")
        ratio = k.compress_ratios[il]
        rope = self.rope_compress if ratio else self.rope_window
        kv = common.recurrent_cache(kv)
        ring, span = kv.conv, self.ring
        if n > span - hp.sliding_window + 1:
            raise UnsupportedError(f"a deepseek4 graph takes at most {span - hp.sliding_window + 1} tokens")
        qr = self.norm(ctx, ops.ggml_mul_mat(ctx, w["attn_q_a"], x), w["attn_q_a_norm"])
        q = ops.ggml_reshape_3d(ctx, ops.ggml_mul_mat(ctx, w["attn_q_b"], qr), d, h, n)
        q = _rope_tail(ctx, ops.ggml_rms_norm(ctx, q, hp.rms_eps), at.positions, rope, d)
        kv_new = self.norm(ctx, ops.ggml_mul_mat(ctx, w["attn_kv"], x), w["attn_kv_a_norm"])
        kv_new = _rope_tail(ctx, ops.ggml_reshape_3d(ctx, kv_new, d, 1, n), at.positions, rope, d)
        # the raw keys into their ring slots (the snapshot first: the ring before this graph's last token)
        snap = kv.snapshot.conv if kv.snapshot is not None else None

        def data(fill: Fill, key: tuple[object, ...]) -> Tensor:
            return self._data(ctx, at, fill, key)

        writes = _carry(ctx, data, ring, ops.ggml_reshape_2d(ctx, kv_new, d, n), snap, at.pos0, n, span)
        keys_all, mask = self._raw_keys(ctx, ring, at, data)
        if ratio:
            assert kv.kv is not None
            blocks_ = _Blocks(kv.kv, d, k.indexer_head_size, ratio)
            writes += self._compress(ctx, il, x, at, kv, blocks_, data)
            n_blocks = min(at.n_kv // ratio, blocks_.n_blocks)
            if n_blocks:
                visible = data(lambda p: _block_mask(p, n, n_blocks, ratio), ("blocks", n, n_blocks, ratio))
                if ratio == CSA:
                    visible = self._indexer_mask(ctx, il, qr, x, at, blocks_, n_blocks, visible, data)
                comp = blocks_.comp_view(ctx, n_blocks)
                if int(comp.contents.type) != F32:  # (an F16 cache's blocks beside the F32 ring)
                    comp = ops.ggml_cast(ctx, comp, F32)
                keys_all = ops.ggml_concat(ctx, keys_all, comp, 2)
                mask = ops.ggml_concat(ctx, mask, visible, 0)
        out = _attend(ctx, q, keys_all, mask, 1.0 / math.sqrt(d), w["attn_sinks"])  # [d, h, n]
        out = _rope_tail(ctx, out, at.positions, rope, d, back=True)
        g, o = k.o_group_count, k.o_lora_rank
        out = ops.ggml_permute(ctx, ops.ggml_reshape_3d(ctx, out, d * h // g, g, n), 0, 2, 1, 3)
        wo_a = ops.ggml_reshape_3d(ctx, w["attn_output_a"], d * h // g, o, g)
        oa = ops.ggml_permute(ctx, ops.ggml_mul_mat(ctx, wo_a, out), 0, 2, 1, 3)
        oa = ops.ggml_cont_2d(ctx, oa, o * g, n)
        return ops.ggml_mul_mat(ctx, w["attn_output_b"], oa), writes

    def _raw_keys(self, ctx: Any, ring: Tensor, at: common.Placement, data: Data) -> tuple[Tensor, Tensor]:
        """The raw keys the graph's queries may see, [d, 1, size], and their mask [size, n]: the ring's slots of
        positions base … base + size - 1 in that order (`_raw_base`, `_raw_size`), not the whole ring. A decode step
        sees `sliding_window` keys; the ring holds window + 512 (768 slots on V4 Flash and the bench model): its
        products and the values' transposed copy ran over every slot (192 keys now on the bench model; with the
        shared inputs and states below its decode went 25.5 → 30.1 tok/s, 0.92× → 1.09× llama.cpp's).

        The same bits as over the whole ring: a key's product with its query does not depend on the others; the
        softmax's sum and the values' dot products add the keys in SIMD lanes by index, and the index of position q
        here is q - base with base a multiple of LANES (so q's lane is q mod LANES wherever the graph starts), in
        ascending order, with size a multiple of LANES (so the compressed blocks after them keep their lanes too);
        a key left out had weight 0 (masked), which adds exact zeros. So each query's result depends on its
        position only: not on the graph (a reused decode step, a graph built for the position, a prompt's chunk)."""
        d, n, span, window = self.hp.head_dim, at.n, self.ring, self.hp.sliding_window
        rows = ops.ggml_view_2d(ctx, ring, d, span, 4 * d, 0)
        if at.pos0 is None:  # (a reused decode step: any position, so its slots are an input)
            size = _raw_size(window + LANES - 1)
            keys = ops.ggml_get_rows(ctx, rows, data(lambda p: _raw_slots(p, size, span, window), ("slots", size)))
        else:
            base = _raw_base(at.pos0, window)
            size = _raw_size(at.pos0 + n - base)
            if base % span + size <= span:  # (the slots in order in the ring: a view)
                keys = ops.ggml_view_2d(ctx, ring, d, size, 4 * d, 4 * d * (base % span))
            else:  # (they wrap around its end)
                keys = ops.ggml_get_rows(ctx, rows, data(lambda p: _raw_slots(p, size, span, window), ("slots", size)))
        mask = data(lambda p: _raw_mask(p, n, size, span, window), ("window", n, size))
        return ops.ggml_reshape_3d(ctx, keys, d, 1, size), mask

    def _indexer_mask(
        self,
        ctx: Any,
        il: int,
        qr: Tensor,
        x: Tensor,
        at: common.Placement,
        blocks_: _Blocks,
        n_blocks: int,
        visible: Tensor,
        data: Data,
    ) -> Tensor:
        """The CSA blocks' mask: -inf except the indexer's top-k of each query (build_lid_top_k and
        build_top_k_mask, deepseek4.cpp:590-705), plus the visibility mask."""
        k, w, n = self.k, self.w[il], at.n
        di, ih = k.indexer_head_size, k.indexer_n_head
        iq = ops.ggml_reshape_3d(ctx, ops.ggml_mul_mat(ctx, w["indexer.attn_q_b"], qr), di, ih, n)
        iq = _rope_tail(ctx, iq, at.positions, self.rope_compress, di)
        iw = ops.ggml_scale(ctx, ops.ggml_mul_mat(ctx, w["indexer.proj"], x), 1.0 / math.sqrt(float(di * ih)))
        ik = blocks_.lid_view(ctx, n_blocks)
        mask16 = data(lambda p: _block_mask(p, n, n_blocks, CSA).astype(np.float16), ("blocks16", n, n_blocks))
        score = ops.ggml_lightning_indexer(ctx, iq, ik, iw, mask16)
        top = ops.ggml_cont(ctx, ops.ggml_top_k(ctx, score, min(n_blocks, k.indexer_top_k)))
        kk = int(top.contents.ne[0])
        hidden = ops.ggml_fill(ctx, ops.ggml_new_tensor_3d(ctx, F32, 1, n_blocks, n), -math.inf)
        zeros = ops.ggml_fill(ctx, ops.ggml_new_tensor_3d(ctx, F32, 1, kk, n), 0.0)
        picked = ops.ggml_reshape_2d(ctx, ops.ggml_set_rows(ctx, hidden, zeros, top), n_blocks, n)
        return ops.ggml_add(ctx, picked, visible)

    def _compress(
        self,
        ctx: Any,
        il: int,
        x: Tensor,
        at: common.Placement,
        kv: common.RecurrentCache,
        blocks_: _Blocks,
        data: Data,
    ) -> list[Tensor]:
        """The compressors of layer il over the graph's tokens: every block that completes here pooled into its
        cache row, and the carried rows updated (deepseek4.cpp:944-1176)."""
        w, d, ratio, eps = self.w[il], self.hp.head_dim, self.k.compress_ratios[il], self.hp.rms_eps
        rings = _views(ctx, kv.state, carried_rings(self.hp, il))
        snaps = _views(ctx, kv.snapshot.state, carried_rings(self.hp, il)) if kv.snapshot is not None else None
        # (HCA's compressor pools one block per row; CSA's two overlapping ones, and it has the indexer's too)
        out = _compressor(
            ctx,
            w,
            "attn_compressor",
            x,
            data,
            at.pos0,
            (rings[0], rings[1]),
            (snaps[0], snaps[1]) if snaps else None,
            ratio,
            d,
            blocks_.comp(ctx),
            self.rope_compress,
            ratio != HCA,
            eps,
        )
        if ratio == HCA:
            return out
        return out + _compressor(
            ctx,
            w,
            "indexer_compressor",
            x,
            data,
            at.pos0,
            (rings[2], rings[3]),
            (snaps[2], snaps[3]) if snaps else None,
            ratio,
            self.k.indexer_head_size,
            blocks_.lid(ctx),
            self.rope_compress,
            True,
            eps,
        )


# ------------------------------------------------------------------------------------------ the pieces
_TAG = b"dsv4-state:"  # the name of a state `_state` made, before its serial number
_STATES_KEPT = 4096  # states whose parts are remembered (a decode step as one graph makes 2 a layer)


@dataclass
class _Inputs:
    """A reused decode graph's position-dependent inputs: each with how it is filled, in order, and by key."""

    fills: list[tuple[Tensor, Fill]] = field(default_factory=list)
    keyed: dict[tuple[object, ...], Tensor] = field(default_factory=dict)


@dataclass
class _Parts:
    """What a state holds, as the tensors of its graph: streams [n_embd, hc, n], token ids [1, n] (contiguous), and
    the FFN's post [hc, n] and comb [hc, hc, n] mixes where the state is a layer's residual for its `tail`."""

    streams: Tensor
    tid: Tensor
    post: Tensor | None = None
    comb: Tensor | None = None


class _Blocks:
    """A compressing layer's K memory as the family lays it out (elements): its compressed blocks [d, n_ctx / ratio],
    then (CSA) the indexer's [di, n_ctx / 4]. `kv_layer` leaves room for both."""

    def __init__(self, cache: common.KVCache, d: int, di: int, ratio: int) -> None:
        self.k, self.d, self.di, self.ratio = cache.k, d, di, ratio
        self.elt = cache.elt
        self.n_blocks = blocks(int(cache.k.contents.ne[1]), ratio)

    def _view(self, ctx: Any, offset: int, width: int, rows: int) -> Tensor:
        return ops.ggml_view_2d(ctx, self.k, width, rows, width * self.elt, offset * self.elt)

    def comp(self, ctx: Any) -> Tensor:
        return self._view(ctx, 0, self.d, self.n_blocks)

    def comp_view(self, ctx: Any, n: int) -> Tensor:
        """The first n blocks as keys [d, 1, n]."""
        e = self.elt
        return ops.ggml_view_3d(ctx, self.k, self.d, 1, n, self.d * e, self.d * e, 0)

    def lid(self, ctx: Any) -> Tensor:
        return self._view(ctx, self.d * self.n_blocks, self.di, self.n_blocks)

    def lid_view(self, ctx: Any, n: int) -> Tensor:
        e = self.elt
        return ops.ggml_view_3d(ctx, self.k, self.di, 1, n, self.di * e, self.di * e, self.d * self.n_blocks * e)


def _views(ctx: Any, t: Tensor, shapes: list[tuple[int, int]]) -> list[Tensor]:
    """Consecutive F32 [width, rows] views of a flat state."""
    out, at = [], 0
    for width, rows in shapes:
        out.append(ops.ggml_view_2d(ctx, t, width, rows, 4 * width, 4 * at))
        at += width * rows
    return out


LANES = 64  # the widest SIMD grouping of ggml's F32 sums (AVX-512's dot products: 4 × 16 floats; NEON's, AVX2's: less)


def _raw_base(p0: int, window: int) -> int:
    """The first position of the raw keys a graph from position p0 attends over: the window's, down to LANES."""
    return max(0, p0 - window + 1) // LANES * LANES


def _raw_size(count: int) -> int:
    """Raw keys a graph attends over: `count` positions from its base, rounded up to LANES (a reused decode step:
    window + LANES - 1, the most one position needs, its base up to LANES - 1 before the window's start)."""
    return -(-count // LANES) * LANES


def _raw_slots(p0: int, size: int, span: int, window: int) -> np.ndarray:
    """[size] the ring slots of positions base …, base + size - 1 (position mod span)."""
    return ((_raw_base(p0, window) + np.arange(size)) % span).astype(np.int32)


def _raw_mask(p0: int, n: int, size: int, span: int, window: int) -> np.ndarray:
    """[n, size]: 0 where position q = base + i is a key the query at p sees, else -inf: q ≤ p, p - q < window
    (llama.cpp's standard sliding window), and its slot holds q after the graph's writes: the ring keeps the last
    span positions up to the graph's last, pos0 + n - 1 (a rewind restores the ring of its checkpoint, a fresh
    sequence's slots are behind position 0, which the base never precedes). A slot listed twice (a prompt's
    chunk longer than span - window - LANES) is seen once."""
    q = _raw_base(p0, window) + np.arange(size)
    p = np.arange(p0, p0 + n)[:, None]
    seen = (q <= p) & (p - q < window) & (q > p0 + n - 1 - span)
    return np.where(seen, 0.0, -np.inf).astype(np.float32)


def _carry(
    ctx: Any, data: Data, ring: Tensor, rows: Tensor, snap: Tensor | None, pos0: int | None, n: int, size: int
) -> list[Tensor]:
    """The writes that put the last `size` of the graph's rows [w, n] (positions pos0…; None: a reused decode
    graph's, whose indices are inputs) into a ring of `size` slots (slot: position mod size); with `snap` (a graph
    built for its positions), first the ring as it is one token before the graph's end copied there. In the order
    they must run (after every read of the ring's old rows)."""
    writes = []
    if snap is not None:
        assert pos0 is not None
        copied = ops.ggml_cpy(ctx, ring, snap)
        keep = list(range(max(pos0, pos0 + n - 1 - size), pos0 + n - 1))
        if keep:
            src = _data(ctx, np.array([p - pos0 for p in keep], np.int32))
            dst = _data(ctx, np.array([p % size for p in keep], np.int32))
            copied = ops.ggml_set_rows(ctx, copied, ops.ggml_get_rows(ctx, rows, src), dst)
        writes.append(copied)

    def kept(p0: int) -> np.ndarray:
        return np.arange(max(p0, p0 + n - size), p0 + n)

    src = data(lambda p0: (kept(p0) - p0).astype(np.int32), ("carry-src", n, size))
    dst = data(lambda p0: (kept(p0) % size).astype(np.int32), ("carry-dst", n, size))
    writes.append(ops.ggml_set_rows(ctx, ring, ops.ggml_get_rows(ctx, rows, src), dst))
    return writes


def _new(ctx: Any, gtype: int, shape: tuple[int, ...]) -> Tensor:
    if len(shape) == 1:
        return ops.ggml_new_tensor_1d(ctx, gtype, shape[0])
    if len(shape) == 2:
        return ops.ggml_new_tensor_2d(ctx, gtype, *shape)
    return ops.ggml_new_tensor_3d(ctx, gtype, *shape)


def _data(ctx: Any, a: np.ndarray) -> Tensor:
    """A tensor of the graph's context holding `a` (the graph is built for its positions: its masks and indices
    are known now). numpy's shape reversed, as ggml orders dimensions."""
    a = np.ascontiguousarray(a)
    t = _new(ctx, _GTYPES[a.dtype], tuple(reversed(a.shape)))
    ctypes.memmove(t.contents.data, a.ctypes.data, a.nbytes)
    return t


def _block_mask(pos0: int, n: int, n_blocks: int, ratio: int) -> np.ndarray:
    """[n, n_blocks]: 0 where block b has completed by the query's position ((p + 1) / ratio blocks), else -inf."""
    done = (np.arange(pos0, pos0 + n)[:, None] + 1) // ratio
    return np.where(np.arange(n_blocks)[None, :] < done, 0.0, -np.inf).astype(np.float32)


def _rope_tail(ctx: Any, x: Tensor, positions: Tensor, r: common.Rope, width: int, back: bool = False) -> Tensor:
    """RoPE (NORM pairs) on the last n_rot dims of each head of `width` (ggml_rope_set_offset); `back`: the inverse
    rotation (the attention output's de-rope)."""
    fn = ops.ggml_rope_ext_back if back else ops.ggml_rope_ext
    out = fn(
        ctx, x, positions, None, r.n_rot, r.mode, r.n_ctx_orig, r.base, r.freq_scale, r.ext_factor, r.attn_factor,
        r.beta_fast, r.beta_slow,
    )  # fmt: skip
    return ops.ggml_rope_set_offset(out, width - r.n_rot)


def _attend(ctx: Any, q: Tensor, k: Tensor, mask: Tensor, scale: float, sinks: Tensor) -> Tensor:
    """Softmax attention of q [d, h, n] over the keys k [d, 1, n_kv], which are also the values, with per-head
    sinks (build_attn_mha without flash attention, as common.attend computes it) → [d, h, n]."""
    d, h, n = (int(v) for v in q.contents.ne[:3])
    kq = ops.ggml_mul_mat(ctx, ops.ggml_permute(ctx, k, 0, 2, 1, 3), ops.ggml_permute(ctx, q, 0, 2, 1, 3))
    kq = ops.ggml_soft_max_ext(ctx, kq, mask, scale, 0.0)
    ops.ggml_soft_max_add_sinks(kq, sinks)
    v = ops.ggml_cont(ctx, ops.ggml_transpose(ctx, ops.ggml_permute(ctx, k, 0, 2, 1, 3)))
    kqv = ops.ggml_mul_mat(ctx, v, kq)  # [d, n, h]
    return ops.ggml_cont_3d(ctx, ops.ggml_permute(ctx, kqv, 0, 2, 1, 3), d, h, n)


def _compressor(
    ctx: Any,
    w: dict[str, Tensor],
    name: str,
    x: Tensor,
    data: Data,
    pos0: int | None,
    rings: tuple[Tensor, Tensor],
    snap: tuple[Tensor, Tensor] | None,
    ratio: int,
    d: int,
    cache: Tensor,
    rope: common.Rope,
    overlap: bool,
    eps: float,
) -> list[Tensor]:
    """One compressor (`name`: the attention's or the indexer's) over the graph's n tokens at pos0…: their kv and
    score rows (score + the position's ape row), every block completing at a position here pooled — a softmax of
    the scores over the block's tokens per channel weighting their kv (CSA, `overlap`: the previous block's tokens
    through the first half of the rows and the block's own through the second, 8 in all) —, RMS-normed, roped at
    the block's first position and written to its cache row; then the last positions' rows into the carried rings
    (and into `snap` as they are one token before the end). The writes in the order they must run.

    pos0 None (a reused decode graph, one token): the block in progress is pooled at every step and written to its
    row (its tokens after this one as the rows a block before position 0 takes: kv 0, score -inf), a row no query
    sees until the step that completes the block, which pools it as a graph built for that position does."""
    n = int(x.contents.ne[1])
    size = int(rings[0].contents.ne[1])
    kv_rows = ops.ggml_mul_mat(ctx, w[name + "_kv"], x)
    score = ops.ggml_mul_mat(ctx, w[name + "_gate"], x)
    ape_at = data(lambda p0: (np.arange(p0, p0 + n) % ratio).astype(np.int32), ("ape", n, ratio))
    score = ops.ggml_add(ctx, score, ops.ggml_get_rows(ctx, w[name + "_ape"], ape_at))
    writes: list[Tensor] = []

    def ends(p0: int) -> list[int]:
        """The last positions of the blocks pooled: those completing here, or the one in progress (pos0 None)."""
        if pos0 is None:
            return [p0 - p0 % ratio + ratio - 1]
        return [p for p in range(p0, p0 + n) if (p + 1) % ratio == 0]

    nb = len(ends(pos0 if pos0 is not None else 0))
    if nb:
        width = int(kv_rows.contents.ne[0])
        zero = ops.ggml_scale(ctx, ops.ggml_view_2d(ctx, kv_rows, width, 1, int(kv_rows.contents.nb[1]), 0), 0.0)
        ninf = ops.ggml_scale_bias(
            ctx, ops.ggml_view_2d(ctx, score, width, 1, int(score.contents.nb[1]), 0), 0.0, -math.inf
        )
        src_kv = ops.ggml_concat(ctx, ops.ggml_concat(ctx, rings[0], kv_rows, 1), zero, 1)
        src_sc = ops.ggml_concat(ctx, ops.ggml_concat(ctx, rings[1], score, 1), ninf, 1)

        def rows_of(p0: int, positions: list[int]) -> np.ndarray:
            def at(p: int) -> int:
                outside = p < 0 or p >= p0 + n  # (before position 0, or after the graph's last token)
                return size + n if outside else size + p - p0 if p >= p0 else p % size

            return np.array([at(p) for p in positions], np.int32)

        def starts(p0: int) -> list[int]:
            return [p + 1 - ratio for p in ends(p0)]

        if overlap:

            def gather(p0: int) -> np.ndarray:
                prev = [s - ratio + j for s in starts(p0) for j in range(ratio)]
                return rows_of(p0, prev + [s + j for s in starts(p0) for j in range(ratio)])

            idx = data(gather, ("pool-overlap", n, ratio, size))
            kr, sr = ops.ggml_get_rows(ctx, src_kv, idx), ops.ggml_get_rows(ctx, src_sc, idx)
            m = ratio * nb

            def halves(t: Tensor) -> Tensor:
                row = int(t.contents.nb[1])
                first = ops.ggml_cont(ctx, ops.ggml_view_2d(ctx, t, d, m, row, 0))
                second = ops.ggml_cont(ctx, ops.ggml_view_2d(ctx, t, d, m, row, m * row + 4 * d))
                a, b = (ops.ggml_reshape_3d(ctx, part, d, ratio, nb) for part in (first, second))
                return ops.ggml_concat(ctx, a, b, 1)

            values, scores = halves(kr), halves(sr)
        else:
            idx = data(
                lambda p0: rows_of(p0, [s + j for s in starts(p0) for j in range(ratio)]), ("pool", n, ratio, size)
            )
            values = ops.ggml_reshape_3d(ctx, ops.ggml_get_rows(ctx, src_kv, idx), d, ratio, nb)
            scores = ops.ggml_reshape_3d(ctx, ops.ggml_get_rows(ctx, src_sc, idx), d, ratio, nb)
        values = ops.ggml_cont(ctx, ops.ggml_permute(ctx, values, 1, 0, 2, 3))
        scores = ops.ggml_cont(ctx, ops.ggml_permute(ctx, scores, 1, 0, 2, 3))
        comp = ops.ggml_sum_rows(ctx, ops.ggml_mul(ctx, values, ops.ggml_soft_max(ctx, scores)))
        comp = ops.ggml_cont(ctx, ops.ggml_permute(ctx, comp, 1, 0, 2, 3))  # [d, 1, nb]
        comp = common.rms_norm(ctx, comp, w[name + "_norm"], eps)
        comp = _rope_tail(ctx, comp, data(lambda p0: np.array(starts(p0), np.int32), ("starts", n, ratio)), rope, d)
        rows = data(lambda p0: np.array([p // ratio for p in ends(p0)], np.int32), ("block-rows", n, ratio))
        writes.append(ops.ggml_set_rows(ctx, cache, ops.ggml_reshape_2d(ctx, comp, d, nb), rows))
    # the carried rows: the last `size` positions' (the snapshot: those before the last token), after every read
    for ring, rows_new, snap_ring in zip(rings, (kv_rows, score), snap or (None, None), strict=True):
        writes += _carry(ctx, data, ring, rows_new, snap_ring, pos0, n, size)
    return writes
