"""The KV cache: per layer, K with a row per position and V transposed, in memory we own (charged as it is
written, so a long context costs only what is used); a linear-attention layer has its recurrent state instead."""

from __future__ import annotations

import dataclasses
import mmap

import numpy as np

from tokenwing.compute.ggml_lib import F16, F32, TensorArena, aligned_bytes, file_backed_bytes
from tokenwing.errors import BadInputError
from tokenwing.models.common import KVCache, KVSpec, LayerCache
from tokenwing.runtime.recurrent import StateBuffers

KV_TYPES = {"f16": (F16, 2), "f32": (F32, 4)}


def kv_element(name: str) -> tuple[int, int]:
    """(ggml type, bytes per element) of a `--kv-type`."""
    try:
        return KV_TYPES[name]
    except KeyError:
        raise BadInputError("--kv-type must be f16 or f32") from None


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
    ) -> None:
        """`spill`: a folder whose files back K and V (`file_backed_bytes`) instead of anonymous memory — the
        fallback when the cache does not fit beside the expert cache's minimum under the memory limit (an OSError
        there, such as a full disk, is the caller's to handle)."""
        gtype, elt = kv_element(kv_type)
        self.n_ctx = n_ctx
        self.states = states
        self.layers: list[LayerCache] = []
        self._memory = []
        self._maps: dict[int, list[mmap.mmap]] = {}
        self.spilled = spill is not None

        def memory(il: int, n: int) -> np.ndarray:
            if spill is None:
                return aligned_bytes(n)
            data, mapping = file_backed_bytes(n, spill)
            self._maps.setdefault(il, []).append(mapping)
            return data

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


def v_width(specs: list[KVSpec]) -> int:
    """The V elements per position a placement writes: every attention layer's are alike (0: V lives in K, or
    no layer attends)."""
    return next((s.v_stored for s in specs if s.k), 0)
