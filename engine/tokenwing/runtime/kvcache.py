"""The KV cache: per layer, K with a row per position and V transposed, in memory we own (charged as it is
written, so a long context costs only what is used); a linear-attention layer has its recurrent state instead."""

from __future__ import annotations

import dataclasses
import mmap

import numpy as np

from tokenwing.compute.ggml_lib import F16, F32, TensorArena, aligned_bytes, file_backed_bytes
from tokenwing.errors import BadInputError
from tokenwing.models.common import KVCache, KVSpec, KVStack, LayerCache
from tokenwing.runtime.recurrent import StateBuffers

KV_TYPES = {"f16": (F16, 2), "f32": (F32, 4)}


def kv_element(name: str) -> tuple[int, int]:
    """(ggml type, bytes per element) of a `--kv-type`."""
    try:
        return KV_TYPES[name]
    except KeyError:
        raise BadInputError("--kv-type must be f16 or f32") from None


def _zeroed(n: int, spill: str | None, maps: list[mmap.mmap]) -> np.ndarray:
    """n bytes of zeroed cache memory: anonymous, or backed by a file in `spill` (its mapping added to `maps`, for
    `write_back`)."""
    if spill is None:
        return aligned_bytes(n)
    data, mapping = file_backed_bytes(n, spill)
    maps.append(mapping)
    return data


class KVCaches:
    """Every layer's cache: K and V for an attention layer, the recurrent state for a linear-attention one
    (`states`, runtime/recurrent.py)."""

    def __init__(
        self,
        arena: TensorArena,
        specs: list[KVSpec],
        n_ctx: int,
        kv_type: str,
        states: StateBuffers | None = None,
        spill: str | None = None,
        stacks: KVStacks | None = None,
    ) -> None:
        """`spill`: a folder whose files back K and V (`file_backed_bytes`) instead of anonymous memory — the
        fallback when the cache does not fit beside the expert cache's minimum under the memory limit (an OSError
        there, such as a full disk, is the caller's to handle). `stacks`: the slots' memory, of which this cache
        takes the next slot (`KVStacks`), instead of memory of its own."""
        gtype, elt = kv_element(kv_type)
        self.n_ctx = n_ctx
        self.states = states
        self.layers: list[LayerCache] = []
        self._memory = []
        self._maps: dict[int, list[mmap.mmap]] = {}
        self.spilled = spill is not None

        def memory(il: int, n: int) -> np.ndarray:
            if stacks is not None:
                return stacks.take(il, n)
            return _zeroed(n, spill, self._maps.setdefault(il, []))

        for il, spec in enumerate(specs):
            state = states.layers.get(il) if states is not None else None
            if state is not None and not spec.k:
                self.layers.append(state)
                continue
            k_mem = memory(il, spec.k * elt * n_ctx)
            v_mem = memory(il, spec.v_stored * elt * n_ctx) if spec.v_stored else None
            self._memory.append((k_mem, v_mem))
            k = arena.wrap(k_mem, gtype, (spec.k, n_ctx))
            v = arena.wrap(v_mem, gtype, (n_ctx, spec.v)) if v_mem is not None else None
            kv = KVCache(k, v, elt, spec.v)
            # (a layer with both: DeepSeek V4's compressing attention, its compressors' rows in the state)
            self.layers.append(kv if state is None else dataclasses.replace(state, kv=kv))

        self.slot: int | None = None  # its slot of the stacks it joined, if any
        if stacks is not None:
            self._join(stacks)

    def _join(self, stacks: KVStacks) -> None:
        """Marks each attention layer's cache as its slot of the stack (what a batch's attention reads through)."""
        index = self.slot = stacks.joined
        stacks.joined += 1
        for il, layer in enumerate(self.layers):
            if isinstance(layer, KVCache) and il in stacks.layers:
                self.layers[il] = dataclasses.replace(layer, stack=stacks.layers[il], index=index)
                self._maps[il] = stacks.maps.get(il, [])

    @property
    def nbytes(self) -> int:
        """The K and V memory this cache holds (anonymous or file-backed; recurrent states are not KV)."""
        return sum(k.nbytes + (v.nbytes if v is not None else 0) for k, v in self._memory)

    def __getitem__(self, il: int) -> LayerCache:
        return self.layers[il]

    def write_back(self, il: int | None = None) -> None:
        """Writes a spilled cache's new positions to its files: written-back pages are what a memory limit can
        reclaim (dirty ones it cannot drop, and a memory cgroup full of them is OOM-killed before the flusher
        threads come by: their default is every 30 s). `il`: that layer's only."""
        for layer, maps in self._maps.items():
            if il is None or layer == il:
                for m in maps:
                    m.flush()


class KVStacks:
    """The caches of `n_seq` sequences (the server's slots) with each layer's K of all of them in one block of
    memory and V in another, slot after slot: each sequence's `KVCaches` takes its slot's slices (`take`), and a
    decode step of several reads their attention through one product over the block (`common.KVStack`). Memory
    is charged as it is written, as a cache of its own is."""

    def __init__(
        self, arena: TensorArena, specs: list[KVSpec], n_ctx: int, kv_type: str, n_seq: int, spill: str | None = None
    ) -> None:
        gtype, elt = kv_element(kv_type)
        self.n_seq, self.joined = n_seq, 0
        self.maps: dict[int, list[mmap.mmap]] = {}
        self.layers: dict[int, KVStack] = {}
        self._blocks: dict[int, list[np.ndarray]] = {}  # K's block, V's
        self._taken: dict[int, int] = {}
        for il, spec in enumerate(specs):
            if not spec.k:
                continue
            maps = self.maps.setdefault(il, [])
            blocks = []
            for n in (spec.k, spec.v_stored) if spec.v_stored else (spec.k,):
                blocks.append(_zeroed(n * elt * n_ctx * n_seq, spill, maps))
            self._blocks[il] = blocks
            k = arena.wrap(blocks[0], gtype, (spec.k, n_ctx, n_seq))
            v = arena.wrap(blocks[1], gtype, (n_ctx, spec.v, n_seq)) if spec.v_stored else None
            self.layers[il] = KVStack(k, v)

    def take(self, il: int, n: int) -> np.ndarray:
        """The next slot's K (then V) of layer il: slots take their layers in order, K before V."""
        blocks = self._blocks[il]
        i = self._taken.get(il, 0)
        self._taken[il] = i + 1
        slot, block = divmod(i, len(blocks))
        assert slot < self.n_seq and blocks[block].size == n * self.n_seq, "a slot asked for memory out of turn"
        return blocks[block][slot * n : (slot + 1) * n]


def v_width(specs: list[KVSpec]) -> int:
    """The V elements per position a placement writes: the widest attention layer's, whose first cells a narrower
    layer writes (Gemma 4's full and sliding-window layers differ); 0: V lives in K, or no layer attends."""
    return max((s.v_stored for s in specs if s.k), default=0)
