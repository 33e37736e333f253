"""Resident weights in memory we own, as ggml tensors; streamed experts as views of the core's slot pools."""

from __future__ import annotations

import ctypes

import numpy as np

from tokenwing.compute.ggml_lib import F16, F32, Repacker, Tensor, TensorArena, aligned_bytes, quiet_debug_log
from tokenwing.format.gguf_io import tensor_nbytes
from tokenwing.format.reader import ModelFile
from tokenwing.streaming.streamer import ExpertStreamer

_ALIGN = 64

# Weights used only as the first operand of matrix products: the ones ggml may keep in a repacked layout
# (token_embd is also read by get_rows, norms and biases are added, routers are read by numpy).
_FFN = ("ffn_gate", "ffn_up", "ffn_down")
_MATMUL_WEIGHTS = {"attn_q", "attn_k", "attn_v", "attn_output", *_FFN, *(w + "_shexp" for w in _FFN)}


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class ModelWeights:
    """Every resident tensor, loaded (checksummed) into one aligned allocation."""

    def __init__(self, mf: ModelFile, extra_tensors: int = 64, repack: bool = True) -> None:
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
        self.repacked = self._repack() if repack else 0
        self._slot_arena: TensorArena | None = None
        self.slot_matrices: dict[int, list[list[Tensor]]] = {}  # block → [projection][slot] 2-D tensors

    def _repack(self) -> int:
        """Matrix weights into ggml's repacked layout where this CPU has one (as llama.cpp does by default)."""
        quiet_debug_log()
        repacker, n = Repacker(), 0
        for name, t in self.tensors.items():
            base = name.removesuffix(".weight")
            if name == "output.weight" or (
                name.startswith("blk.") and name.endswith(".weight") and base.split(".", 2)[-1] in _MATMUL_WEIGHTS
            ):
                n += repacker.repack(t, tensor_nbytes(self.shapes[name], self.types[name]))
        return n

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

    def stacked(self, names: list[str], half: bool = False) -> Tensor:
        """Several F32 matrices with the same row length, stacked into one (a fused matmul); in F16 with
        `half` (half the bytes to read per use, where the result only ranks, as lookahead predictions do)."""
        parts = [self.array(n) for n in names]
        stacked = np.ascontiguousarray(np.concatenate(parts, axis=0).astype(np.float16 if half else np.float32))
        return self.arena.wrap(stacked, F16 if half else F32, (stacked.shape[1], stacked.shape[0]))

    def expert_views(self, streamer: ExpertStreamer, repack: bool = True) -> dict[int, tuple[Tensor, Tensor, Tensor]]:
        """Per streamed layer: gate, up and down as 3-D tensors over the slot pool (expert stride = record),
        for mul_mat_id (one token), and as 2-D matrices per slot (`slot_matrices`), for the plain matrix
        products of a prompt (one expert's tokens at once: ggml's batched kernels).

        With `repack`, projections that have a repacked kernel on this CPU are kept in that layout: the
        streaming core's I/O threads rewrite each one as it lands, so resident and streamed runs compute
        with the same kernels (bit-identical results).
        """
        repacker = Repacker() if repack else None
        if repacker is not None:
            quiet_debug_log()
        layers = streamer.index.layers
        self._slot_arena = TensorArena(3 * sum(streamer.pools[li].shape[0] for li in range(len(layers))) + 8)
        views: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        for li, el in enumerate(layers):
            pool = streamer.pools[li]
            n_slots = pool.shape[0]
            base = pool.ctypes.data
            out, mats = [], []
            for p in range(3):
                ne0, ne1 = el.shapes[p]
                row = tensor_nbytes((ne0,), el.types[p])
                elt = tensor_nbytes((_block(el.types[p]),), el.types[p])
                view = self.arena.wrap(
                    base + el.proj_offset[p],
                    el.types[p],
                    (ne0, ne1, n_slots),
                    owner=pool,
                    strides=(elt, row, el.record_size),
                )
                per_slot = [
                    self._slot_arena.wrap(base + s * el.record_size + el.proj_offset[p], el.types[p], (ne0, ne1), pool)
                    for s in range(n_slots)
                ]
                if repacker is not None and repacker.prepare(view):
                    for t in per_slot:
                        repacker.prepare(t)
                    # each landed projection goes through ggml's repacking into its slot (an I/O thread)
                    ctx = [ctypes.addressof(t.contents) for t in per_slot]
                    streamer.core.set_transform(li, p, repacker.setter(), ctx)
                out.append(view)
                mats.append(per_slot)
            views[el.layer] = (out[0], out[1], out[2])
            self.slot_matrices[el.layer] = mats
        return views


def _block(gtype: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return int(GGML_QUANT_SIZES[GGMLQuantizationType(gtype)][0])
