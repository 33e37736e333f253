"""What a layer keeps per sequence: its KV cache (`KVSpec`, `KVCache`, the slots' stacked `KVStack`, a batch's
`BatchKV`) or its recurrent state (`StateSpec`, `RecurrentCache`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenwing.compute.ggml_lib import Tensor


@dataclass(frozen=True)
class KVSpec:
    """A layer's cache widths (elements per position): K, and V — stored apart, or (`v_in_k`) the first
    `v` values of each K row, as MLA's compressed latent is both."""

    k: int
    v: int
    v_in_k: bool = False

    @property
    def v_stored(self) -> int:
        """V elements per position stored apart from K (0 when V lives in K)."""
        return 0 if self.v_in_k else self.v

    def bytes_per_position(self, elt: int) -> int:
        """What one position of this layer's cache takes, K and V at `elt` bytes an element (the runtime's cache
        allocates exactly this per position: runtime/kvcache.py)."""
        return (self.k + self.v_stored) * elt


@dataclass(frozen=True)
class KVStack:
    """One layer's caches of every slot in one tensor each (the server's sequences, runtime/kvcache.py): K [k_width,
    n_ctx, slots] and V [n_ctx, v_width, slots] (None: V lives in K). Several sequences' attention then reads
    them as one product (`Run`)."""

    k: Tensor
    v: Tensor | None


@dataclass(frozen=True)
class KVCache:
    """One layer's cache: K [k_width, n_ctx] (a row per position) and V transposed [n_ctx, v_width]; or K alone
    (`v` None: V is the first `v_width` values of each K row, as MLA's latent is). `stack`: the every-slot tensors
    whose slot `index` this cache is, if it is one."""

    k: Tensor
    v: Tensor | None
    elt: int  # bytes per element
    v_width: int
    stack: KVStack | None = None
    index: int = 0


@dataclass(frozen=True)
class StateSpec:
    """A linear-attention layer's recurrent state (F32, GGUF shape order): the last inputs of its short
    convolution, and the delta rule's state matrices, one per value head."""

    conv: tuple[int, ...]
    state: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.conv) + math.prod(self.state)


@dataclass(frozen=True)
class RecurrentCache:
    """One linear-attention layer's state, updated in place by each graph that runs the layer (a prompt's
    chunks one after the other, then each decode step): there is one state, that of the last position.

    `snapshot`: where the graph also writes the state as it was one token before its last (a prompt's end,
    kept as a checkpoint: a request that repeats the prompt resumes there and computes its last token); the
    graph must have at least two tokens then."""

    conv: Tensor
    state: Tensor
    snapshot: RecurrentCache | None = None
    # A layer with a KV cache too (DeepSeek V4's compressing attention: its positions in K, the rows its
    # compressors carry between graphs in the state)
    kv: KVCache | None = None


@dataclass(frozen=True)
class BatchKV(KVCache):
    """One layer's caches of several sequences whose decode tokens share a graph (`Placement.parts`): the
    fields are the first sequence's (what a family reads of a cache's shape), `caches` every one's."""

    caches: tuple[KVCache, ...] = ()


LayerCache = KVCache | RecurrentCache


def kv_cache(cache: LayerCache) -> KVCache:
    """The cache of an attention layer (a family asks for the kind its layer has)."""
    assert isinstance(cache, KVCache), "an attention layer was given a recurrent state"
    return cache


def recurrent_cache(cache: LayerCache) -> RecurrentCache:
    assert isinstance(cache, RecurrentCache), "a linear-attention layer was given a KV cache"
    return cache
