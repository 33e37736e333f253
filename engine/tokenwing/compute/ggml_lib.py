"""ggml (the kernels llama.cpp runs), through `ggml-python`, behind this one module.

Traps handled here: a few functions declare pointer results with the wrong ctypes type; ggml keeps raw
pointers (every array we hand it is kept alive by its owner object); buffers must be 32/64-byte aligned
(we hand it page-aligned memory); a failed ggml assert aborts the process (GGML_NO_BACKTRACE is set before
the library loads, so it does not try to attach a debugger).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

os.environ.setdefault("GGML_NO_BACKTRACE", "1")
import ggml

for _name in (
    "ggml_backend_cpu_buffer_from_ptr",
    "ggml_backend_cpu_buffer_type",
    "ggml_backend_alloc_buffer",
    "ggml_backend_sched_get_tensor_backend",
):
    getattr(ggml, _name).restype = ctypes.c_void_p

Tensor = Any  # a ctypes pointer to ggml_tensor

F32 = ggml.GGML_TYPE_F32
F16 = ggml.GGML_TYPE_F16
I32 = ggml.GGML_TYPE_I32
ROPE_NEOX = ggml.GGML_ROPE_TYPE_NEOX
ROPE_NORM = 0


def aligned_bytes(n: int) -> np.ndarray:
    """Page-aligned zeroed memory as a uint8 array (anonymous mmap: freed with its last reference).

    Large blocks ask for transparent huge pages: weight sweeps then miss the TLB far less.
    """
    m = mmap.mmap(-1, max(n, 1))
    if n >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, dtype=np.uint8)


class TensorArena:
    """Tensors whose data lives in memory we own (weights, KV cache, slot pools): metadata only in ggml."""

    def __init__(self, max_tensors: int) -> None:
        size = ggml.ggml_tensor_overhead() * max_tensors + 1024
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True))
        self._owners: list[object] = []

    def wrap(
        self,
        data: np.ndarray | int,
        gtype: int,
        shape: Sequence[int],
        owner: object = None,
        strides: Sequence[int] | None = None,
    ) -> Tensor:
        """A ggml tensor over `data` (an array, or an address kept alive by `owner`), GGUF shape order."""
        t = _new_tensor(self.ctx, gtype, shape)
        if isinstance(data, np.ndarray):
            t.contents.data = data.ctypes.data
            self._owners.append(data)
        else:
            t.contents.data = data
        if owner is not None:
            self._owners.append(owner)
        if strides is not None:
            for i, s in enumerate(strides):
                t.contents.nb[i] = s
        return t

    def close(self) -> None:
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = None
        self._owners.clear()


def _new_tensor(ctx: Any, gtype: int, shape: Sequence[int]) -> Tensor:
    n = len(shape)
    if n == 1:
        return ggml.ggml_new_tensor_1d(ctx, gtype, shape[0])
    if n == 2:
        return ggml.ggml_new_tensor_2d(ctx, gtype, shape[0], shape[1])
    if n == 3:
        return ggml.ggml_new_tensor_3d(ctx, gtype, shape[0], shape[1], shape[2])
    return ggml.ggml_new_tensor_4d(ctx, gtype, shape[0], shape[1], shape[2], shape[3])


class Graph:
    """One compute graph at a time in a reusable context: build with ggml ops, then `compute`."""

    def __init__(self, mem_bytes: int, n_threads: int, poll: int | None = None) -> None:
        self.mem_bytes = mem_bytes
        self.n_threads = n_threads
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem_bytes, mem_buffer=None, no_alloc=False))
        # One thread pool for the session: creating threads for every graph costs more than small graphs.
        params = ggml.ggml_threadpool_params_default(n_threads)
        if poll is not None:
            params.poll = poll
        self.pool = ggml.ggml_threadpool_new(ctypes.byref(params))
        self._work = aligned_bytes(1 << 20)

    def reset(self) -> Any:
        ggml.ggml_reset(self.ctx)
        return self.ctx

    def input(self, array: np.ndarray, gtype: int | None = None) -> Tensor:
        """A tensor holding a copy of a small numpy array (ids, positions, routing weights, hidden states)."""
        a = np.ascontiguousarray(array)
        if gtype is None:
            gtype = {np.dtype(np.float32): F32, np.dtype(np.int32): I32, np.dtype(np.float16): F16}[a.dtype]
        t = _new_tensor(self.ctx, gtype, tuple(reversed(a.shape)) or (1,))
        ctypes.memmove(t.contents.data, a.ctypes.data, a.nbytes)
        return t

    def compute(self, *outputs: Tensor, n_nodes: int = 4096) -> None:
        gf = ggml.ggml_new_graph_custom(self.ctx, n_nodes, False)
        for out in outputs:
            ggml.ggml_build_forward_expand(gf, out)
        plan = ggml.ggml_graph_plan(gf, self.n_threads, self.pool)
        if plan.work_size:
            if plan.work_size > self._work.size:
                self._work = aligned_bytes(int(plan.work_size) * 2)
            plan.work_data = ctypes.cast(self._work.ctypes.data, ctypes.POINTER(ctypes.c_uint8))
        rc = ggml.ggml_graph_compute(gf, ctypes.byref(plan))
        if rc != 0:
            raise RuntimeError(f"ggml graph compute failed ({rc})")

    def close(self) -> None:
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = None
        if self.pool:
            ggml.ggml_threadpool_free(self.pool)
            self.pool = None


def to_numpy(t: Tensor, dtype: type = np.float32) -> np.ndarray:
    """A copy of a contiguous tensor's data, in numpy order (reversed GGUF shape)."""
    shape = tuple(int(t.contents.ne[i]) for i in range(ggml.GGML_MAX_DIMS))
    n = int(np.prod(shape))
    item = np.dtype(dtype).itemsize
    raw = ctypes.string_at(t.contents.data, n * item)
    dims = list(reversed(shape))
    while len(dims) > 1 and dims[0] == 1:
        dims.pop(0)
    out: np.ndarray = np.frombuffer(raw, dtype=dtype, count=n).reshape(dims).copy()
    return out


ops = ggml
