"""Qwen3.8 Flash Next (`qwen4exp`): Qwen3.5's gated DeltaNet and gated attention with hyper-connections in place of
every layer norm (llama.cpp: src/models/qwen4exp.cpp; docs/families/qwen4exp.md walks through it).

The state between layers is hc residual streams, [n_embd, hc] a token (the embedding copied hc times). Before its
attention and before its FFN a layer reads a mix of them (`hc_mix`): the streams RMS-normed one by one and scaled
by their gammas, gated by sigmoid of a low-rank projection of themselves (down, silu, up) and averaged; the
block's output goes back into every stream scaled by 2 · sigmoid(inject · normed / hc), one weight per stream
(`hc_combine`). The head mixes the streams once more, which is its only norm.

The DeltaNet differs from Qwen3.5's in one place: its output norm is gated by sigmoid(z), not silu(z). The full
layers attend through QSA (`qsa_mask`): each token's raw indexer key is cached beside its K (the layer's K memory
holds the attention's block, then the indexer's); a query keeps its incomplete block (the tail) and the complete
blocks of `compress_ratios[il]` cells that a mean-pooled, normed, rotated key per block scores highest, top_k + block
- 1 cells in all (build_qsa_top_k, build_attn_qsa). Until a query sees that many cells, that is every one.

The n-gram table (PLE): each token reads (ngram - 1) · heads_per_ngram rows of it, named by a hash of the token and
the ones before it (`NgramKeys.rows`, host-side: `token_input` hands `embed` the ids and those rows), gathered into
one n_embd-wide vector that rides in the state, after the streams, to the one linear layer that reads it. There it
is projected to a key per stream and a value; a signed square root of key · stream gates the value into every
stream, and a depthwise causal convolution dilated by ngram over the gated values (its history a second region of
the layer's convolution state) adds its SiLU (build_ple, qwen4exp.cpp:1220-1308).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenwing import _core
from tokenwing.compute.ggml_lib import F32, I32, Tensor, aligned_bytes, ops
from tokenwing.errors import BadInputError, UnsupportedError
from tokenwing.format.gguf_io import KV, tensor_nbytes
from tokenwing.models import common, qwen3next, specs
from tokenwing.models.base import TensorCheck
from tokenwing.models.factory import Factory, shared_ff
from tokenwing.models.glm_dsa import INDEXER_KEYS, indexer_keys, indexer_values
from tokenwing.models.hparams import HParams
from tokenwing.models.keys import Key, read_keys, write_keys
from tokenwing.models.qwen3next import Qwen35MoE, check_qwen_linear, qwen_next_kv
from tokenwing.models.specs import Parts, TensorSpec
from tokenwing.models.weights import ModelWeights

if TYPE_CHECKING:  # (the factory's geometry: types only)
    from tokenwing.testmodel.shapes import ModelShape

TABLE = "per_layer_token_embd.weight"
PAGE = 4096  # what a direct read of the model file reads at least


A = "qwen4exp"

# ------------------------------------------------------------------------------------------------ the family's keys
# Its own GGUF keys as tables (models/keys.py), read here and written by the factory (`_kv`): each layer's QSA block
# (attention.compress_ratios: 0 on linear layers; the budget, attention.indexer.top_k, is the indexer's shared key),
# and the n-gram table's group, which a file has where a layer reads the table. ple.conv_kernel and the row width
# are read for their type only: the table's and the convolution's shapes are what the graph takes.
KEYS: dict[str, Key] = {"compress_ratios": Key("attention.compress_ratios", "i32[]", [0])}
PLE_KEYS: dict[str, Key] = {
    "layers": Key("ple.layers", "i32[]", []),
    "ngram": Key("ple.ngram_size", "u32", 0),
    "heads_per_ngram": Key("ple.heads_per_ngram", "u32", 0),
    "conv_kernel": Key("ple.conv_kernel", "u32", 0),
    "eos": Key("ple.eos_token_id", "u32", 0),
    "width": Key("embedding_length_per_layer_input", "u32", 0),
    "multipliers": Key("ple.layer_multipliers", "u64[]"),
    "offsets": Key("ple.head_offsets", "u64[]"),
    "vocab_sizes": Key("ple.head_vocab_sizes", "u64[]"),
}


def qsa_keys(hp: HParams, where: str = "the model") -> tuple[int, tuple[int, ...]]:
    """QSA's budget of cells a query keeps (attention.indexer.top_k) and each layer's block of cells (0: a linear
    layer); attention is dense while a query sees at most budget + block - 1 cells (docs/families/qwen4exp.md 2.5)."""
    top_k = indexer_keys(hp, where).top_k
    per_layer: tuple[int, ...] = read_keys(KEYS, hp, where)["compress_ratios"]
    per_layer = (per_layer + (0,) * hp.n_layer)[: hp.n_layer]
    blocks = [r for il, r in enumerate(per_layer) if r and not hp.is_recurrent(il)]
    if top_k <= 0 or not blocks:
        raise BadInputError(f"{where}: qwen4exp needs attention.indexer.top_k and a compress ratio per full layer")
    if any(r < 0 or r > 64 for r in per_layer):  # (llama.cpp asserts it: a block's cells are bits of a uint64)
        raise BadInputError(f"{where}: qwen4exp.attention.compress_ratios must be 0 to 64")
    return top_k, per_layer


def ple_keys(hp: HParams, where: str = "the model") -> tuple[int, NgramKeys | None]:
    """The layer that reads the n-gram table (-1: no table), one linear-attention layer (llama.cpp takes no more
    than one), and the hash that names a token's rows of it."""
    listed = PLE_KEYS["layers"].read(hp, where)
    if not listed:
        return -1, None
    if len(listed) != 1 or not 0 <= listed[0] < hp.n_layer or not hp.is_recurrent(listed[0]):
        raise BadInputError(f"{where}: qwen4exp.ple.layers must name one linear-attention layer")
    return listed[0], NgramKeys.read(hp.keys, where)


@dataclass(frozen=True)
class NgramKeys:
    """The n-gram table's hash (qwen4exp.ple.*; docs/families/qwen4exp.md 2.6): which rows a token reads."""

    ngram: int  # n-grams of 2 … ngram tokens
    heads_per_ngram: int
    eos: int  # resets the window: it and everything before it read as EOS
    multipliers: tuple[int, ...]  # one per position back, 0 the token itself
    offsets: tuple[int, ...]  # each head's first row in the table
    vocab_sizes: tuple[int, ...]  # each head's rows

    @classmethod
    def of(cls, meta: dict[str, Any], where: str) -> NgramKeys | None:
        """The file's keys (`PLE_KEYS`); None where it has no table (no qwen4exp.ple.layers)."""
        return cls.read({k[len(A) + 1 :]: v for k, v in meta.items() if k.startswith(f"{A}.")}, where)

    @classmethod
    def read(cls, own: dict[str, Any], where: str) -> NgramKeys | None:
        """`of` from the file's qwen4exp keys with the prefix dropped (`HParams.keys`)."""
        if not PLE_KEYS["layers"].value(A, own, where):
            return None
        v = {field: key.value(A, own, where) for field, key in PLE_KEYS.items()}
        k = cls(v["ngram"], v["heads_per_ngram"], v["eos"], v["multipliers"], v["offsets"], v["vocab_sizes"])
        heads = (k.ngram - 1) * k.heads_per_ngram
        if k.ngram < 2 or heads < 1 or len(k.multipliers) < k.ngram or min(len(k.offsets), len(k.vocab_sizes)) < heads:
            raise BadInputError(f"{where}: the n-gram table's keys (qwen4exp.ple.*) do not fit together")
        if not all(k.vocab_sizes[:heads]):
            raise BadInputError(f"{where}: {A}.ple.head_vocab_sizes must be positive")
        return k

    @property
    def heads(self) -> int:
        return (self.ngram - 1) * self.heads_per_ngram

    def rows(self, tokens: list[int], before: list[int]) -> np.ndarray:
        """The table rows [len(tokens), heads] the tokens read, `before` the sequence's tokens ahead of them
        (oldest first; fewer than ngram - 1 where the sequence starts). Going back from a token, a missing one,
        an EOS and everything before it read as EOS; the token's own EOS counts as itself. The products stay
        below 2^63 (multipliers below 2^63 / vocab): uint64 as llama.cpp hashes, int64 as the reference does."""
        back = self.ngram - 1
        seq = [*before[-back:], *tokens] if back else list(tokens)
        first = len(seq) - len(tokens)
        m = [np.uint64(x) for x in self.multipliers[: self.ngram]]
        sizes = np.array(self.vocab_sizes[: self.heads], np.uint64)
        offsets = np.array(self.offsets[: self.heads], np.uint64)
        out = np.empty((len(tokens), self.heads), np.int64)
        for i in range(len(tokens)):
            at = first + i
            ctx = [seq[at]]
            cut = False
            for s in range(1, self.ngram):
                t = seq[at - s] if at - s >= 0 else -1
                cut = cut or t < 0 or t == self.eos
                ctx.append(self.eos if cut else t)
            for n in range(2, self.ngram + 1):  # the n-gram of the token and the n - 1 before it
                mixed = np.uint64(ctx[0]) * m[0]
                for j in range(1, n):
                    mixed ^= np.uint64(ctx[j]) * m[j]
                h = slice((n - 2) * self.heads_per_ngram, (n - 1) * self.heads_per_ngram)
                out[i, h] = (mixed % sizes[h] + offsets[h]).astype(np.int64)
        return out


class NgramRows:
    """The n-gram table's rows read from the model file as tokens name them, never the whole table: its 4 KiB pages
    are a streaming core's records of their own (`_core.StreamCore`, one layer whose "experts" are the table's
    pages), so they are read on the core's I/O threads (io_uring where the kernel has it, O_DIRECT), cached in its
    slots under the core's policy, and counted by its counters; a ring of gathered rows is what `embed` reads (its
    `get_rows` indices are ring slots).

    A graph's rows are known from its token ids before any layer runs, so `gather` asks the core for every page
    they need at once (its demand reads go out together, `io_threads` in flight) and copies the rows when they
    have landed: a token's ~16 pages cost about one read's latency, not 16 in a row. The cache is small on
    purpose: n-grams repeat little (q4x-bench's table over 1.5k tokens: 15.97 pages a token read with 1 MiB,
    14.77 with 16 MiB, docs/families/qwen4exp.md), and a miss's victim is chosen among all of a layer's slots."""

    io_threads = 8  # (the streaming core's default depth: StreamConfig.io_threads)

    def __init__(
        self,
        path: str,
        offset: int,
        row_bytes: int,
        table_bytes: int,
        cache_bytes: int,
        ring_rows: int,
        io_threads: int | None = None,
    ) -> None:
        self.path, self.offset, self.row_bytes = path, offset, row_bytes
        self.io_threads = io_threads or NgramRows.io_threads
        self.first = offset // PAGE  # the file's page holding the table's first byte: the core's record 0
        end = -(-(offset + table_bytes) // PAGE)
        size = _core.DirectFile(path, False).size
        self.n_pages = max(1, min(end, size // PAGE) - self.first)  # (a last partial page cannot be a record)
        self.core: Any = None
        self.capacity = 0  # pages the core caches (`resize`)
        self.resize(cache_bytes)
        self.ring_rows = ring_rows
        self.ring = aligned_bytes(ring_rows * row_bytes)
        self.next = 0
        self.rows_asked = 0  # rows named by tokens
        self.batches = 0  # groups of pages that missed, each waited for once

    def resize(self, cache_bytes: int) -> None:
        """A cache of `cache_bytes` (at least the 2 pages a row may span): a new, empty core, unless the one there
        has that many slots already (the session's budget share is usually the default: no second core at start)."""
        capacity = max(2, min(cache_bytes // PAGE, self.n_pages))
        if self.core is not None:
            if capacity == self.capacity:
                return
            self.core.close()
        self.capacity = capacity
        geo = _core.LayerGeometry()
        geo.offset, geo.record_size, geo.n_slots = self.first * PAGE, PAGE, self.capacity
        geo.proj_offset, geo.proj_size = [0, 0, 0], [PAGE, 0, 0]
        config = _core.StreamConfig()
        config.io_threads = self.io_threads
        config.idle_fill_ms = -1  # nothing is predicted: no idle fills
        try:
            self.core = _core.StreamCore(self.path, self.n_pages, [geo], config)
        except (ValueError, IndexError) as e:
            raise BadInputError(f"{self.path}: the n-gram table: {e}") from None
        self.pages = self.core.slot_array(0)

    @property
    def direct(self) -> bool:
        return bool(self.core.direct)

    def counters(self) -> dict[str, int]:
        """The table's reads so far: pages read (`page_reads`), their bytes, and the time waited on them."""
        c = self.core.counters()[0]
        names = _core.COUNTERS
        return {
            "page_reads": int(c[names.index("demand_reads")]),
            "bytes_read": int(c[names.index("bytes_read")]),
            "wait_ns": int(c[names.index("wait_ns")]),
            "rows": self.rows_asked,
        }

    @property
    def page_reads(self) -> int:
        return self.counters()["page_reads"]

    def close(self) -> None:
        self.core.close()

    def _load(self, pages: list[int]) -> list[int]:
        """These pages (at most `capacity`, as core records) in the cache; their slots."""
        ready = self.core.begin_layer(0, pages)
        if not all(ready):
            self.batches += 1
        return list(self.core.wait_all(0, pages))

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """The table's rows (any shape of row indices) copied into the ring; their ring slots, in that shape."""
        unique, inverse = np.unique(rows, return_inverse=True)
        if len(unique) > self.ring_rows // 4:  # (a graph's rows must not wrap onto each other before it runs)
            raise BadInputError(f"{len(unique)} n-gram rows in one graph: at most {self.ring_rows // 4}")
        rb = self.row_bytes
        starts = self.offset + unique.astype(np.int64) * rb
        firsts, lasts = starts // PAGE - self.first, (starts + rb - 1) // PAGE - self.first
        if len(unique) and int(lasts[-1]) >= self.n_pages:
            raise BadInputError(f"{self.path}: n-gram row {int(unique[-1])} lies past the end of the file")
        slots = np.empty(len(unique), np.int64)
        i = 0
        self.core.begin_token(0)
        while i < len(unique):
            # as many rows as their pages fit in the cache, loaded together, then copied
            group: dict[int, None] = {}
            j = i
            while j < len(unique):
                more = {int(firsts[j]): None, int(lasts[j]): None}
                if len(group | more) > self.capacity and j > i:
                    break
                group |= more
                j += 1
            pages = list(group)
            where = dict(zip(pages, self._load(pages), strict=True))
            for k in range(i, j):
                slot, self.next = self.next, (self.next + 1) % self.ring_rows
                dst = self.ring[slot * rb : (slot + 1) * rb]
                first, at = int(firsts[k]), int(starts[k]) % PAGE
                head = min(rb, PAGE - at)
                dst[:head] = self.pages[where[first]][at : at + head]
                if head < rb:
                    dst[head:] = self.pages[where[first + 1]][: rb - head]
                slots[k] = slot
            self.core.end_layer(0)
            i = j
        self.rows_asked += rows.size
        return slots[inverse].reshape(rows.shape)


def qsa_ratio(hp: HParams, il: int) -> int:
    """Layer il's QSA block (attention.compress_ratios), 0 where it has none (a linear layer)."""
    return 0 if hp.is_recurrent(il) else qsa_keys(hp)[1][il]


# ------------------------------------------------------------------------------------------------ the factory's
# Qwen3.8 Flash Next (llama.cpp: src/models/qwen4exp.cpp, conversion/qwen4exp.py; docs/families/qwen4exp.md).

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """The SplitMix64 finaliser (the reference derives its n-gram hash multipliers from it)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def ple_multipliers(s: ModelShape, seed: int = 1234) -> list[int]:
    """One odd multiplier per n-gram position, below 2^63 / vocab so that token · multiplier never overflows an
    int64 (the reference's rule for its first PLE module, which is what makes llama.cpp's uint64 hash agree)."""
    half = max(1, (((1 << 63) - 1) // max(s.vocab_size, 1)) // 2)
    return [2 * (_splitmix64((seed + 0x9E3779B97F4A7C15 * (i + 1)) & _MASK64) % half) + 1 for i in range(s.ple_ngram)]


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def ple_head_vocab_sizes(s: ModelShape) -> list[int]:
    """Each head's rows: the consecutive primes from ple_head_rows (the reference: from 20,000,000)."""
    sizes: list[int] = []
    n = s.ple_head_rows - 1
    for _ in range(ple_heads(s)):
        n += 1
        while not _is_prime(n):
            n += 1
        sizes.append(n)
    return sizes


def ple_heads(s: ModelShape) -> int:
    return (s.ple_ngram - 1) * s.ple_heads_per_ngram


def ple_table_rows(s: ModelShape) -> int:
    """All heads' rows, padded to a multiple of 128 as the reference's table is."""
    return -(-sum(ple_head_vocab_sizes(s)) // 128) * 128


def qwen_recurrent(s: ModelShape, i: int) -> bool:
    """Qwen3-Next / Qwen3.5 / Qwen3.8: every layer but each full_attention_interval-th is linear attention."""
    return (i + 1) % s.full_attention_interval != 0


def _tensors(s: ModelShape, hp: HParams, parts: Parts) -> list[TensorSpec]:
    """Qwen3.8 Flash Next: Qwen3.5's gated DeltaNet (sigmoid output gate) and gated attention with the QSA indexer,
    no layer norms but two low-rank hyper-connection mixes a layer (hc_mult streams), the n-gram table and its
    injection on one linear layer, 512-style routed experts and a gated shared expert, the head's own mix."""
    e, hc, r = s.n_embd, s.hc_mult, s.hc_low_rank
    unbiased = dataclasses.replace(parts, exp_bias=False)
    first = [TensorSpec("token_embd.weight", (e, s.vocab_size), "embd")]
    if s.ple_layer >= 0:
        first.append(TensorSpec("per_layer_token_embd.weight", (e // ple_heads(s), ple_table_rows(s)), "embd"))
    layers: list[TensorSpec] = []
    for i in range(s.n_layer):
        for part in ("attn", "ffn"):
            layers += [
                TensorSpec(f"blk.{i}.hc_{part}_norm.weight", (hc * e,), "norm"),
                TensorSpec(f"blk.{i}.hc_{part}_down.weight", (hc * e, r), "matrix"),
                TensorSpec(f"blk.{i}.hc_{part}_up.weight", (r, hc * e), "matrix"),
                TensorSpec(f"blk.{i}.hc_{part}_inject.weight", (hc * e, hc), "matrix"),
            ]
        if qwen_recurrent(s, i):
            linear = qwen3next.linear_tensors(hp, i, True, s.legacy_ssm_in)
            layers += [t for t in linear if not t.name.endswith("attn_norm.weight")]
        else:
            di = s.indexer_head_size
            gated = qwen3next.gated_attention_tensors(hp, i)
            layers += [t for t in gated if not t.name.endswith("attn_norm.weight")]
            layers += [
                TensorSpec(f"blk.{i}.indexer.q_proj.weight", (e, s.indexer_n_head * di), "matrix"),
                TensorSpec(f"blk.{i}.indexer.k_proj.weight", (e, di), "matrix"),
                TensorSpec(f"blk.{i}.indexer.q_norm.weight", (di,), "norm"),
                TensorSpec(f"blk.{i}.indexer.k_norm.weight", (di,), "norm"),
            ]
        if i == s.ple_layer:
            layers += [
                TensorSpec(f"blk.{i}.ple_key.weight", (e, hc * e), "matrix"),
                TensorSpec(f"blk.{i}.ple_value.weight", (e, e), "matrix"),
                TensorSpec(f"blk.{i}.ple_norm_key.weight", (hc * e,), "norm"),
                TensorSpec(f"blk.{i}.ple_norm_query.weight", (hc * e,), "norm"),
                TensorSpec(f"blk.{i}.ple_norm_conv.weight", (hc * e,), "norm"),
                # (its rows are the kernel's taps: too short for any block type, F32 as the converter falls back)
                TensorSpec(f"blk.{i}.ple_conv1d.weight", (s.ple_conv_kernel, hc * e), "vector"),
            ]
        layers += [t for t in specs.routed(hp, i, unbiased) if not t.name.endswith("ffn_norm.weight")]
        layers += specs.shared(hp, i, shared_ff(s), gated=True)
    last = [
        TensorSpec("output.weight", (e, s.vocab_size), "matrix"),
        TensorSpec("output_hc_norm.weight", (hc * e,), "norm"),
        TensorSpec("output_hc_down.weight", (hc * e, r), "matrix"),
        TensorSpec("output_hc_up.weight", (r, hc * e), "matrix"),
    ]
    return first + layers + last


def _kv(s: ModelShape) -> dict[str, KV]:
    """As llama.cpp's converter writes Qwen3.8 Flash Next: Qwen3.5's keys, the hyper-connections' count and rank, the
    indexer (its ratio on full-attention layers, 0 on linear ones), and the PLE group where a layer has the table:
    its hash constants as uint64 arrays, the EOS that resets the n-grams, the table's row width."""
    # (lazy: the factory's tokenizer trains a vocabulary; the engine, which imports this module, never needs it)
    from tokenwing.testmodel.tokenizer import build_vocabulary

    a = "qwen4exp"
    kv = qwen_next_kv(s, a)
    kv[f"{a}.hyper_connection.count"] = KV.u32(s.hc_mult)
    kv[f"{a}.hyper_connection.low_rank"] = KV.u32(s.hc_low_rank)
    kv |= write_keys(INDEXER_KEYS, a, indexer_values(s))
    # the family's own keys (KEYS, PLE_KEYS)
    kv |= write_keys(
        KEYS, a, {"compress_ratios": [0 if qwen_recurrent(s, i) else s.qsa_ratio for i in range(s.n_layer)]}
    )
    if s.ple_layer >= 0:
        sizes = ple_head_vocab_sizes(s)
        ple = {
            "layers": [s.ple_layer],
            "ngram": s.ple_ngram,
            "heads_per_ngram": s.ple_heads_per_ngram,
            "conv_kernel": s.ple_conv_kernel,
            "eos": build_vocabulary(s.vocab_size, s.tokenizer).eos_id,
            "width": s.n_embd // ple_heads(s),
            "multipliers": ple_multipliers(s),
            "offsets": [sum(sizes[:h]) for h in range(len(sizes))],
            "vocab_sizes": sizes,
        }
        kv |= write_keys(PLE_KEYS, a, ple)
    return kv


def _check(s: ModelShape) -> None:
    """What llama.cpp's qwen4exp loader and graph take (qwen4exp.cpp:29-151; it throws or asserts on the rest)."""
    if s.n_head % s.n_head_kv or s.n_expert_used > s.n_expert or min(s.n_layer, s.n_expert_used) < 1:
        raise ValueError("--n-head must be a multiple of --n-head-kv, 1 <= --n-expert-used <= --n-expert")
    if s.n_dense_lead or s.n_mtp or s.legacy_ssm_in or s.q_lora_rank or s.kv_lora_rank or s.n_expert_group:
        raise ValueError("qwen4exp has no dense layers, MTP block (the converter drops it), ssm_in or MLA")
    if s.hc_mult < 2 or s.hc_low_rank < 1:
        raise ValueError("qwen4exp needs --hc-mult of 2 or more and a positive --hc-low-rank")
    if min(s.indexer_n_head, s.indexer_head_size, s.indexer_top_k, s.qsa_ratio) < 1:
        raise ValueError("qwen4exp's QSA needs --indexer-n-head, --indexer-head-size, --indexer-top-k, --qsa-ratio")
    if s.indexer_top_k % s.qsa_ratio or s.rot > s.indexer_head_size:
        raise ValueError("--indexer-top-k must be a multiple of --qsa-ratio and --n-rot at most --indexer-head-size")
    if len(s.rope_sections) != 4 or 2 * sum(s.rope_sections) > s.rot:
        raise ValueError("qwen4exp's IMRoPE needs four section counts whose pairs fit in --n-rot")
    if s.n_shared_exp < 1:
        raise ValueError("qwen4exp runs a shared expert in every layer: --n-shared-exp must be at least 1")
    check_qwen_linear(s)
    if s.ple_layer >= 0:
        heads = ple_heads(s)
        if s.ple_layer >= s.n_layer or not qwen_recurrent(s, s.ple_layer):
            raise ValueError("--ple-layer must be a linear-attention layer of the model (-1: no n-gram table)")
        if not 2 <= s.ple_ngram <= 8 or s.ple_heads_per_ngram < 1 or heads > 64:
            raise ValueError("--ple-ngram must be 2..8 and --ple-heads-per-ngram positive (64 heads at most)")
        if s.ple_conv_kernel < 2:  # (llama.cpp takes 1, then crashes on the empty history row: measured)
            raise ValueError("--ple-conv-kernel must be at least 2")
        if s.n_embd % heads:
            raise ValueError("--n-embd must be a multiple of the n-gram heads ((ple_ngram - 1) · heads_per_ngram)")
        if s.ple_head_rows < 2 or len(ple_head_vocab_sizes(s)) * s.ple_head_rows >= 2**31:
            raise ValueError("--ple-head-rows must be at least 2, all heads' rows within int32")


class Qwen4Exp(Qwen35MoE):
    arch = "qwen4exp"
    factory = Factory(
        "Qwen3.8 Flash Next: gated DeltaNet (sigmoid gate) and QSA-indexed gated attention, low-rank "
        "hyper-connections, an n-gram embedding table on one layer, softmax top-k experts and a gated shared expert",
        _kv,
        _check,
        _tensors,
        takes=frozenset({"n_rot", "hc_mult", "hc_low_rank", "qsa_ratio", "ple_layer"})
        | {"indexer_n_head", "indexer_head_size", "indexer_top_k"},
    )
    ffn_norm = "ffn_norm"  # (absent: the router reads the FFN's mix as it is)
    token_context = 7  # (`token_input` hashes n-grams of at most 8 tokens: llama.cpp's LLAMA_MAX_PLE_NGRAM)
    # The n-gram table's page cache: at most this, and a sixteenth of the expert cache's budget, which it comes out
    # of (`share_expert_budget`); the ring of rows a graph reads (64k rows: 8.5 MiB at Q8_0 and 128 values). 1 MiB:
    # a miss's victim is chosen among all the core's slots, and 16 random rows a token from a 256 MiB table took
    # 1.2-1.5 ms a token with 256 slots against 8.7-10 ms with 16,384 (64 MiB), which saved only 2.6 of 16.4
    # pages a token (/tmp script through NgramRows, the tests running alongside); the experts use the room better.
    ngram_cache_bytes = 1 << 20
    ngram_ring_rows = 1 << 16

    def __init__(self, hp: HParams, weights: ModelWeights, streamed: list[int]) -> None:
        super().__init__(hp, weights, streamed)
        self.hc = self.streams(hp, weights.shapes)
        self.qsa_top_k = qsa_keys(hp)[0]
        self.ple_layer, self.ple = ple_keys(hp)
        self.ngram_rows: NgramRows | None = None
        if self.ple is not None:
            self.ple_kernel = weights.shapes[f"blk.{self.ple_layer}.ple_conv1d.weight"][0]
            self.ple_hist = self.history_tokens(hp, weights.shapes)
            path, offset, info = weights.lazy[TABLE]
            width = info.shape[0]
            row_bytes = tensor_nbytes((width,), info.type)
            rows = NgramRows(
                path, offset, row_bytes, row_bytes * info.shape[1], self.ngram_cache_bytes, self.ngram_ring_rows
            )
            self.ngram_rows = rows
            self.ngram_ring = weights.arena.wrap(rows.ring, info.type, (width, rows.ring_rows))
        # the lookahead folds a norm into later routers: the router here reads the mix as it is
        self._ones = weights.arena.wrap(np.ones(hp.n_embd, np.float32), F32, (hp.n_embd,))

    @staticmethod
    def streams(hp: HParams, shapes: dict[str, tuple[int, ...]]) -> int:
        """hyper_connection.count, from the head's mix (its up-projection is [rank, hc · n_embd])."""
        return shapes.get("output_hc_up.weight", (0, 0))[1] // max(hp.n_embd, 1)

    @staticmethod
    def history_tokens(hp: HParams, shapes: dict[str, tuple[int, ...]]) -> int:
        """The n-gram injection's convolution history, in tokens: (kernel - 1) · n-gram (0 without the table)."""
        layer, ple = ple_keys(hp)
        if ple is None:
            return 0
        return (shapes[f"blk.{layer}.ple_conv1d.weight"][0] - 1) * ple.ngram

    # -------------------------------------------------------------------------------------------- checks
    @classmethod
    def check(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], streamed: dict[int, int], where: str) -> None:
        qsa_keys(hp, where)  # (the family's keys refused in one line, naming the file, before anything is sized)
        e = hp.n_embd
        hc = cls.streams(hp, shapes)
        rank = shapes.get("output_hc_down.weight", (0, 0))[1]
        if hc < 2 or rank < 1:
            raise BadInputError(f"{where}: qwen4exp needs output_hc_down and output_hc_up of 2 or more streams")
        if hc != 4:  # (the state's width is planned from the metadata, which does not carry the count we read)
            raise UnsupportedError(f"{where}: qwen4exp with {hc} hyper-connection streams is not run (4 are)")
        if len(streamed) != hp.n_layer:
            raise BadInputError(f"{where}: every qwen4exp layer has routed experts")
        c = TensorCheck(hp, shapes, where)
        c.need("token_embd.weight", (e, hp.vocab_size))
        if c.has("output.weight"):
            c.need("output.weight", (e, hp.vocab_size))
        mixes = [("output_hc", False)]
        mixes += [(f"blk.{il}.hc_{part}", True) for il in range(hp.n_layer) for part in ("attn", "ffn")]
        for prefix, inject in mixes:
            c.need(prefix + "_norm.weight", (hc * e,))
            c.need(prefix + "_down.weight", (hc * e, rank))
            c.need(prefix + "_up.weight", (rank, hc * e))
            if inject:
                c.need(prefix + "_inject.weight", (hc * e, hc))
        layer, ple = ple_keys(hp, where)
        if ple is not None:
            heads, p = ple.heads, f"blk.{layer}."
            rows = max(o + v for o, v in zip(ple.offsets[:heads], ple.vocab_sizes[:heads], strict=True))
            table = shapes.get("per_layer_token_embd.weight", (0, 0))
            if e % heads or table[0] != e // heads or table[1] < rows:
                raise BadInputError(
                    f"{where}: per_layer_token_embd must hold rows of n_embd / {heads} heads, at least {rows} of them"
                )
            kernel = shapes.get(p + "ple_conv1d.weight", (0, 0))[0]
            if kernel < 2:  # (llama.cpp takes 1, then crashes on the empty history)
                raise BadInputError(f"{where}: {p}ple_conv1d must have 2 taps or more")
            c.need(p + "ple_key.weight", (e, hc * e))
            c.need(p + "ple_value.weight", (e, e))
            c.need(p + "ple_conv1d.weight", (kernel, hc * e))
            for n in ("key", "query", "conv"):
                c.need(p + f"ple_norm_{n}.weight", (hc * e,))
        # Qwen3.5's checks of the rest, told of the norms the hyper-connections replace as if the file had them
        norms = ["output_norm"] + [f"blk.{il}.{n}" for il in range(hp.n_layer) for n in ("attn_norm", "ffn_norm")]
        super().check(hp, shapes | {f"{n}.weight": (e,) for n in norms}, streamed, where)

    @classmethod
    def check_attention(cls, c: TensorCheck, il: int) -> None:
        hp = c.hp
        for t in cls.attention_tensors(hp, il, Parts(frozenset())):  # (Qwen3.5's gated DeltaNet or attention)
            c.need(t.name, t.shape)
        if qsa_ratio(hp, il):
            k = indexer_keys(hp, c.where)
            p, e, di = f"blk.{il}.indexer.", hp.n_embd, k.head_size
            if k.n_head < 1 or di < 1 or hp.n_rot > di:
                raise BadInputError(
                    f"{c.where}: qwen4exp's QSA needs indexer heads and an indexer head of at least the rope dims"
                )
            c.need(p + "q_proj.weight", (e, k.n_head * di))
            c.need(p + "k_proj.weight", (e, di))
            c.need(p + "q_norm.weight", (di,))
            c.need(p + "k_norm.weight", (di,))

    @classmethod
    def kv_layer(cls, hp: HParams, il: int) -> common.KVSpec:
        """A QSA layer's K memory holds its attention's K, then each token's raw indexer key (llama.cpp's indexer
        cache, `llama_memory_hybrid_idx`: one key head, in the cache's type)."""
        spec = super().kv_layer(hp, il)
        return dataclasses.replace(spec, k=spec.k + indexer_keys(hp).head_size) if qsa_ratio(hp, il) else spec

    @classmethod
    def graph_extra_bytes(cls, hp: HParams, max_batch: int, n_ctx: int) -> int:
        """A QSA layer's selection builds F32 [n_kv, batch] tensors (the cells' scores, with the mask, the picks'
        blank, fill and mask, the top-k's work) and attends through the picks' mask instead of flash attention's
        tiles (its scores: the plan's `attn` term). Measured: a 64-token chunk at 4,096 positions took 19.1 MB of
        the graph context against 5.2 MB dense, 13.3 such tensors of which the scores are 4 (heads); 16 is the
        rule (tests/oracle/test_qwen4exp.py). At the release's 262,144 positions and 64-token chunks: 1 GiB."""
        return 16 * 4 * max_batch * n_ctx if any(qsa_ratio(hp, il) for il in range(hp.n_layer)) else 0

    # -------------------------------------------------------------------------- the state between layers
    def share_expert_budget(self, budget: int) -> int:
        """The table's page cache comes out of the expert cache's budget: a sixteenth of it, at most
        `ngram_cache_bytes` (a token's rows are 16 pages at most, read once each: the experts need the room more)."""
        if self.ngram_rows is None:
            return budget
        take = min(self.ngram_cache_bytes, max(2 * PAGE, budget // 16))
        self.ngram_rows.resize(take)
        return max(0, budget - self.ngram_rows.capacity * PAGE)

    def lazy_reads(self) -> dict[str, int] | None:
        return self.ngram_rows.counters() if self.ngram_rows is not None else None

    @classmethod
    def lazy_tensors(cls, hp: HParams) -> frozenset[str]:
        """The n-gram table stays in the file: its rows are read as tokens name them (`NgramRows`)."""
        return frozenset({TABLE}) if ple_keys(hp)[1] is not None else frozenset()

    @classmethod
    def state_width(cls, hp: HParams) -> int:
        """The streams, and with a table each token's n-gram vector after them. (A class method without the file's
        shapes: 4 streams, transformers' default and the only count the released model has; `check` refuses
        another.)"""
        return 4 * hp.n_embd + (hp.n_embd if ple_keys(hp)[1] is not None else 0)

    def _streams(self, ctx: Any, state: Tensor) -> Tensor:
        """The streams [n_embd, hc, n] of a state [state_width, n]."""
        e, hc, n = self.hp.n_embd, self.hc, int(state.contents.ne[1])
        if self.ple is None:
            return ops.ggml_reshape_3d(ctx, state, e, hc, n)
        row = int(state.contents.nb[1])
        return ops.ggml_cont(ctx, ops.ggml_view_3d(ctx, state, e, hc, n, int(state.contents.nb[0]) * e, row, 0))

    def _ngrams(self, ctx: Any, state: Tensor) -> Tensor:
        """The tokens' n-gram vectors [n_embd, n] (after the streams)."""
        e, n, nb = self.hp.n_embd, int(state.contents.ne[1]), state.contents.nb
        return ops.ggml_cont(ctx, ops.ggml_view_2d(ctx, state, e, n, int(nb[1]), int(nb[0]) * self.hc * e))

    def _flat(self, ctx: Any, st: Tensor, state: Tensor | None = None) -> Tensor:
        """Streams st [n_embd, hc, n] as a state: with a table, `state`'s n-gram vectors after them."""
        flat = ops.ggml_reshape_2d(ctx, st, self.hp.n_embd * self.hc, int(st.contents.ne[2]))
        if self.ple is None:
            return flat
        assert state is not None
        return ops.ggml_concat(ctx, flat, self._ngrams(ctx, state), 0)

    @property
    def token_width(self) -> int:
        return 1 + (self.ple.heads if self.ple is not None else 0)

    def token_input(self, tokens: list[int], before: list[int]) -> np.ndarray:
        """Each token's id, then its rows of the n-gram table (I32 [1 + heads] a token)."""
        if self.ple is None:
            return super().token_input(tokens, before)
        assert self.ngram_rows is not None
        slots = self.ngram_rows.gather(self.ple.rows(tokens, before))
        return np.concatenate([np.asarray(tokens, np.int64)[:, None], slots], axis=1).astype(np.int32).reshape(-1)

    def embed(self, ctx: Any, ids: Tensor) -> Tensor:
        """hc copies of the token's embedding (qwen4exp.cpp:392), and with a table its n-gram vector: its rows
        gathered and laid head after head (build_inp_ple, :1200-1218)."""
        e = self.hp.n_embd
        if self.ple is None:
            x = super().embed(ctx, ids)
            n = int(ids.contents.ne[0])
            return self._flat(ctx, ops.ggml_repeat_4d(ctx, ops.ggml_reshape_3d(ctx, x, e, 1, n), e, self.hc, n, 1))
        heads = self.ple.heads
        n = int(ids.contents.ne[0]) // (1 + heads)
        per = ops.ggml_reshape_2d(ctx, ids, 1 + heads, n)
        f, row = int(per.contents.nb[0]), int(per.contents.nb[1])
        # (get_rows takes its indices 1-D: the contiguous copies viewed flat)
        tok = ops.ggml_view_1d(ctx, ops.ggml_cont(ctx, ops.ggml_view_2d(ctx, per, 1, n, row, 0)), n, 0)
        rows = ops.ggml_view_1d(ctx, ops.ggml_cont(ctx, ops.ggml_view_2d(ctx, per, heads, n, row, f)), heads * n, 0)
        x = ops.ggml_reshape_2d(ctx, ops.ggml_get_rows(ctx, self.weights.get("token_embd.weight"), tok), e, n)
        ngrams = ops.ggml_reshape_2d(ctx, ops.ggml_get_rows(ctx, self.ngram_ring, rows), e, n)
        streams = ops.ggml_repeat_4d(ctx, ops.ggml_reshape_3d(ctx, x, e, 1, n), e, self.hc, n, 1)
        return ops.ggml_concat(ctx, ops.ggml_reshape_2d(ctx, streams, self.hc * e, n), ngrams, 0)

    def _normed(self, ctx: Any, st: Tensor, gamma: Tensor) -> Tensor:
        """Each stream RMS-normed over its n_embd values, times its own gammas ([hc · n_embd] read as [n_embd, hc])."""
        g = ops.ggml_reshape_2d(ctx, gamma, self.hp.n_embd, self.hc)
        return ops.ggml_mul(ctx, ops.ggml_rms_norm(ctx, st, self.hp.rms_eps), g)

    def hc_mix(self, ctx: Any, st: Tensor, prefix: dict[str, Tensor], part: str) -> Tensor:
        """What a block reads from the streams st [n_embd, hc, n] (build_hc_mix, qwen4exp.cpp:270-324, its unfused
        form): the normed streams gated by sigmoid(up · silu(down · normed / hc)), averaged."""
        e, hc, n = self.hp.n_embd, self.hc, int(st.contents.ne[2])
        xn = ops.ggml_reshape_2d(ctx, self._normed(ctx, st, prefix[part + "_norm"]), hc * e, n)
        lo = ops.ggml_silu(ctx, ops.ggml_scale(ctx, ops.ggml_mul_mat(ctx, prefix[part + "_down"], xn), 1.0 / hc))
        gate = ops.ggml_mul_mat(ctx, prefix[part + "_up"], lo)
        gated = ops.ggml_reshape_3d(ctx, ops.ggml_mul(ctx, xn, ops.ggml_sigmoid(ctx, gate)), e, hc, n)
        row, stride = int(gated.contents.nb[1]), int(gated.contents.nb[2])
        mixed = ops.ggml_cont(ctx, ops.ggml_view_2d(ctx, gated, e, n, stride, 0))
        for c in range(1, hc):
            mixed = ops.ggml_add(ctx, mixed, ops.ggml_view_2d(ctx, gated, e, n, stride, c * row))
        return ops.ggml_scale(ctx, mixed, 1.0 / hc)

    def hc_combine(self, ctx: Any, st: Tensor, block: Tensor, gamma: Tensor, inject: Tensor) -> Tensor:
        """The block's output [n_embd, n] added to every stream, scaled by 2 · sigmoid(inject · normed / hc)
        (build_hc_combine, qwen4exp.cpp:326-354: the weights come from the streams the block read)."""
        e, hc, n = self.hp.n_embd, self.hc, int(st.contents.ne[2])
        xn = ops.ggml_reshape_2d(ctx, self._normed(ctx, st, gamma), hc * e, n)
        raw = ops.ggml_scale(ctx, ops.ggml_mul_mat(ctx, inject, xn), 1.0 / hc)
        w = ops.ggml_scale(ctx, ops.ggml_sigmoid(ctx, raw), 2.0)
        b = ops.ggml_repeat_4d(ctx, ops.ggml_reshape_3d(ctx, block, e, 1, n), e, hc, n, 1)
        return ops.ggml_add(ctx, st, ops.ggml_mul(ctx, b, ops.ggml_reshape_3d(ctx, w, 1, hc, n)))

    # --------------------------------------------------------------------------------------------- graph
    def layer(self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache) -> common.LayerOut:
        w = self.w[il]
        st = self._streams(ctx, x)
        writes: list[Tensor] = []
        if il == self.ple_layer:
            st, writes = self.ngram_injection(ctx, il, st, self._ngrams(ctx, x), common.recurrent_cache(kv))
        attn, attn_writes = self.attention(ctx, il, self.hc_mix(ctx, st, w, "hc_attn"), at, kv)
        st = self.hc_combine(ctx, st, attn, w["hc_attn_norm"], w["hc_attn_inject"])
        cur = self.hc_mix(ctx, st, w, "hc_ffn")
        shared = common.shared_expert(ctx, w, cur, True)
        return common.LayerOut(writes + attn_writes, routed=self.routed(ctx, il, cur, self._flat(ctx, st, x), shared))

    def tail(self, ctx: Any, il: int, experts: Tensor, shared: Tensor | None, residual: Tensor) -> Tensor:
        """(experts + shared) combined into the streams the FFN read (its inject weights from them again: the same
        operations on the same values as when the layer computed its mix)."""
        w = self.w[il]
        out = experts if shared is None else ops.ggml_add(ctx, experts, shared)
        st = self.hc_combine(ctx, self._streams(ctx, residual), out, w["hc_ffn_norm"], w["hc_ffn_inject"])
        return self._flat(ctx, st, residual)

    def tail_array(
        self, il: int, experts: np.ndarray, shared: np.ndarray | None, residual: np.ndarray
    ) -> np.ndarray | None:
        return None  # (a norm and matrix products: the session computes `tail` in a graph)

    def router_input(self, ctx: Any, lo: common.LayerOut) -> Tensor:
        """The FFN's mix plus the shared expert: what the lookahead's later routers score."""
        r = lo.routed
        assert r is not None
        return r.cur if r.shared is None else ops.ggml_add(ctx, r.cur, r.shared)

    def router_norm(self, il: int) -> Tensor:
        return self._ones

    def head(self, ctx: Any, x: Tensor) -> Tensor:
        """The head's mix of the streams (no inject), then the output matrix (qwen4exp.cpp:449-459)."""
        heads = {p: self.weights.get(f"output_hc_{p}.weight") for p in ("norm", "down", "up")}
        cur = self.hc_mix(ctx, self._streams(ctx, x), {f"h_{k}": v for k, v in heads.items()}, "h")
        name = "output.weight" if self.weights.has("output.weight") else "token_embd.weight"
        return ops.ggml_mul_mat(ctx, self.weights.get(name), cur)

    # ------------------------------------------------------------------------------------------ attention
    def attention(
        self, ctx: Any, il: int, x: Tensor, at: common.Placement, kv: common.LayerCache
    ) -> tuple[Tensor, list[Tensor]]:
        """A QSA layer: the indexer's mask, then Qwen3.5's gated attention through it (build_layer_attn)."""
        r = qsa_ratio(self.hp, il)
        if not r:
            return super().attention(ctx, il, x, at, kv)
        cache = common.kv_cache(kv)
        if isinstance(cache, common.BatchKV):  # several sequences' tokens: each selects and attends alone
            return common.attend_alone(ctx, x, at, cache, lambda xi, part, c: self.attention(ctx, il, xi, part, c))
        # the K memory's two blocks, each of contiguous rows: [attention K, n_ctx], then [indexer key, n_ctx]
        width, di = self.hp.head_dim * self.hp.n_head_kv, indexer_keys(self.hp).head_size
        n_ctx, elt = int(cache.k.contents.ne[1]), cache.elt
        attn_k = ops.ggml_view_2d(ctx, cache.k, width, n_ctx, width * elt, 0)
        keys = ops.ggml_view_2d(ctx, cache.k, di, n_ctx, di * elt, width * n_ctx * elt)
        mask, writes = self.qsa_mask(ctx, il, x, at, keys, r)
        out, attn_writes = self.gated_attention(ctx, il, x, at, dataclasses.replace(cache, k=attn_k), mask)
        return out, writes + attn_writes

    def qsa_mask(
        self, ctx: Any, il: int, x: Tensor, at: common.Placement, keys: Tensor, r: int
    ) -> tuple[Tensor | None, list[Tensor]]:
        """QSA's selection as an attention mask (build_qsa_top_k, qwen4exp.cpp:548-699, and llama.cpp's set_input_qsa),
        and the tokens' raw indexer keys written to `keys` [Di, n_ctx]; None: the placement's mask, when the window
        holds no more than the top_k + r - 1 cells a query keeps (all it sees are kept).

        The score of a complete block b (cells br … br + r - 1) for a query: Σ_heads relu(q_h · k_b), k_b the mean of
        its cells' raw keys, RMS-normed (indexer.k_norm) and rotated at br on all four IMRoPE axes; q the query's
        indexer.q_proj, normed per head (indexer.q_norm) and rotated at its position. Every cell takes its block's
        score; the query's own incomplete block (the tail, visible from (q + 1) // r · r on) takes 1e9 more, as
        llama.cpp's bias gives it, so that the tail is always kept; the causal mask is added and top_k of
        min(n_kv, top_k + r - 1) cells picks. The picks among one block's equal scores (a budget that ends inside a
        block) are ggml_top_k's, over llama.cpp's own row: a cell is its position, masked cells are -inf and never
        displace a pick, so only the visible prefix, identical in both, decides (llama.cpp's longer row adds -inf)."""
        hp, w, n, n_kv = self.hp, self.w[il], at.n, at.n_kv
        k = indexer_keys(hp)
        di, heads, eps = k.head_size, k.n_head, hp.rms_eps
        # cached raw: the pooling comes before the norm and the rotation
        raw = ops.ggml_mul_mat(ctx, w["indexer.k_proj"], x)
        writes = [ops.ggml_set_rows(ctx, keys, raw, at.k_rows)]
        width = self.qsa_top_k + r - 1
        if n_kv <= width:
            return None, writes
        blocks, elt = n_kv // r, int(keys.contents.nb[1]) // di  # the complete blocks the window can hold
        pooled: Tensor | None = None
        for i in range(r):  # (llama.cpp sums the members' slices in order, then scales)
            member = ops.ggml_view_2d(ctx, keys, di, blocks, r * di * elt, i * di * elt)
            member = ops.ggml_cast(ctx, member, F32)  # (get_rows' conversion: exact from F16)
            pooled = member if pooled is None else ops.ggml_add(ctx, pooled, member)
        assert pooled is not None
        pooled = ops.ggml_scale(ctx, pooled, float(np.float32(1.0) / np.float32(r)))
        pooled = common.rms_norm(ctx, pooled, w["indexer.k_norm"], eps)
        pooled = ops.ggml_reshape_3d(ctx, pooled, di, 1, blocks)
        pooled = ops.ggml_reshape_2d(
            ctx, common.rope(ctx, pooled, self._block_pos(ctx, blocks, r), self.rope), di, blocks
        )
        q = ops.ggml_reshape_3d(ctx, ops.ggml_mul_mat(ctx, w["indexer.q_proj"], x), di, heads, n)
        q = common.rope(ctx, common.rms_norm(ctx, q, w["indexer.q_norm"], eps), at.positions, self.rope)
        score = ops.ggml_mul_mat(ctx, pooled, ops.ggml_reshape_2d(ctx, q, di, heads * n))  # [blocks, heads · n]
        score = ops.ggml_reshape_3d(ctx, ops.ggml_relu(ctx, score), blocks, heads, n)
        nb = score.contents.nb
        summed = ops.ggml_cont(ctx, ops.ggml_view_2d(ctx, score, blocks, n, int(nb[2]), 0))
        for h in range(1, heads):
            summed = ops.ggml_add(ctx, summed, ops.ggml_view_2d(ctx, score, blocks, n, int(nb[2]), h * int(nb[1])))
        # The tail: block b is complete for a query when its last cell is visible, at.mask[br + r - 1] = 0; else
        # (-inf) its cells, the visible ones of which are the tail, take 1e9 more (clamped to {0, -1}, times -1e9)
        f, row = int(at.mask.contents.nb[0]), int(at.mask.contents.nb[1])
        last = ops.ggml_view_3d(ctx, at.mask, 1, blocks, n, r * f, row, (r - 1) * f)
        last = ops.ggml_clamp(ctx, ops.ggml_cont_2d(ctx, last, blocks, n), -1.0, 0.0)
        summed = ops.ggml_add(ctx, summed, ops.ggml_scale(ctx, last, -1e9))
        # every cell takes its block's value; the cells past the last complete block are a tail or masked
        cells = ops.ggml_repeat_4d(ctx, ops.ggml_reshape_3d(ctx, summed, 1, blocks, n), r, blocks, n, 1)
        cells = ops.ggml_reshape_2d(ctx, cells, r * blocks, n)
        if n_kv > r * blocks:
            rest = ops.ggml_fill(ctx, ops.ggml_new_tensor_2d(ctx, F32, n_kv - r * blocks, n), 1e9)
            cells = ops.ggml_concat(ctx, cells, rest, 0)
        cells = ops.ggml_add(ctx, cells, at.mask)
        top_k = ops.ggml_cont(ctx, ops.ggml_top_k(ctx, cells, width))  # I32 [width, n]
        return common.picks_mask(ctx, top_k, at), writes

    @staticmethod
    def _block_pos(ctx: Any, blocks: int, r: int) -> Tensor:
        """The blocks' first positions on all four IMRoPE axes (llama.cpp's blk_pos: I32 [4 · blocks]), made in
        the graph: a window's count of blocks changes with every prompt chunk (one constant each would pile up)."""
        first = ops.ggml_arange(ctx, 0.0, float(blocks * r), float(r))  # (exact: integers below 2^24)
        four = ops.ggml_cast(ctx, ops.ggml_repeat_4d(ctx, first, blocks, 4, 1, 1), I32)
        return ops.ggml_view_1d(ctx, four, 4 * blocks, 0)

    def output_gate(self, ctx: Any, out: Tensor, weight: Tensor, z: Tensor, eps: float) -> Tensor:
        """Qwen3.5's DeltaNet (`Qwen3Next.linear_attention`) but for this: the output norm gated by sigmoid(z), not
        silu(z) (build_norm_gated, :479-489)."""
        return ops.ggml_mul(ctx, common.rms_norm(ctx, out, weight, eps), ops.ggml_sigmoid(ctx, z))

    # ------------------------------------------------------------------------------------- the n-gram table
    @classmethod
    def layer_state(cls, hp: HParams, shapes: dict[str, tuple[int, ...]], il: int) -> common.StateSpec | None:
        """The DeltaNet's state; the table's layer keeps its injection's convolution history too, as more slots
        of the convolution state (the runtime copies a state whole: checkpoints, snapshots)."""
        spec = super().layer_state(hp, shapes, il)
        if spec is None or il != ple_keys(hp)[0]:
            return spec
        per_slot = spec.conv[0] * spec.conv[1]
        extra = -(-cls.history_tokens(hp, shapes) * cls.streams(hp, shapes) * hp.n_embd // per_slot)
        return common.StateSpec((spec.conv[0], spec.conv[1], 1 + extra), spec.state)

    def _history(self, ctx: Any, conv: Tensor) -> Tensor:
        """The injection's convolution history [hist, hc · n_embd] (tokens on ne0), after the DeltaNet's slot."""
        c = conv.contents
        f = int(c.nb[0])
        return ops.ggml_view_2d(ctx, conv, self.ple_hist, self.hc * self.hp.n_embd, f * self.ple_hist, int(c.nb[2]))

    def ngram_injection(
        self, ctx: Any, il: int, st: Tensor, ngrams: Tensor, cache: common.RecurrentCache
    ) -> tuple[Tensor, list[Tensor]]:
        """The n-gram vectors [n_embd, n] gated into the streams st and convolved (build_ple, :1220-1308)."""
        w, e, hc, n = self.w[il], self.hp.n_embd, self.hc, int(st.contents.ne[2])
        key = self._normed(
            ctx, ops.ggml_reshape_3d(ctx, ops.ggml_mul_mat(ctx, w["ple_key"], ngrams), e, hc, n), w["ple_norm_key"]
        )
        query = self._normed(ctx, st, w["ple_norm_query"])
        s = ops.ggml_scale(ctx, ops.ggml_sum_rows(ctx, ops.ggml_mul(ctx, key, query)), 1.0 / math.sqrt(e))
        magnitude = ops.ggml_sqrt(ctx, ops.ggml_clamp(ctx, ops.ggml_abs(ctx, s), 1e-6, math.inf))
        gate = ops.ggml_sigmoid(ctx, ops.ggml_mul(ctx, ops.ggml_sgn(ctx, s), magnitude))  # [1, hc, n]
        value = ops.ggml_reshape_3d(ctx, ops.ggml_mul_mat(ctx, w["ple_value"], ngrams), e, 1, n)
        gated = ops.ggml_mul(ctx, ops.ggml_repeat_4d(ctx, value, e, hc, n, 1), gate)
        normalized = ops.ggml_reshape_2d(ctx, self._normed(ctx, gated, w["ple_norm_conv"]), hc * e, n)
        # the depthwise causal convolution, dilated by the n-gram size, as a sum of shifted copies
        hist, kernel, dil = self.ple_hist, self.ple_kernel, self.ple.ngram if self.ple else 0
        history = self._history(ctx, cache.conv)
        padded = ops.ggml_concat(ctx, history, ops.ggml_transpose(ctx, normalized), 0)  # [hist + n, hc · e]
        f, row = int(padded.contents.nb[0]), int(padded.contents.nb[1])

        def columns(start: int, count: int) -> Tensor:
            return ops.ggml_view_2d(ctx, padded, count, hc * e, row, f * start)

        writes = [ops.ggml_cpy(ctx, columns(n, hist), history)]
        if cache.snapshot is not None:
            writes.append(ops.ggml_cpy(ctx, columns(n - 1, hist), self._history(ctx, cache.snapshot.conv)))
        taps = w["ple_conv1d"]
        conv: Tensor | None = None
        for k in range(kernel):
            shifted = ops.ggml_cont(ctx, ops.ggml_transpose(ctx, columns(hist - (kernel - 1 - k) * dil, n)))
            tap = ops.ggml_view_2d(ctx, taps, 1, hc * e, int(taps.contents.nb[1]), k * int(taps.contents.nb[0]))
            tap = ops.ggml_reshape_2d(ctx, ops.ggml_cont(ctx, tap), hc * e, 1)
            if int(taps.contents.type) != F32:
                tap = ops.ggml_cast(ctx, tap, F32)
            term = ops.ggml_mul(ctx, shifted, tap)
            conv = term if conv is None else ops.ggml_add(ctx, conv, term)
        assert conv is not None
        conv = ops.ggml_reshape_3d(ctx, ops.ggml_silu(ctx, conv), e, hc, n)
        return ops.ggml_add(ctx, st, ops.ggml_add(ctx, gated, conv)), writes
