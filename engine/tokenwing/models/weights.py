"""Resident weights in memory we own, as ggml tensors."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from tokenwing.compute.ggml_lib import F16, F32, Repacker, Tensor, TensorArena, aligned_bytes
from tokenwing.format.gguf_io import TensorInfo, tensor_nbytes
from tokenwing.format.reader import ModelFile

_ALIGN = 64

# Weights used only as the first operand of matrix products: the ones ggml may keep in a repacked layout
# (token_embd is also read by get_rows, norms and biases are added, routers are read by numpy).
_FFN = ("ffn_gate", "ffn_up", "ffn_down")
_LINEAR_ATTENTION = (
    "attn_qkv",
    "attn_gate",
    "ssm_in",
    "ssm_out",
    "ssm_ba",
    "ssm_alpha",
    "ssm_beta",
    "ssm_f_a",
    "ssm_g_a",
)
_MATMUL_WEIGHTS = {
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    *_FFN,
    *(w + "_shexp" for w in _FFN),
    *_LINEAR_ATTENTION,
}


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def resident_bytes(tensors: Iterable[TensorInfo]) -> int:
    """The memory ModelWeights takes for these tensors, each aligned (`tokenwing info` plans a server's slots by
    it before loading any)."""
    return sum(_align(t.nbytes) for t in tensors)


class ModelWeights:
    """Every resident tensor, loaded (checksummed) into one aligned allocation."""

    def __init__(
        self, mf: ModelFile, extra_tensors: int = 64, repack: bool = True, lazy: frozenset[str] = frozenset()
    ) -> None:
        """`lazy`: resident tensors left in the file (a family reads their rows as it needs them: `lazy` holds
        each one's file, absolute offset and info)."""
        n_layers = len(mf.index.layers)
        self.lazy = {t.name: (mf.path, mf.tensor_offset(t), t) for t in mf.resident if t.name in lazy}
        # (next-token-prediction blocks are kept in the file, never loaded; lazy tensors are read sparsely)
        resident = [t for t in mf.resident if t.name not in lazy]
        self.arena = TensorArena(len(resident) + 3 * n_layers + extra_tensors)
        total = resident_bytes(resident)
        self.memory = aligned_bytes(total)
        self.tensors: dict[str, Tensor] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.types: dict[str, int] = {}
        off = 0
        for _, _, lazy_info in self.lazy.values():
            self.shapes[lazy_info.name] = lazy_info.shape
            self.types[lazy_info.name] = lazy_info.type
        for info, data in mf.iter_resident(frozenset(lazy)):
            view = self.memory[off : off + info.nbytes]
            view[:] = np.frombuffer(data, dtype=np.uint8)
            self.tensors[info.name] = self.arena.wrap(view, info.type, info.shape)
            self.shapes[info.name] = info.shape
            self.types[info.name] = info.type
            off = _align(off + info.nbytes)
        self.bytes = total
        self.repacked = self._repack() if repack else 0

    def _repack(self) -> int:
        """Matrix weights into ggml's repacked layout where this CPU has one (as llama.cpp does by default)."""
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
