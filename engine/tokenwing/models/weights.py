"""Resident weights in memory we own, as ggml tensors; streamed experts as views of the core's slot pools."""

from __future__ import annotations

import numpy as np

from tokenwing.compute.ggml_lib import Tensor, TensorArena, aligned_bytes
from tokenwing.format.gguf_io import tensor_nbytes
from tokenwing.format.reader import ModelFile
from tokenwing.streaming.streamer import ExpertStreamer

_ALIGN = 64


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class ModelWeights:
    """Every resident tensor, loaded (checksummed) into one aligned allocation."""

    def __init__(self, mf: ModelFile, extra_tensors: int = 64) -> None:
        n_layers = len(mf.index.layers)
        self.arena = TensorArena(len(mf.resident) + 3 * n_layers + extra_tensors)
        total = sum(_align(t.nbytes) for t in mf.resident)
        self.memory = aligned_bytes(total)
        self.tensors: dict[str, Tensor] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.types: dict[str, int] = {}
        off = 0
        for info, data in mf.iter_resident():
            view = self.memory[off : off + info.nbytes]
            view[:] = np.frombuffer(data, dtype=np.uint8)
            self.tensors[info.name] = self.arena.wrap(view, info.type, info.shape)
            self.shapes[info.name] = info.shape
            self.types[info.name] = info.type
            off = _align(off + info.nbytes)
        self.bytes = total

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> Tensor:
        return self.tensors[name]

    def array(self, name: str) -> np.ndarray:
        """An F32 resident tensor as a numpy view (routers, norms), numpy order."""
        t = self.tensors[name]
        shape = self.shapes[name]
        n = int(np.prod(shape))
        base = int(t.contents.data)
        start = base - self.memory.ctypes.data
        return self.memory[start : start + 4 * n].view(np.float32).reshape(tuple(reversed(shape)))

    def stacked(self, names: list[str]) -> Tensor:
        """Several F32 matrices with the same row length, stacked into one (a fused matmul)."""
        parts = [self.array(n) for n in names]
        stacked = np.ascontiguousarray(np.concatenate(parts, axis=0))
        return self.arena.wrap(stacked, 0, (stacked.shape[1], stacked.shape[0]))

    def expert_views(self, streamer: ExpertStreamer) -> dict[int, tuple[Tensor, Tensor, Tensor]]:
        """Per streamed layer: gate, up and down as 3-D tensors over the slot pool (expert stride = record)."""
        views: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        for li, el in enumerate(streamer.index.layers):
            pool = streamer.pools[li]
            n_slots = pool.shape[0]
            base = pool.ctypes.data
            out = []
            for p in range(3):
                ne0, ne1 = el.shapes[p]
                row = tensor_nbytes((ne0,), el.types[p])
                elt = tensor_nbytes((_block(el.types[p]),), el.types[p])
                out.append(
                    self.arena.wrap(
                        base + el.proj_offset[p],
                        el.types[p],
                        (ne0, ne1, n_slots),
                        owner=pool,
                        strides=(elt, row, el.record_size),
                    )
                )
            views[el.layer] = (out[0], out[1], out[2])
        return views


def _block(gtype: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return int(GGML_QUANT_SIZES[GGMLQuantizationType(gtype)][0])
